"""TableOptions (the user's choices) and Tuning (the knobs): every name settable from Python and
from its PLESTORE_* variable, knobs read through, validation naming the field."""

from __future__ import annotations

import dataclasses
import re

import pytest

import plestore
from plestore.options import Defaults, TableOptions, Tuning

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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threads": "8"}, "threads must be an integer, got '8' (str)"),
        ({"cache_bytes": "1G"}, "cache_bytes must be an integer, got '1G' (str)"),
        ({"timeout_s": float("nan")}, "timeout_s must be a number (not NaN) or None, got nan"),
        ({"timeout_s": "5"}, "timeout_s must be a number (not NaN) or None, got '5' (str)"),
        ({"gpu_cache_static": "0.5"}, "gpu_cache_static must be a number (not NaN), got '0.5'"),
        ({"tier": 3}, "tier must be a string, got 3 (int)"),
        ({"willneed": "yes"}, "willneed must be True or False, got 'yes' (str)"),
        ({"row_start": 1.5, "row_end": 3}, "row_start must be an integer or None, got 1.5"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field_and_the_type(kwargs, message):
    """Not `'<' not supported between instances of 'str' and 'int'`; NaN refused."""
    for make in (TableOptions, plestore.open_table):
        with pytest.raises(ValueError) as e:
            make("nowhere", **kwargs) if make is plestore.open_table else make(**kwargs)
        assert str(e.value) == message or str(e.value).startswith(message), str(e.value)


def test_engine_settings_of_the_wrong_type_name_their_key():
    from plestore.integrations.settings import PlestoreSettings

    with pytest.raises(ValueError) as e:
        PlestoreSettings.parse({"threads": "8"}, "additional_config.plestore", "vLLM")
    assert str(e.value) == ("additional_config.plestore: threads must be an integer, got '8' (str)")


def test_a_bad_variable_names_itself():
    with pytest.raises(ValueError, match="PLESTORE_QUEUE_DEPTH='deep'"):
        TableOptions.from_env({"PLESTORE_QUEUE_DEPTH": "deep"})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PLESTORE_TIER": "bogus"}, "PLESTORE_TIER='bogus': tier must be one of auto"),
        ({"PLESTORE_THREADS": "0"}, "PLESTORE_THREADS='0': threads must be >= 1"),
        ({"PLESTORE_SHARE": "all"}, "PLESTORE_SHARE='all': share must be none or node"),
        ({"PLESTORE_ROW_END": "-1"}, "PLESTORE_ROW_END='-1': row_end must be >= 0"),
    ],
)
def test_a_variable_valid_in_type_but_not_in_value_names_itself(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TableOptions.from_env(env)


def test_the_cli_names_a_bad_variable_in_one_line(tmp_path):
    import subprocess
    import sys

    env = {**__import__("os").environ, "PLESTORE_TIER": "bogus"}
    r = subprocess.run(
        [sys.executable, "-m", "plestore", "rows", str(tmp_path), "--ids", "1"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "PLESTORE_TIER='bogus'" in r.stderr, r.stderr


def test_the_environment_is_read_once_per_process(monkeypatch):
    """A process's defaults read PLESTORE_* at their first use, never again: a variable
    changed later moves nothing (each table used to re-read every one)."""
    monkeypatch.setenv("PLESTORE_THREADS", "5")
    fresh = Defaults()
    assert fresh.get("threads") == 5 and fresh.get("tier") == "auto"
    monkeypatch.setenv("PLESTORE_THREADS", "9")
    monkeypatch.setenv("PLESTORE_TIER", "floppy")  # (not even read: no error)
    assert fresh.get("threads") == 5 and fresh.get("tier") == "auto"


def test_defaults_set_for_the_process_or_a_block_and_explicit_arguments_win(monkeypatch):
    monkeypatch.setenv("PLESTORE_THREADS", "5")
    monkeypatch.setenv("PLESTORE_TIER", "direct")
    d = Defaults()
    with d.set(threads=8, gather="cpu") as same:
        assert same is d and (d.get("threads"), d.get("gather")) == (8, "cpu")
        with d.set(threads=3):
            assert d.get("threads") == 3
        assert d.get("threads") == 8
    assert (d.get("threads"), d.get("gather")) == (5, "auto")  # as before the block
    d.set(queue_depth=16)  # a plain setter: stays
    assert d.get("queue_depth") == 16
    with d.reset("tier", "threads"):  # a default an exported variable changed, set back
        assert (d.get("tier"), d.get("threads")) == ("auto", Tuning().threads)
    assert (d.get("tier"), d.get("threads")) == ("direct", 5)
    d.reset()  # every one
    assert d.get("queue_depth") == Tuning().queue_depth and d.get("tier") == "auto"


def test_the_process_defaults_reach_every_table_under_explicit_arguments():
    with plestore.defaults.set(threads=6, tier="mapped"):
        opts = TableOptions.from_env()
        assert (opts.threads, opts.tier) == (6, "mapped")
        assert TableOptions.from_env(threads=2, tier="direct").threads == 2
        assert TableOptions.from_env({}).threads == Tuning().threads  # a given env: its own
        assert TableOptions().threads == Tuning().threads  # the value type: built-ins
    assert TableOptions.from_env().threads == plestore.defaults.get("threads")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"threads": 0}, ValueError, "threads must be >= 1"),
        ({"colour": "red"}, TypeError, "unknown table options: colour"),
    ],
)
def test_a_bad_default_is_refused_and_changes_nothing(kwargs, error, message):
    before = plestore.defaults.as_dict()
    with pytest.raises(error, match=message):
        plestore.defaults.set(**kwargs)
    assert plestore.defaults.as_dict() == before
    with pytest.raises(KeyError, match="unknown table option 'colour'"):
        plestore.defaults.get("colour")


def test_every_variable_is_in_the_documented_table():
    """docs/architecture.md's table names every PLESTORE_<NAME> an option reads, and only those
    and the ones other modules read."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    table = text[text.index("### Environment variables") :].split("\n\n")[1]
    documented = set(re.findall(r"`(PLESTORE_\w+)`", table))
    options = {f"PLESTORE_{n.upper()}" for n in TableOptions.names()}
    assert options <= documented, options - documented
    src = Path(__file__).parents[1] / "src" / "plestore"
    named = {v for f in src.rglob("*.py") for v in re.findall(r"PLESTORE_[A-Z_]+", f.read_text())}
    read_elsewhere = {v for v in named if not v.endswith("_")} - options  # (prefixes end in _)
    assert documented - options == read_elsewhere
