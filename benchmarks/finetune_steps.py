"""The fine-tuning table's 8-bit AdamW row, step by step: each step's own time and peak, steps alternating with the
fused SwiGLU off and on, a profile of one step of each, and what is live at each step's peak.

Why: ``finetune_memory.py`` gives a row the peak over its timed steps and their median time, each row on a model of
its own. Two of its findings need the steps apart (``results/finetune_memory_rows_beyond_the_paper_repeats5.json``):

* the fused SwiGLU row's steps took 1.20-1.27x the 8-bit row's at 1K-2K tokens in fp32, 1.08-1.38x at 1K-4K in bf16
  and 0.98-1.01x from 8K, two rows on two models at two moments. ``--ab`` alternates the two settings step by step
  on one model (after a warm-up step of each), and ``--profile`` profiles two more steps of each: one for GPU time
  by kernel and the GPU's idle gaps inside the step, one for the host's time by operator and CUDA runtime call (a
  device synchronisation shows there);
* the fp32 8-bit row peaked higher over five steps than over one (4.70 against 4.59 GB at 4K). Every step here gets
  its own peak (the counters reset before it), and ``--history`` records the allocator's history over each timed
  step and keeps the allocation sites live at that step's peak (steps so recorded are slower: their times are
  flagged). ``--resident`` records the history from before the model is built to the end of the first context's
  warm-up steps and keeps what is live then by allocation site (weights, optimizer states, workspaces: what a step
  starts from, which the per-step history does not see).

The model and row are ``finetune_memory.py``'s: Llama-3.2-3B shape, NF4 base, LoRA r=16 on the seven linears,
offloaded per-layer checkpoints, fused linear CE with 70% of tokens ignored, bitsandbytes' 8-bit AdamW; attention
memfit's in fp32, SDPA in bf16.

    python benchmarks/finetune_steps.py --contexts 1024,2048,4096 --ab --steps 6 --profile
    python benchmarks/finetune_steps.py --dtypes float32 --contexts 4096,16384 --steps 5 --history

``--smoke`` runs the same code on CPU with the tiny preset (no 4-bit, AdamW; no peaks, no history).
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import tempfile
import time

import torch
from finetune_memory import (
    EIGHT_BIT_ROW,
    GB,
    LORA,
    bnb_unavailable_reason,
    parse_contexts,
    parse_dtypes,
    resident_bytes,
    rows_settings,
    train_step,
)

from memfit.ledger.verify import make_optimizer
from memfit.measure.allocator_history import MIB, group_sites, live_at_end, sites_at_peak
from memfit.measure.kernel_profile import host_profile, kernel_profile
from memfit.measure.results import check_out_dir, parse_smoke_defaults, write_results
from memfit.models import PRESETS, build_model
from memfit.train.patch import patch, patch_state

HISTORY_ENTRIES = 500_000   # allocator events kept per recorded step (a 16K-token fp32 step makes far fewer)


def build_row(spec, dtype, device):
    """The 8-bit row's model, optimizer and patch state; its loss fraction; the resident frozen bytes. (On the CPU, a
    smoke run, without the 4-bit base and with plain AdamW: bitsandbytes needs CUDA; main refuses a GPU without it.)"""
    why_not = bnb_unavailable_reason(device)
    attention = "memfit" if dtype == torch.float32 else "sdpa"
    model = patch(build_model(spec, dtype=dtype, device=device), four_bit=why_not is None, lora=LORA,
                  attention=attention)
    frozen, _ = resident_bytes(model, device)
    _, fused_ce, policy, subset, fraction, optimizer_name, _ = next(
        s for s in rows_settings(spec.num_layers, spec.vocab, device) if s[0] == EIGHT_BIT_ROW)
    optimizer = make_optimizer(optimizer_name if why_not is None else "adamw",
                               [p for p in model.parameters() if p.requires_grad])
    state = patch_state(model)
    state.fused_ce, state.policy, state.vocab_subset = fused_ce, policy, subset
    return model, optimizer, state, fraction, frozen, attention


def run_context(model, optimizer, state, spec, context, fraction, frozen, device, args, base, record,
                resident: bool = False) -> None:
    """Warm-up steps, the timed steps (alternating under ``--ab``), then the profiles; each result recorded.
    ``resident``: the allocator's history is being recorded; after the warm-up, keep what is live and stop it."""
    settings = (False, True) if args.ab else (False,)

    def step(fused: bool) -> None:
        state.fused_swiglu = fused
        train_step(model, optimizer, context, spec.vocab, fraction, device)

    for fused in settings:
        step(fused)
    if resident:                                   # recording since before the model's build
        snapshot = torch.cuda.memory._snapshot()
        blocks = live_at_end(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
        record({**base, "context": context, "resident": True, "allocated_gb": torch.cuda.memory_allocated(device) / GB,
                "recorded_live_mib": sum(b["size"] for b in blocks) / MIB, "sites": group_sites(blocks, top=40),
                "history_entries": len(snapshot["device_traces"][0]), "history_limit": HISTORY_ENTRIES})
    for index in range(args.steps):
        fused = settings[index % len(settings)]
        row = {**base, "context": context, "step": index, "fused_swiglu": fused, "history": args.history}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            if args.history:
                torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
        start = time.perf_counter()
        step(fused)
        row["step_ms"] = 1e3 * (time.perf_counter() - start)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            row.update(peak_gb=peak / GB, peak_above_frozen_weights_gb=(peak - frozen) / GB)
            if args.history:
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                recorded_peak, row["sites_at_peak"] = sites_at_peak(snapshot)
                row["recorded_peak_gb"] = recorded_peak / GB
        record(row)
    if args.profile:
        for fused in settings:
            kernels, _, idle = kernel_profile(functools.partial(step, fused), device.type, name_chars=100)
            record({**base, "context": context, "profile": True, "fused_swiglu": fused,
                    "kernels": dict(list(kernels.items())[:15]), "gpu_idle": idle,
                    "host": host_profile(functools.partial(step, fused))})


def summary(rows: list[dict]) -> list[dict]:
    """Per dtype, context and setting: the median and spread of the timed steps, the highest and lowest step peak."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if "step_ms" in row:
            groups.setdefault((row["dtype"], row["context"], row["fused_swiglu"]), []).append(row)
    out = []
    for (dtype, context, fused), steps in groups.items():
        times = [r["step_ms"] for r in steps]
        entry = {"dtype": dtype, "context": context, "fused_swiglu": fused, "steps": len(steps),
                 "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
        peaks = [r["peak_gb"] for r in steps if "peak_gb" in r]
        if peaks:
            entry.update(max_peak_gb=max(peaks), min_peak_gb=min(peaks))
        out.append(entry)
    return out


SMOKE_SETTINGS = {"contexts": "64,128", "dtypes": "float32", "steps": 2}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny preset on CPU, same code path; options not given take {SMOKE_SETTINGS}")
    parser.add_argument("--out", default=None, help="results directory (default: benchmarks/results)")
    parser.add_argument("--contexts", default="1024,2048,4096", help="comma-separated contexts (default 1024,2048,4096)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per context (default 6)")
    parser.add_argument("--ab", action="store_true", help="alternate the fused SwiGLU off and on, step by step")
    parser.add_argument("--profile", action="store_true",
                        help="per context and setting, profile a step's kernels and another's host time")
    parser.add_argument("--resident", action="store_true",
                        help="record the allocator's history from the model's build through the first warm-up "
                             "(CUDA): what is live before the timed steps, by site")
    parser.add_argument("--history", action="store_true",
                        help="record the allocator's history over each timed step (CUDA): the sites live at its peak")
    args = parse_smoke_defaults(parser, argv, SMOKE_SETTINGS)
    check_out_dir(parser, args.out)
    if args.steps < 1:
        parser.error(f"--steps takes a positive count, got {args.steps}")
    contexts = parse_contexts(parser, args.contexts)
    dtypes = parse_dtypes(parser, args.dtypes)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.history and args.resident:
        parser.error("--history and --resident record the allocator's history over different spans: give one")
    if (args.history or args.resident) and device.type != "cuda":
        parser.error("--history and --resident read the CUDA allocator's history: run it on a GPU machine")
    if device.type == "cuda" and (why_not := bnb_unavailable_reason(device)):
        parser.error(f"the 8-bit row needs bitsandbytes (4-bit base, 8-bit AdamW): {why_not}")
    spec = PRESETS["tiny" if args.smoke else "llama-3.2-3b"]
    torch.backends.cuda.matmul.allow_tf32 = True   # as finetune_memory.py (which says what it changes)
    name = "finetune_steps" + ("_ab" if args.ab else "") + ("_history" if args.history else "") + \
        ("_resident" if args.resident else "") + ("_smoke" if args.smoke else "")
    out_dir = args.out or (tempfile.mkdtemp(prefix="memfit-smoke-") if args.smoke else None)
    started = time.perf_counter()
    rows: list[dict] = []

    def save(complete: bool):
        return write_results(name, rows, [], out_dir=out_dir, model=spec.name, row=EIGHT_BIT_ROW,
                             summary=summary(rows), complete=complete, seconds=time.perf_counter() - started,
                             notes="each timed step's own peak (counters reset before it) and wall time; "
                                   "--ab alternates fused_swiglu off/on after a warm-up step of each; profile rows: "
                                   "one profiled step per setting (kernel_profile, host operators); steps with "
                                   "history=True ran under allocator recording (their times are not comparable)")

    def record(row: dict) -> None:
        rows.append(row)
        long = ("kernels", "gpu_idle", "host", "sites_at_peak", "sites")
        print({k: v for k, v in row.items() if k not in long}, flush=True)
        save(complete=False)

    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        if args.resident:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
        try:
            model, optimizer, state, fraction, frozen, attention = build_row(spec, dtype, device)
            base = {"dtype": str(dtype), "attention": attention, "optimizer": type(optimizer).__name__,
                    "frozen_weights_gb": frozen / GB}
            for context in contexts:
                run_context(model, optimizer, state, spec, context, fraction, frozen, device, args, base, record,
                            resident=args.resident and context == contexts[0])
        finally:
            if args.resident or args.history:               # a step that raised leaves no recording on
                torch.cuda.memory._record_memory_history(enabled=None)
        state.runner.close()
        del model, optimizer, state
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    path = save(complete=True)
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
