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

from memfit.files import atomic_path
from memfit.local import output_dir_problem

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


def results_path(name: str, out_dir: Path | str | None = None) -> Path:
    """Where :func:`write_results` writes ``name``: ``out_dir``, else benchmarks/results for GPU
    results and a temp dir for a CPU smoke run (a name ending in ``_smoke``)."""
    smoke_dir = Path(tempfile.gettempdir()) / "memfit-smoke"
    directory = Path(out_dir) if out_dir else (smoke_dir if name.endswith("_smoke") else RESULTS_DIR)
    return directory / f"{name}.json"


def out_dir_problem(out_dir: Path | str | None, option: str = "--out") -> str | None:
    """Why ``out_dir`` cannot take results files, or None (None: the default directory). A benchmark asks before
    its first case, so a mistyped --out fails in a second instead of after the first case's minutes of GPU time.
    ``option`` is the command-line option the message names. An empty string is refused (it had meant the default
    directory, where the committed results are; an option parsed with ``type=Path`` makes it '.', the working
    directory, before this sees it), and so is a symbolic link to nothing on the way (the results' mkdir fails on
    it) and whatever else :func:`memfit.local.output_dir_problem` finds."""
    if out_dir is None:
        return None
    if not str(out_dir).strip():
        return f"{option} {str(out_dir)!r} names no directory; leave {option} out for the default"
    if problem := output_dir_problem(out_dir):
        return f"{option} {out_dir}: {problem}"
    return None


def parse_smoke_defaults(parser, argv, smoke_settings: dict):
    """``parser.parse_args(argv)``, where ``--smoke`` is given with ``smoke_settings`` as the defaults of the options
    the command line leaves out: a CPU smoke run small by default, and an option given keeps its value (blr_accuracy's
    smoke run had overwritten them; finetune_steps' had kept the GPU's defaults, 294 s on a 2-core CPU)."""
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke_settings)
        args = parser.parse_args(argv)
    return args


def check_out_dir(parser, out_dir: Path | str | None, option: str = "--out") -> None:
    """``parser.error(...)`` (usage message, exit 2) where ``out_dir`` cannot take results files: what every
    benchmark with a results directory option calls right after parsing its arguments (see out_dir_problem)."""
    if problem := out_dir_problem(out_dir, option):
        parser.error(problem)


def partial_results(path: Path, **settings) -> dict:
    """The results file at ``path`` of a run stopped before its end, to resume: refused when the file is
    missing, unreadable or complete, was written from uncommitted code, at another commit, on another GPU
    or other library versions, or with other ``settings`` (e.g. the cases asked for): its rows would not
    compare with the new ones. Where MEMFIT_COMMIT is set (a copy on a GPU machine has no git checkout) the commit
    is its, which the caller vouches for; with neither, the commit is unknown and nothing resumes."""
    from memfit.errors import MemfitError

    if not path.exists():
        raise MemfitError(f"nothing to resume: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise MemfitError(f"cannot resume {path}: {err}") from err
    if data.get("complete", True):
        raise MemfitError(f"nothing to resume: {path} is a complete run")
    here = environment()
    if "unknown" in (here["commit"], data.get("commit")):      # both "unknown": any code at all had matched
        raise MemfitError(f"cannot resume {path}: the commit of {'this run' if here['commit'] == 'unknown' else 'it'} "
                          "is unknown (no git checkout and no MEMFIT_COMMIT), so its code cannot be matched")
    if here["commit"].endswith("-dirty") or str(data.get("commit")).endswith("-dirty"):
        raise MemfitError(f"cannot resume {path}: uncommitted code on one side cannot be matched; commit first")
    expected = {key: here[key] for key in ("commit", "gpu", "torch", "triton")} | settings
    for key, value in expected.items():
        if data.get(key) != value:
            raise MemfitError(f"cannot resume {path}: it was written with {key} {data.get(key)!r}, this run has "
                              f"{value!r}")
    return data


def write_results(name: str, rows: list[dict], targets: list[dict], out_dir: Path | str | None = None, **extra) -> Path:
    """Write ``<out_dir>/<name>.json`` in the shared schema and return its path.

    Without ``out_dir``, GPU results go to ``benchmarks/results``; a CPU smoke run (a name ending
    in ``_smoke``) goes to a temp dir, so a check of the code path never lands among measurements.
    """
    path = results_path(name, out_dir)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **environment(), "rows": rows, "targets": targets, **extra}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=1, default=float))
    return path


def recorded_error(record: dict) -> float | None:
    """A measured job's relative error from its verify record (``memfit.ledger.verify.VerifyResult.to_dict``, which
    benchmarks store as rows): ``"relative_error"``, or the float ``"error"`` that records written before 19b5e6a
    hold; None for a record without one (a skipped job)."""
    value = record.get("relative_error", record.get("error"))
    return value if isinstance(value, float) else None
