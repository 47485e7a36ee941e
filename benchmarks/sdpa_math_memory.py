"""What torch SDPA's math kernel holds, forward and backward, in multiples of one score tensor (heads x seq x seq fp32).

Why: torch runs fp32 grouped-query attention on its math kernel, whose scores are heads x seq^2 per sequence. On the
H200 (08bf567) `memfit verify --model llama-3.2-1b --task lora --seq 8192 --dtype float32 --checkpoint-layers 16`
measured 40.92 GB, where the ledger predicted 15.7% less, and the allocator's history at the peak held four 8 GiB
score-sized tensors (`results/logs/ledger_snapshot_llama-3.2-1b_lora_8192_fp32_ckpt16_08bf567.log`). This measures
the kernel alone: for each way a caller asks for causality (HF's float mask, a bool mask, is_causal) and of grouping heads
(enable_gqa, or k/v repeated first as HF's eager path does), the forward's peak, what the forward leaves, and the
backward's peak above that, each divided by one score tensor. (On the CPU memfit's tracker counts only what a
region allocates, so the backward's figure is the most it allocated at once: an upper bound on its peak above what
the forward left.) A warm-up call first makes the cuBLAS workspaces of both threads, which the meters would catch.

    python benchmarks/sdpa_math_memory.py            # CUDA: the caching allocator's counters
    python benchmarks/sdpa_math_memory.py --smoke    # CPU, small: memfit's CPU allocation tracker
"""
from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from memfit.measure.memory import PeakMeter
from memfit.measure.results import check_out_dir, write_results

MASKS = ("float mask", "bool mask", "is_causal")
GROUPINGS = ("enable_gqa", "repeat_kv")


def measure(device: str, heads: int, kv_heads: int, seq: int, head_dim: int, mask: str, grouping: str) -> dict:
    """One attention call's forward and backward on the math kernel, in score tensors."""
    shape = dict(device=device, requires_grad=True)
    q = torch.randn(1, heads, seq, head_dim, **shape)
    k, v = (torch.randn(1, kv_heads, seq, head_dim, **shape) for _ in range(2))
    keep = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]
    kwargs = {"float mask": {"attn_mask": torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))},
              "bool mask": {"attn_mask": keep}, "is_causal": {"is_causal": True}}[mask]
    if grouping == "enable_gqa":
        kwargs["enable_gqa"] = True
    score = heads * seq * seq * 4
    allocated = torch.cuda.memory_allocated if device == "cuda" else None   # the CPU meter counts from zero
    with sdpa_kernel(SDPBackend.MATH):
        start = allocated() if allocated else 0
        with PeakMeter(device) as forward:
            keys, values = (k, v) if grouping == "enable_gqa" else \
                (k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1))
            out = F.scaled_dot_product_attention(q, keys, values, **kwargs)
        grad = torch.ones_like(out)
        before_backward = allocated() if allocated else 0
        with PeakMeter(device) as backward:
            out.backward(grad)
    row = {"mask": mask, "grouping": grouping, "heads": heads, "kv_heads": kv_heads, "seq": seq,
           "score_mib": score / 2**20, "forward_peak_scores": (forward.peak - start) / score,
           "backward_peak_scores": (backward.peak - before_backward) / score}
    if allocated:
        row["left_after_forward_scores"] = (before_backward - start - grad.numel() * grad.element_size()) / score
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, 4 heads x 512 tokens")
    parser.add_argument("--out", default=None, help="results directory (default: benchmarks/results)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    heads, kv_heads, seq, head_dim = (4, 2, 512, 16) if device == "cpu" else (32, 8, 2048, 64)
    measure(device, heads, kv_heads, seq, head_dim, MASKS[0], GROUPINGS[0])    # warm-up: workspaces, lazy init
    rows = []
    for mask in MASKS:
        for grouping in GROUPINGS:
            rows.append(measure(device, heads, kv_heads, seq, head_dim, mask, grouping))
            print(rows[-1], flush=True)
    out_dir = args.out or (tempfile.mkdtemp(prefix="memfit-smoke-") if device == "cpu" else None)
    path = write_results("sdpa_math_memory" + ("_smoke" if device == "cpu" else ""), rows, [], out_dir=out_dir,
                         notes="peaks above the region's start, in score tensors (heads x seq x seq fp32); "
                               "backward_peak_scores is above what the forward left")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
