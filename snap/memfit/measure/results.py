"""The one schema every benchmark writes (see shared DESIGN.md, 'Measuring speed').

``write_results("blr_layers", rows, targets)`` writes ``benchmarks/results/blr_layers.json``
with the GPU, library versions, commit and date filled in, atomically (temp file + rename).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def target(name: str, measured: float, goal: float, unit: str, better: str) -> dict:
    """One target row; ``met`` is computed, never typed."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
    met = measured <= goal if better == "lower" else measured >= goal
    return {"name": name, "measured": measured, "target": goal, "unit": unit, "better": better, "met": bool(met)}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("MEMFIT_COMMIT", "unknown")


def environment() -> dict:
    """GPU name and library versions of this run."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()})"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "commit": os.environ.get("MEMFIT_COMMIT") or _commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def write_results(name: str, rows: list[dict], targets: list[dict], out_dir: Path | str | None = None, **extra) -> Path:
    """Write ``<out_dir>/<name>.json`` in the shared schema and return its path.

    Without ``out_dir``, GPU results go to ``benchmarks/results``; a CPU smoke run (a name ending
    in ``_smoke``) goes to a temp dir, so a check of the code path never lands among measurements.
    """
    smoke_dir = Path(tempfile.gettempdir()) / "memfit-smoke"
    directory = Path(out_dir) if out_dir else (smoke_dir if name.endswith("_smoke") else RESULTS_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **environment(), "rows": rows, "targets": targets, **extra}
    path = directory / f"{name}.json"
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as handle:
        json.dump(payload, handle, indent=1, default=float)
        tmp = handle.name
    os.replace(tmp, path)
    return path
