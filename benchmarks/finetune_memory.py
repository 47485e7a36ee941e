"""Peak memory of a LoRA fine-tuning step, technique by technique (the paper's Llama-3.2-3B table).

Rebuilds the table of "Techniques for Peak Memory Reduction for LoRA Fine-tuning of LLMs
on Edge Devices" on a random-init Llama-3.2-3B-shaped model, batch 1, LoRA r=16 on all
seven linears of every layer, AdamW, at contexts 1024..16384, in fp32 (as the paper;
matmuls may use TF32, which changes no byte) and bf16. Attention is SDPA in bf16 and
memfit's kernel in fp32 (torch SDPA runs fp32 grouped-query attention on its math kernel,
N^2 scores per head); each row records which. Rows, cumulative:

  LoRA                         transformers + peft, logits materialised (the baseline)
  + 4-bit base                 NF4 frozen base (bitsandbytes)
  + checkpointing (offloaded)  per-layer checkpoints, every input in pinned host memory
  + fused linear CE (exact)    loss from hidden states, no logits
  + vocab subset (APPROXIMATE) softmax over labels + 8192 random tokens (the paper's row 4)
  + logits masking (30% loss)  exact fused CE with 70% of tokens ignored (dropped before the matmul)
  + 8-bit AdamW                the same with bitsandbytes' 8-bit AdamW states (memfit, beyond the paper)
  + fused SwiGLU               the same with memfit's fused SwiGLU, gradients over its inputs (memfit, beyond it)

Measured: ``torch.cuda.max_memory_allocated`` over one full step (forward, backward,
optimizer step) after a warm-up step (optimizer state exists), and the step time (with
``--repeats N``, the median of N steps, each one's time kept: single steps are noisy at short
contexts, the bf16 8-bit row took 365 / 418 / 375 ms at 1K / 2K / 4K at 97ff95e, 2K the slowest). Each
row also gives the peak *above the frozen base weights*, the quantity the paper's lower
rows must report (its 0.70 GB at 1024 is below the 4-bit weights of a 3B model alone).
``--smoke`` runs the same code on CPU with the tiny preset (no 4-bit there).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch

from memfit.ledger.verify import make_optimizer
from memfit.measure.results import check_out_dir, target, write_results
from memfit.models import PRESETS, build_model
from memfit.train.checkpoint import CheckpointPolicy
from memfit.train.patch import patch, patch_state

PAPER_GB = {"LoRA": (19.10, 26.20, 40.41, 68.83, None), "+ 4-bit base": (8.80, 14.68, 27.48, 53.07, None),
            "+ checkpointing (offloaded)": (2.37, 3.33, 6.29, 12.21, 24.05),
            "+ vocab subset (approximate)": (1.30, 2.43, 5.41, 11.58, 23.79),
            "+ logits masking (30% loss tokens)": (0.70, 1.02, 1.59, 3.24, 6.95)}
CONTEXTS = (1024, 2048, 4096, 8192, 16384)
LORA = {"r": 16, "lora_alpha": 32}
SUBSET = 8192
EIGHT_BIT_ROW = "+ 8-bit AdamW (memfit, beyond the paper)"
SWIGLU_ROW = "+ fused SwiGLU (memfit, beyond the paper)"
LOWEST_ROWS = ("+ logits masking (30% loss tokens)", EIGHT_BIT_ROW, SWIGLU_ROW)   # the paper's last row, memfit's
FOUR_BIT_ROWS = ("+ 4-bit base", "+ checkpointing (offloaded)", "+ fused linear CE (exact)",
                 "+ vocab subset (approximate)", *LOWEST_ROWS)                # the rows on the 4-bit model, in order
GB = 1e9


def rows_settings(num_layers: int, vocab: int, device):
    """(row name, fused CE, policy, vocab subset, loss fraction, optimizer, fused SwiGLU) for the rows on the 4-bit
    model.

    The last two rows go beyond the paper's table: its configuration with 8-bit AdamW states
    (bitsandbytes; at short contexts the fp32 adapters' AdamW states are a large part of what is
    left above the frozen weights), then with memfit's fused SwiGLU too, which keeps one
    intermediate-sized tensor a layer less and writes the MLP's gradients over its inputs."""
    none = CheckpointPolicy.build(num_layers, "none")
    offloaded = CheckpointPolicy.build(num_layers, "layer", "all")
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(0), device="cpu")
    subset = order[:min(SUBSET, vocab // 2)].to(device)
    settings = [(False, none, None, 1.0, "adamw", False), (False, offloaded, None, 1.0, "adamw", False),
                (True, offloaded, None, 1.0, "adamw", False), (True, offloaded, subset, 1.0, "adamw", False),
                (True, offloaded, None, 0.3, "adamw", False), (True, offloaded, None, 0.3, "adamw8bit", False),
                (True, offloaded, None, 0.3, "adamw8bit", True)]
    return [(name, *setting) for name, setting in zip(FOUR_BIT_ROWS, settings, strict=True)]


def step_flops(spec, context: int, checkpointed: bool, head_tokens: float) -> float:
    """Matmul FLOPs of one LoRA step: forward 2PT, input gradients 2PT (frozen base: no weight
    gradients), one more forward per checkpointed layer, causal attention 2T^2 d per pass,
    and the output head over the loss tokens only (forward + input gradient)."""
    layer_params = spec.num_layers * sum(a * b for a, b in spec.linear_shapes().values())
    passes = 3 if checkpointed else 2
    attention = spec.num_layers * 2 * context**2 * spec.q_dim * (passes + 1)
    return (2 * passes * layer_params * context + attention
            + 4 * spec.vocab * spec.hidden * head_tokens)


def train_step(model, optimizer, context: int, vocab: int, loss_fraction: float, device) -> None:
    ids = torch.randint(0, vocab, (1, context), device=device)
    labels = ids.clone()
    labels[:, : context - round(loss_fraction * context)] = -100
    model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(model, optimizer, contexts, spec, loss_fraction, device, frozen_bytes, base, ceilings, record,
             repeats: int = 1) -> None:
    """Per context a warm-up step, then ``repeats`` measured steps (the peak over them, the median time; OOM
    recorded), each row handed to ``record`` as soon as it is measured. Every context is warmed, not only the first:
    a step at a new sequence length autotunes its kernels, and in a run whose first row is this one
    (``--lowest-only``) that tuning had landed in the measured step (4.8-13 s steps, peaks 0.03-0.48 GB high at
    2K-16K, H200 run at 88652d2)."""
    oom = False
    for context in contexts:
        row = {**base, "context": context}
        if not oom:
            try:
                train_step(model, optimizer, context, spec.vocab, loss_fraction, device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    train_step(model, optimizer, context, spec.vocab, loss_fraction, device)
                    times.append(1e3 * (time.perf_counter() - start))
                row["step_ms"] = statistics.median(times)
                if repeats > 1:
                    row["step_ms_each"] = times
                if ceilings is not None:
                    head = context * (loss_fraction if base.get("fused_ce") else 1.0)
                    flops = step_flops(spec, context, base.get("checkpointed", False), head)
                    row["floor_ms"] = ceilings.floor_ms(flops, frozen_bytes * (3 if base.get("checkpointed") else 2))
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device)
                    row.update(peak_gb=peak / GB, peak_above_frozen_weights_gb=(peak - frozen_bytes) / GB)
            except torch.OutOfMemoryError:
                oom = True
        if oom:
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            row["peak_gb"] = "OOM"
        record(row)


def resident_bytes(model, device) -> tuple[int, int]:
    """(frozen base bytes on the device, trainable bytes) right after patching."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if device.type != "cuda":
        return 0, trainable
    return torch.cuda.memory_allocated(device) - trainable, trainable


def bnb_unavailable_reason(device) -> str | None:
    if device.type != "cuda":
        return "needs CUDA"
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure means "not available", recorded in the row
        return f"bitsandbytes not available ({err})"
    return None


def run_dtype(spec, dtype, contexts, device, ceilings, record, lowest_only: bool = False,
              rows: str | None = None, repeats: int = 1) -> None:
    """Every row of the table at ``dtype`` (``lowest_only``: the paper's last row and memfit's lowest;
    ``rows``: the 4-bit-model rows whose name contains it, each on a model of its own, so that no row is
    measured after another one on the same model)."""
    attention = "memfit" if dtype == torch.float32 else "sdpa"
    if rows is not None:
        for name in chosen_rows(rows):
            _run_four_bit_rows(spec, dtype, attention, contexts, device, ceilings, record, (name,), repeats)
        return
    if not lowest_only:
        _run_baseline(spec, dtype, attention, contexts, device, ceilings, record, repeats)
    _run_four_bit_rows(spec, dtype, attention, contexts, device, ceilings, record, LOWEST_ROWS if lowest_only else None,
                       repeats)


def chosen_rows(text: str) -> list[str]:
    """The 4-bit-model rows whose name contains ``text`` (``--rows``)."""
    return [name for name in FOUR_BIT_ROWS if text and text in name]


def _run_baseline(spec, dtype, attention, contexts, device, ceilings, record, repeats: int) -> None:
    """Row 1: transformers + peft LoRA on the full-precision model, logits materialised."""
    model = patch(build_model(spec, dtype=dtype, device=device), fused_ce=False, lora=LORA, attention=attention)
    frozen, trainable = resident_bytes(model, device)
    optimizer = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    common = {"dtype": str(dtype), "attention": attention, "frozen_weights_gb": frozen / GB,
              "lora_params_gb": trainable / GB}
    _measure(model, optimizer, contexts, spec, 1.0, device, frozen,
             {"row": "LoRA", "exact": True, "baseline": True, **common}, ceilings, record, repeats)
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_four_bit_rows(spec, dtype, attention, contexts, device, ceilings, record, only: tuple | None,
                       repeats: int) -> None:
    """The cumulative rows on one 4-bit model, switching techniques between rows (``only``: these rows)."""
    why_not = bnb_unavailable_reason(device)
    model = patch(build_model(spec, dtype=dtype, device=device), four_bit=why_not is None, lora=LORA,
                  attention=attention)
    frozen, trainable = resident_bytes(model, device)
    trainable_params = [p for p in model.parameters() if p.requires_grad]
    optimizer, optimizer_name = make_optimizer("adamw", trainable_params), "adamw"
    state = patch_state(model)
    common = {"dtype": str(dtype), "attention": attention, "frozen_weights_gb": frozen / GB,
              "lora_params_gb": trainable / GB,
              "four_bit": why_not is None, **({"four_bit_unavailable": why_not} if why_not else {})}
    for name, fused, policy, subset, fraction, opt, swiglu in rows_settings(spec.num_layers, spec.vocab, device):
        if only is not None and name not in only:
            continue
        if opt != optimizer_name:
            if opt == "adamw8bit" and why_not:
                continue
            del optimizer                                   # the old states go before the new ones exist
            gc.collect()
            optimizer, optimizer_name = make_optimizer(opt, trainable_params), opt
        state.fused_ce, state.policy, state.vocab_subset, state.fused_swiglu = fused, policy, subset, swiglu
        _measure(model, optimizer, contexts, spec, fraction, device, frozen,
                 {"row": name, "exact": subset is None, "fused_ce": fused, "checkpointed": policy.active,
                  "optimizer": opt, "fused_swiglu": swiglu, **common}, ceilings, record, repeats)
    state.runner.close()
    del model, optimizer, state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _targets(rows: list[dict]) -> list[dict]:
    """fp32 as in the paper, per context: its last row (peak above the frozen weights, total peak),
    and memfit's two rows beyond it (8-bit AdamW; then fused SwiGLU too) against that same paper value."""
    last = "+ logits masking (30% loss tokens)"
    targets = []
    for row in rows:
        measured = row.get("peak_above_frozen_weights_gb")
        if row["row"] not in LOWEST_ROWS or row["dtype"] != "torch.float32" or not isinstance(measured, float):
            continue
        paper = PAPER_GB[last][CONTEXTS.index(row["context"])] if row["context"] in CONTEXTS else None
        if paper is None:
            continue
        which = {last: "paper's last row", EIGHT_BIT_ROW: "memfit's 8-bit AdamW row",
                 SWIGLU_ROW: "memfit's lowest row (8-bit AdamW, fused SwiGLU)"}[row["row"]]
        targets.append(target(f"fp32 {which}, peak above frozen weights, ctx {row['context']}", measured, paper,
                              "GB", "lower"))
        if row["row"] == last:
            targets.append(target(f"fp32 total peak, ctx {row['context']}", row["peak_gb"], paper, "GB", "lower"))
    return targets


def parse_contexts(parser, text: str) -> tuple[int, ...]:
    """``--contexts``: comma-separated positive token counts, else a usage error."""
    try:
        contexts = tuple(int(c) for c in text.split(","))
    except ValueError:
        parser.error(f"--contexts takes comma-separated token counts, got {text!r}")
    if min(contexts) < 1:
        parser.error(f"--contexts takes positive token counts, got {text!r}")
    return contexts


def parse_dtypes(parser, text: str) -> list[str]:
    """``--dtypes``: float32 and/or bfloat16, comma-separated, else a usage error."""
    dtypes = text.split(",")
    if any(dtype not in ("float32", "bfloat16") for dtype in dtypes):
        parser.error(f"--dtypes takes float32 and/or bfloat16, comma-separated, got {text!r}")
    return dtypes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU, same code path")
    parser.add_argument("--out", default=None, help="results directory (default: benchmarks/results)")
    parser.add_argument("--contexts", default=None, help="comma-separated contexts (default: 1024..16384)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--lowest-only", action="store_true",
                        help="only the paper's last row and memfit's lowest (a short GPU call); own results file")
    parser.add_argument("--rows", default=None, metavar="TEXT",
                        help="only the 4-bit-model rows whose name contains TEXT (e.g. 'exact'), each on a fresh "
                             "model; own results file")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed steps per context after the warm-up; the row's step_ms is their median (default 1)")
    args = parser.parse_args()
    check_out_dir(parser, args.out)
    if args.repeats < 1:
        parser.error(f"--repeats takes a positive count, got {args.repeats}")
    if args.rows is not None and args.lowest_only:
        parser.error("--rows and --lowest-only both choose rows: give one")
    if args.rows is not None and not chosen_rows(args.rows):
        parser.error(f"--rows {args.rows!r} names none of the 4-bit-model rows: {', '.join(FOUR_BIT_ROWS)}")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    spec = PRESETS["tiny" if args.smoke else "llama-3.2-3b"]
    contexts = parse_contexts(parser, args.contexts) if args.contexts else (33, 48) if args.smoke else CONTEXTS
    parse_dtypes(parser, args.dtypes)
    # fp32 storage and activations as in the paper, matmuls in TF32: no tensor's size changes, but the fused loss then
    # runs its Triton kernels, not the PyTorch path it takes at IEEE precision (linear_ce.takes_pytorch_path), and
    # finetune_ledger.py predicts the table at this precision
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    ceilings = None
    if device.type == "cuda":
        from memfit.measure.timing import measure_ceilings

        ceilings = measure_ceilings()
    out_dir = args.out or (tempfile.mkdtemp(prefix="memfit-smoke-") if args.smoke else None)
    name = "finetune_memory" if args.dtypes == "float32,bfloat16" else "finetune_memory_" + args.dtypes.replace(",", "_")
    name += "_lowest" if args.lowest_only else ""
    name += "_rows_" + "".join(c if c.isalnum() else "_" for c in args.rows) if args.rows is not None else ""
    name += f"_repeats{args.repeats}" if args.repeats > 1 else ""
    rows: list[dict] = []

    def save(complete: bool):
        return write_results(name, rows, _targets(rows) if device.type == "cuda" else [], out_dir=out_dir,
                             model=spec.name, batch=1, lora=LORA, vocab_subset=SUBSET, complete=complete,
                             seconds=time.perf_counter() - started,
                             notes="peak = torch.cuda.max_memory_allocated over the timed fwd+bwd+AdamW steps "
                                   "(--repeats, default 1; step_ms their median) after a warm-up step; "
                                   "'peak_above_frozen_weights_gb' subtracts the resident frozen base (embeddings, "
                                   "norms, 4-bit linears) measured after patching; the vocab-subset row is approximate")

    def record(row: dict) -> None:
        """Keep and print a measured row and rewrite the results at once: a time-out loses nothing measured."""
        paper = PAPER_GB.get(row["row"], (None,) * len(CONTEXTS))
        row["paper_gb"] = paper[CONTEXTS.index(row["context"])] if row["context"] in CONTEXTS else None
        rows.append(row)
        print(row, flush=True)
        save(complete=False)

    for dtype in args.dtypes.split(","):
        run_dtype(spec, getattr(torch, dtype), contexts, device, ceilings, record, args.lowest_only, args.rows,
                  args.repeats)
    if not rows:
        raise SystemExit("no row was measured (the 8-bit AdamW row needs bitsandbytes on CUDA)")
    path = save(complete=True)
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
