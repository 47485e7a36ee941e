"""Probe: the GPU memory and time of ``memfit compress`` on a random-init Llama-3.2-1B (bf16), per method, weight-space
and activation-aware: the peak the caching allocator saw (``max_memory_allocated``), against the dense model's bytes.
It imports memfit from the checkout it sits in, so a copy of it in another checkout measures that one's code: before
and after the dense model stayed on the CPU while it compresses (002fe9b), for example,

    OUT=/some/dir python benchmarks/probes/compress_memory.py              # writes OUT/compress_memory_<commit>.json
    git worktree add /tmp/before 4a5031d && cp benchmarks/probes/compress_memory.py /tmp/before/benchmarks/probes/
    OUT=/some/dir python /tmp/before/benchmarks/probes/compress_memory.py

BLAST runs 20 descent steps in case ``blast`` (the memory is the same per step) and the default 300 in ``blast-300``
(what ``memfit compress --method blast`` takes).
Cases may be named to run only those, in that order (``lowrank``, ``lowrank-aware``, ``blast``), and the file is
then named by them too (``compress_memory_<commit>_<cases>.json``), so that runs of single cases in separate processes
keep a file each (d98126e's two processes wrote one name, the second over the first); the file is rewritten after
each case, so a run stopped by a time limit keeps the cases it finished.
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", "/tmp"))
MODEL = "llama-3.2-1b"
# name: (method, activation-aware, BLAST's descent steps) -- a 1B build each
CASES = {"lowrank": ("lowrank", False, None), "lowrank-aware": ("lowrank", True, None), "blast": ("blast", False, 20),
         "blast-300": ("blast", False, 300)}
CALIBRATION = {"calib_builtin": True, "calib_samples": 24, "calib_seq": 512}   # more tokens than down_proj inputs


def main() -> None:
    sys.path.insert(0, str(ROOT))
    import memfit
    from memfit.models import PRESETS, dtype_bytes

    spec = PRESETS[MODEL]
    dense = spec.num_params() * dtype_bytes(spec.dtype)
    from memfit.measure.results import environment

    environment_now = environment()
    commit = environment_now["commit"]
    names = sys.argv[1:] or list(CASES)
    path = OUT / f"compress_memory_{commit}{''.join('_' + name for name in names) if sys.argv[1:] else ''}.json"
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        sys.exit(f"unknown case(s) {unknown}: choose from {list(CASES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    record = {"probe": "compress_memory", "model": MODEL, **environment_now, "calibration": CALIBRATION, "rows": []}
    for method, aware, steps in (CASES[name] for name in names):
        with tempfile.TemporaryDirectory() as tmp:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            memfit.compress(MODEL, Path(tmp) / "out", method=method, device="cuda", progress=False,
                            **({"steps": steps} if steps else {}), **(CALIBRATION if aware else {}),
                            activation_aware=aware)
            torch.cuda.synchronize()
            row = {"method": method, "activation_aware": aware, "steps": steps, "seconds": time.perf_counter() - start,
                   "peak_bytes": torch.cuda.max_memory_allocated(), "dense_model_bytes": dense}
        row["peak_over_model"] = row["peak_bytes"] / dense
        print(json.dumps(row), flush=True)
        record["rows"].append(row)
        path.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
