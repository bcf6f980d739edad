"""Benchmark output: the machine it ran on, CSV rows appended to benchmarks/, and plots."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

import plestore

__all__ = ["append_csv", "machine", "plot_e2e", "plot_lookup", "source_commit"]


def machine() -> dict:
    """Where and when: CPU, cores, GPU, versions, git commit, UTC time."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = os.environ.get("PLESTORE_COMMIT", "") or source_commit()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "plestore": plestore.__version__,
        "commit": commit,
    }


def source_commit() -> str:
    """The git commit of the plestore source that is running (its package directory's, not the
    current directory's), or "unknown" where that directory is not tracked by git (an install).
    Copies without .git (device runs) set PLESTORE_COMMIT instead."""
    package = Path(plestore.__file__).resolve().parent
    git = ["git", "-C", str(package)]
    try:
        tracked = [*git, "ls-files", "--error-unmatch", "__init__.py"]
        if subprocess.run(tracked, capture_output=True, timeout=5).returncode != 0:
            return "unknown"  # e.g. site-packages inside some other checkout
        head = [*git, "rev-parse", "--short", "HEAD"]
        out = subprocess.run(head, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out or "unknown"


def append_csv(path: str | os.PathLike, rows: list[dict], meta: dict) -> None:
    """Append rows (with the machine columns) to a CSV. Benches share the file with different
    columns: the header is the union of every row's, rewritten (with the rows so far) when new
    columns arrive, so each row stays readable by name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [{**meta, **r} for r in rows]
    if not records:
        return
    fields = list(dict.fromkeys(k for r in records for k in r))
    header: list[str] = []
    if path.exists():
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
    if header and set(fields) <= set(header):
        with path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=header).writerows(records)
        return
    old = []
    if header:
        with path.open(newline="") as f:
            old = list(csv.DictReader(f))
    union = header + [k for k in fields if k not in header]
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=union)
        w.writeheader()
        w.writerows(old + records)
    tmp.replace(path)


def plot_lookup(rows: list[dict], path: str | os.PathLike, title: str) -> bool:
    """Latency per method and workload (uniform ids), warm and cold bars, floors as lines.
    Returns False (and draws nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if r["dist"] == "uniform"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4.8), sharey=False)
    axes = [axes] if len(workloads) == 1 else list(axes)
    width = 0.4
    for ax, w in zip(axes, workloads, strict=True):
        sel = {r["method"]: r for r in rows if r["workload"] == w}
        xs = range(len(methods))
        warm = [sel.get(m, {}).get("warm_ms") or 0 for m in methods]
        cold = [sel.get(m, {}).get("cold_ms") or 0 for m in methods]
        ax.bar([x - width / 2 for x in xs], warm, width, label="warm")
        ax.bar([x + width / 2 for x in xs], cold, width, label="cold")
        any_row = next(iter(sel.values()))
        if any_row.get("pcie_floor_ms"):
            ax.axhline(any_row["pcie_floor_ms"], color="g", ls="--", label="PCIe floor")
        if any_row.get("disk_floor_ms"):
            ax.axhline(any_row["disk_floor_ms"], color="r", ls=":", label="disk floor (QD64)")
        ax.set_yscale("log")
        ax.set_title(w)
        ax.set_xticks(list(xs), methods, rotation=70, ha="right", fontsize=7)
        ax.set_ylabel("ms per lookup")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


_PHASES = ("decode", "prefill")


def plot_e2e(rows: list[dict], path: str | os.PathLike, title: str) -> bool:
    """Step-time ratio to resident per tier (and GPU-cache variant), decode and prefill per
    batch: warm and cold bars, each cold bar's disk bound as a tick. Returns False (and draws
    nothing) when matplotlib is not installed or no tier is beside the resident one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    tiers = list(dict.fromkeys(r["tier"] for r in rows if r["tier"] != "device"))
    if not tiers:
        return False
    top = max([1.1] + [(r.get(f"{p}_ratio") or 0) * 1.05 for r in rows for p in _PHASES])
    fig, axes = plt.subplots(
        2, len(batches), figsize=(1.0 + 0.55 * len(tiers) * len(batches), 6.4), squeeze=False
    )
    width = 0.4
    for col, b in enumerate(batches):
        sel = {(r["tier"], r["cache"]): r for r in rows if r["batch"] == b}
        xs = range(len(tiers))
        for ax, phase in zip(axes[:, col], _PHASES, strict=True):
            for k, cache in enumerate(("warm", "cold")):
                got = [sel.get((t, cache)) for t in tiers]
                at = [x + (k - 0.5) * width for x in xs]
                ax.bar(at, [(g or {}).get(f"{phase}_ratio") or 0 for g in got], width, label=cache)
                bound = [
                    (a, (g or {}).get(f"bound_{phase}_ratio")) for a, g in zip(at, got, strict=True)
                ]
                bound = [(a, v) for a, v in bound if v is not None]
                if bound:
                    ax.scatter([a for a, _ in bound], [v for _, v in bound], marker="_", s=160,
                               color="k", label="disk's bound")  # fmt: skip
            ax.axhline(1.0, color="g", ls="--", lw=0.8)
            ax.set_ylim(0, top)
            ax.set_title(f"batch {b}: {phase}", fontsize=9)
            ax.set_xticks(list(xs), [_gib(t) for t in tiers], rotation=60, ha="right", fontsize=6)
    axes[0, 0].set_ylabel("ratio to resident (1 = as fast)")
    axes[1, 0].set_ylabel("ratio to resident (1 = as fast)")
    axes[0, 0].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _gib(label: str) -> str:
    """`direct:gpu_cache_bytes=1073741824` -> `direct:gpu cache 1 GiB`."""
    return re.sub(r"gpu_cache_bytes=(\d+)", lambda m: f"gpu cache {int(m[1]) / 2**30:g} GiB", label)
