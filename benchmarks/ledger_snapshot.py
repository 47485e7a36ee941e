"""Where is a job's peak, really? The CUDA allocator's history for one job, read at its peak.

A diagnostic for the ledger: runs one job as ``verify`` does with
``torch.cuda.memory._record_memory_history`` on, replays the trace to find the moment of
the largest live total, and prints the live blocks there (size, and the innermost frames
of the code that allocated them) beside the ledger's breakdown.

    python benchmarks/ledger_snapshot.py llama-3.2-3b full 2048 --optimizer adamw8bit --checkpoint-layers 14
    python benchmarks/ledger_snapshot.py llama-3.2-3b lora 8192 --dtype float32 --fused-ce \
        --checkpoint-layers 28 --offload-layers 28 --attention memfit --loss-fraction 0.3
    python benchmarks/ledger_snapshot.py llama-3.2-1b infer 4096 --batch 4 --generator memfit
    python benchmarks/ledger_snapshot.py llama-3.2-1b infer 512 --generator memfit --measured-peak
"""
from __future__ import annotations

import argparse

import torch

from memfit.errors import MemfitError
from memfit.ledger.job import GENERATORS, Job, Knobs
from memfit.ledger.predict import predict
from memfit.ledger.verify import measure
from memfit.measure.allocator_history import first_alloc_in, sites_at_peak
from memfit.models import PRESETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(PRESETS))
    parser.add_argument("task")
    parser.add_argument("seq", type=int)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--checkpoint-layers", type=int, default=0)
    parser.add_argument("--offload-layers", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--fused-ce", action="store_true")
    parser.add_argument("--four-bit", action="store_true")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "memfit"])
    parser.add_argument("--loss-fraction", type=float, default=1.0)
    parser.add_argument("--generator", default="hf", choices=GENERATORS)
    parser.add_argument("--blr", default=None, choices=["blast", "monarch", "lowrank"])
    parser.add_argument("--top", type=int, default=25)
    read = parser.add_mutually_exclusive_group()
    read.add_argument("--measured-step-only", action="store_true",
                      help="record from the measured step on: the sites of what it adds to what the warm-up left "
                           "(a warm-up that times kernel picks, as memfit's loop's first build does, peaks apart)")
    read.add_argument("--measured-peak", action="store_true",
                      help="record from the start, read the peak within the measured step: every block live then, "
                           "with its site, what the model's build and the warm-up left included (the whole trace's "
                           "peak can be in the model's build)")
    args = parser.parse_args()
    try:
        job = Job(PRESETS[args.model], task=args.task, seq=args.seq, batch=args.batch, device="cuda", new_tokens=64,
                  loss_fraction=args.loss_fraction)
        knobs = Knobs(dtype=args.dtype, optimizer=args.optimizer, checkpoint_layers=args.checkpoint_layers,
                      offload_layers=args.offload_layers, fused_ce=args.fused_ce, four_bit=args.four_bit,
                      attention=args.attention, micro_batch=args.batch, blr_method=args.blr,
                      generator=args.generator)        # predict refuses memfit's loop for a training task
        ledger = predict(job, knobs)
    except MemfitError as err:
        parser.error(str(err))
    if not torch.cuda.is_available():
        parser.error("the allocator history is CUDA's: run this on a GPU machine")
    # Python frames only: where() reads nothing else (a 3B fp32 step at 4K-8K tokens still did not finish
    # within 150 s under recording on the H200; where that time goes is not known)
    def start_recording() -> None:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

    def measured_step_begins() -> None:             # an allocation the trace names: where the measured step begins
        torch.empty(1, device="cuda")

    def on_phase(phase: str) -> None:
        if phase == "measured step" and args.measured_step_only:
            start_recording()
        elif phase == "measured step" and args.measured_peak:
            measured_step_begins()

    if not args.measured_step_only:
        start_recording()
    measured = measure(job, knobs, progress=on_phase)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    since = first_alloc_in(snapshot, measured_step_begins.__name__) if args.measured_peak else 0
    peak, sites = sites_at_peak(snapshot, args.top, since)
    print(f"predicted {ledger.total / 2**30:.3f} GiB at {ledger.peak_phase}/{ledger.peak_where}: "
          + ", ".join(f"{k} {v / 2**30:.3f}" for k, v in ledger.peak.items()))
    print(f"measured max_allocated {measured.peak / 2**30:.3f} GiB; trace peak {peak / 2**30:.3f} GiB "
          + ("(what the measured step added)" if args.measured_step_only
             else "(in the measured step, with what was live before it)" if args.measured_peak
             else "(the trace spans warm-up and the measured step)"))
    for site in sites:
        print(f"{site['mib']:10.1f} MiB  {site['count']:4d} x {site['block_mib']:8.2f}  {site['site']}")


if __name__ == "__main__":
    main()
