"""The ledger's prediction of every row of the fine-tuning memory table, against the H200 run.

Reads ``benchmarks/results/finetune_memory.json`` (measured by ``benchmarks/finetune_memory.py``
on the GPU), predicts each configuration with ``memfit.ledger.predict`` (a CPU computation),
and writes ``benchmarks/results/finetune_ledger.json`` with the error per row. The
approximate vocabulary-subset row has no ledger model and is skipped, as are rows that
ran out of memory.

    python benchmarks/finetune_ledger.py
    python benchmarks/finetune_ledger.py --measured benchmarks/results/earlier/finetune_memory_float32_lowest_6bae2ad.json
        # a partial run (finetune_memory.py --lowest-only) -> finetune_ledger_float32_lowest_6bae2ad.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from finetune_memory import EIGHT_BIT_ROW, LOWEST_ROWS, SWIGLU_ROW

from memfit.ledger.job import Job, Knobs
from memfit.ledger.predict import predict
from memfit.measure.results import RESULTS_DIR, check_out_dir, target, write_results
from memfit.models import PRESETS

GB = 1e9
# the table's rows as knobs (benchmarks/finetune_memory.py builds them the same way)
ROWS = {
    "LoRA": {},
    "+ 4-bit base": {"four_bit": True},
    "+ checkpointing (offloaded)": {"four_bit": True, "checkpoint_layers": 28, "offload_layers": 28},
    "+ fused linear CE (exact)": {"four_bit": True, "checkpoint_layers": 28, "offload_layers": 28, "fused_ce": True},
    "+ logits masking (30% loss tokens)": {"four_bit": True, "checkpoint_layers": 28, "offload_layers": 28,
                                           "fused_ce": True},
    EIGHT_BIT_ROW: {"four_bit": True, "checkpoint_layers": 28, "offload_layers": 28, "fused_ce": True,
                    "optimizer": "adamw8bit"},
    SWIGLU_ROW: {"four_bit": True, "checkpoint_layers": 28, "offload_layers": 28, "fused_ce": True,
                 "optimizer": "adamw8bit", "fused_swiglu": True},
}
LOSS_FRACTION = dict.fromkeys(LOWEST_ROWS, 0.3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", default=str(RESULTS_DIR / "finetune_memory.json"),
                        help="a results file of benchmarks/finetune_memory.py (default: the full table)")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)
    # the float32 matmul precision finetune_memory.py measured at (TF32): it picks the fused loss's path for fp32
    # (linear_ce.takes_pytorch_path), and with it the memory the ledger predicts
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        measured = json.loads(Path(args.measured).read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--measured {args.measured}: not a readable finetune_memory results file ({exc})")
    if not str(measured.get("benchmark", "")).startswith("finetune_memory"):
        parser.error(f"--measured {args.measured}: written by {measured.get('benchmark')!r}, not finetune_memory")
    spec = PRESETS[measured.get("model", "llama-3.2-3b")]
    rows, errors = [], []
    for row in measured["rows"]:
        name, dtype = row["row"], row["dtype"].replace("torch.", "")
        if name not in ROWS or not isinstance(row.get("peak_gb"), (int, float)):
            continue
        attention = row.get("attention", "sdpa")
        job = Job(spec, task="lora", seq=row["context"], batch=measured.get("batch", 1),
                  loss_fraction=LOSS_FRACTION.get(name, 1.0))
        knobs = Knobs(dtype=dtype, lora_rank=16, attention=attention).with_(**ROWS[name])
        ledger = predict(job, knobs)
        error = ledger.total / (row["peak_gb"] * GB) - 1
        rows.append({"row": name, "dtype": dtype, "context": row["context"], "attention": attention,
                     "measured_gb": row["peak_gb"], "predicted_gb": ledger.total / GB, "error": error,
                     "peak_phase": ledger.peak_phase, "peak_at": ledger.peak_where})
        errors.append((name, dtype, row["context"], error))
        print(f"{dtype:9s} {name:36s} {row['context']:6d}  measured {row['peak_gb']:7.2f}  "
              f"predicted {ledger.total / GB:7.2f} GB  {100 * error:+6.2f}%")
    last = [e for e in errors if e[0] in LOWEST_ROWS]
    targets = [target(f"{dtype} {name}, ctx {ctx}: |ledger error|", abs(100 * err), 5.0, "%", "lower")
               for name, dtype, ctx, err in last]
    targets.append(target("max |ledger error| over all rows", max(abs(100 * e[3]) for e in errors), 5.0, "%",
                          "lower"))
    # finetune_memory_float32_lowest_6bae2ad.json -> finetune_ledger_float32_lowest_6bae2ad.json
    name = "finetune_ledger" + Path(args.measured).stem.removeprefix("finetune_memory")
    path = write_results(name, rows, targets, out_dir=args.out,
                         measured_in={k: measured[k] for k in ("gpu", "torch", "triton", "commit", "date")})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
