"""TableOptions (the user's choices) and Tuning (the knobs): every name settable from Python and
from its PLESTORE_* variable, knobs read through, validation naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from plestore.options import TableOptions, Tuning

#: a non-default value for every option, and how its variable spells it
VALUES = {
    "tier": ("direct", "direct"),
    "device": ("cpu", "cpu"),
    "row_start": (3, "3"),
    "row_end": (9, "9"),
    "timeout_s": (2.5, "2.5"),
    "progress": (True, "1"),
    "share": ("node", "node"),
    "verify_reads": (True, "on"),
    "cache_bytes": (2 << 20, "2M"),
    "rss_budget_bytes": (1 << 30, "1GiB"),
    "gpu_cache_bytes": (4096, "4096"),
    "device_budget_bytes": (1 << 20, "1M"),
    "pinned_budget_bytes": (0, "0"),
    "threads": (7, "7"),
    "queue_depth": (16, "16"),
    "io_engine": ("threads", "threads"),
    "willneed": (True, "yes"),
    "gather": ("gpu", "gpu"),
    "hugepages": (False, "0"),
    "inline_ids": (0, "0"),
    "check_ids": (False, "false"),
    "gpu_cache_static": (0.5, "0.5"),
    "gpu_cache_admit_min": (1, "1"),
    "native": ("off", "off"),
}


def test_every_option_is_covered_here():
    assert sorted(VALUES) == sorted(TableOptions.names())


def test_user_choices_apart_from_knobs():
    own = {f.name for f in dataclasses.fields(TableOptions)} - {"tuning"}
    knobs = {f.name for f in dataclasses.fields(Tuning)}
    assert not own & knobs
    assert {"threads", "queue_depth", "io_engine", "gather", "inline_ids", "native"} <= knobs
    assert {"tier", "device", "cache_bytes", "share", "verify_reads", "timeout_s"} <= own


@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_option_from_python_and_from_its_variable(name):
    value, raw = VALUES[name]
    extra = {"row_start": 0, "row_end": 10} if name.startswith("row_") else {}
    env = {f"PLESTORE_{k.upper()}": str(v) for k, v in extra.items()}
    for opts in (
        TableOptions.from_env({}, **{**extra, name: value}),
        TableOptions.from_env({**env, f"PLESTORE_{name.upper()}": raw}),
        TableOptions(**{**extra, name: value}),
        TableOptions(**extra).replace(**{name: value}),
    ):
        assert getattr(opts, name) == value  # a knob reads through to opts.tuning
        if name in {f.name for f in dataclasses.fields(Tuning)}:
            assert getattr(opts.tuning, name) == value
    explicit = TableOptions.from_env({f"PLESTORE_{name.upper()}": raw}, **{**extra, name: value})
    assert getattr(explicit, name) == value


def test_knobs_keep_their_defaults_unless_set_and_compare_as_values():
    a = TableOptions(tier="pinned", threads=4)
    assert a.tuning == Tuning(threads=4) and a.replace(tier="direct").tuning == a.tuning
    assert a == TableOptions(tier="pinned", tuning=Tuning(threads=4))
    assert a != TableOptions(tier="pinned")
    assert TableOptions("mapped").tier == "mapped"
    with pytest.raises(TypeError, match="unknown table options: colour"):
        TableOptions(colour="red")
    with pytest.raises(TypeError, match="unknown table options: colour"):
        TableOptions.from_env({}, colour="red")
    with pytest.raises(AttributeError, match="no attribute 'colour'"):
        _ = a.colour


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threads": 0}, "threads must be >= 1"),
        ({"io_engine": "aio"}, "io_engine must be auto, io_uring or threads"),
        ({"gather": "both"}, "gather must be auto, cpu or gpu"),
        ({"gpu_cache_static": 1.5}, r"gpu_cache_static must be in \[0, 1\]"),
        ({"native": "fast"}, "native must be auto, on or off"),
        ({"inline_ids": -1}, "inline_ids must be >= 0"),
        ({"tier": "floppy"}, "tier must be one of"),
        ({"cache_bytes": -1}, "cache_bytes must be >= 0"),
        ({"row_start": 1}, "give both row_start and row_end"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TableOptions(**kwargs)


def test_a_bad_variable_names_itself():
    with pytest.raises(ValueError, match="PLESTORE_QUEUE_DEPTH='deep'"):
        TableOptions.from_env({"PLESTORE_QUEUE_DEPTH": "deep"})
