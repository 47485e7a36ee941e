"""How close is the ledger to the GPU? Predicted vs measured peak for 20+ real jobs.

Each job is built as a random-init model of a preset's shape on the GPU, run for a
warm-up step, then measured over one step (``torch.cuda.max_memory_allocated``), and
held against ``memfit.ledger.predict``. Writes ``benchmarks/results/ledger_accuracy.json``.

    python benchmarks/ledger_accuracy.py            # on a CUDA machine, ~3-4 minutes on an H200
    python benchmarks/ledger_accuracy.py --smoke    # tiny preset on CPU, checks the code path
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from memfit.errors import MemfitError
from memfit.ledger.job import Job, Knobs
from memfit.ledger.verify import verify
from memfit.measure.results import target, write_results
from memfit.models import PRESETS

# (preset, task, seq, batch, knobs) -- bf16, as these models ship
JOBS = [
    ("llama-3.2-1b", "infer", 512, 1, {}),
    ("llama-3.2-1b", "infer", 8192, 1, {}),
    ("llama-3.2-1b", "lora", 512, 1, {}),
    ("llama-3.2-1b", "lora", 2048, 1, {}),
    ("llama-3.2-1b", "lora", 8192, 1, {}),
    ("llama-3.2-1b", "lora", 8192, 1, {"checkpoint_layers": 16}),
    ("llama-3.2-1b", "full", 512, 2, {}),
    ("llama-3.2-1b", "full", 2048, 1, {"optimizer": "adamw8bit"}),
    ("llama-3.2-1b", "full", 4096, 1, {"checkpoint_layers": 8}),
    ("llama-3.2-1b", "full", 2048, 4, {"micro_batch": 2}),
    ("llama-3.2-3b", "infer", 2048, 1, {}),
    ("llama-3.2-3b", "infer", 8192, 2, {}),
    ("llama-3.2-3b", "lora", 1024, 1, {}),
    ("llama-3.2-3b", "lora", 2048, 1, {}),
    ("llama-3.2-3b", "lora", 4096, 1, {}),
    ("llama-3.2-3b", "lora", 8192, 1, {"checkpoint_layers": 28}),
    ("llama-3.2-3b", "full", 1024, 1, {}),
    ("llama-3.2-3b", "full", 2048, 1, {"optimizer": "adamw8bit", "checkpoint_layers": 14}),
    ("qwen2.5-1.5b", "infer", 4096, 1, {}),
    ("qwen2.5-1.5b", "lora", 2048, 1, {}),
    ("qwen2.5-1.5b", "lora", 4096, 1, {"checkpoint_layers": 28}),
    ("qwen2.5-1.5b", "full", 1024, 1, {}),
    ("qwen2.5-1.5b", "full", 2048, 1, {"optimizer": "adamw8bit", "checkpoint_layers": 14}),
    ("qwen2.5-1.5b", "full", 8192, 1, {"checkpoint_layers": 28}),
]
SMOKE_JOBS = [("tiny", task, 64, 2, knobs) for task, knobs in
              [("infer", {}), ("lora", {}), ("full", {"checkpoint_layers": 1}), ("full", {"micro_batch": 1})]]


def run(jobs, device: str) -> list[dict]:
    rows = []
    for preset, task, seq, batch, extra in jobs:
        spec = PRESETS[preset]
        job = Job(spec, task=task, seq=seq, batch=batch, device=device, new_tokens=64)
        knobs = Knobs(dtype="bfloat16" if device == "cuda" else "float32", micro_batch=batch).with_(**extra)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        leftover = torch.cuda.memory_allocated() if device == "cuda" else 0
        start = time.perf_counter()
        try:
            result = verify(job, knobs)
        except MemfitError as err:  # e.g. bitsandbytes missing: say so, do not crash the run
            rows.append({"job": job.to_dict(), "knobs": knobs.to_dict(), "skipped": str(err)})
            print(f"skip {preset} {task} {seq}: {err}", flush=True)
            continue
        row = {**result.to_dict(), "leftover_before_bytes": leftover, "seconds": time.perf_counter() - start}
        rows.append(row)
        print(f"{preset:13s} {task:5s} seq {seq:5d} b{batch} {str(extra):40s} predicted {result.ledger.total / 2**30:7.3f} "
              f"measured {result.measured.peak / 2**30:7.3f} GiB  error {100 * result.error:+6.2f}%  "
              f"reserved {result.measured.reserved / 2**30:7.3f} (pred {(result.ledger.total + result.ledger.allocator_overhead) / 2**30:7.3f})"
              f"  peak in {result.ledger.peak_phase}/{result.ledger.peak_where}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny jobs on CPU: check the code path")
    parser.add_argument("--out", default=None, help="directory for the JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run with --smoke on CPU", file=sys.stderr)
        return 2
    rows = run(SMOKE_JOBS if args.smoke else JOBS, device)
    errors = [abs(r["error"]) * 100 for r in rows if "error" in r]
    reserved = [abs((r["peak_bytes"] + r["allocator_overhead"]) / r["measured"]["reserved_bytes"] - 1) * 100
                for r in rows if "error" in r]
    targets = [
        target("median |error| of the total peak", statistics.median(errors), 3.0, "%", "lower"),
        target("max |error| of the total peak", max(errors), 8.0, "%", "lower"),
        target("jobs predicted and measured", len(errors), 20 if not args.smoke else 4, "jobs", "higher"),
    ]
    path = write_results("ledger_accuracy" + ("_smoke" if args.smoke else ""), rows, targets, args.out,
                         reserved_error_median_pct=statistics.median(reserved))
    print(f"median |error| {statistics.median(errors):.2f}%  max {max(errors):.2f}%  over {len(errors)} jobs; "
          f"reserved median |error| {statistics.median(reserved):.2f}% -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
