"""Benchmark memfit attention against torch SDPA (FLASH, CUDNN, EFFICIENT) and run the fusion study.

    python benchmarks/attention.py            # H200: about 3-5 minutes, writes
                                              #   benchmarks/results/attention.json/.png
                                              #   benchmarks/results/attention_study.json/.png
    python benchmarks/attention.py --smoke    # CPU, Triton interpreter, tiny shapes, same code path

Part 1 (``attention.json``): batch x seq = 16K tokens, 32 heads, head dim 128, bf16, seq
1K/4K/16K, causal and not. Forward and forward+backward TFLOP/s (FLOPs: 4*B*H*N^2*D forward,
2.5x that backward, halved when causal) and the extra memory each implementation holds
for backward and at peak, for memfit (every backward variant) and the SDPA backends.
Target: memfit fwd+bwd >= SDPA FLASH on every shape (measured in this run).

Part 2 (``attention_study.json``): backward of a checkpointed attention given Q, K, V, dO:
the fused recompute+backward kernel with naive fp32 atomics, with block-order remapping,
with partial buffers, and as two launches, against separate passes (forward recompute,
then the two-pass or atomic backward). Each row has time, TFLOP/s, the bytes the variant
must move at least (and the fp32 atomic/partial-buffer traffic it adds), achieved
bandwidth, and the roofline floor from ceilings measured in this run.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from memfit.kernels.attention import VARIANTS, attention, attention_recompute_backward, partial_slots  # noqa: E402
from memfit.measure.results import check_out_dir, target, write_results  # noqa: E402
from memfit.measure.timing import Ceilings, device_ms, measure_ceilings  # noqa: E402

SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def attention_flops(b, h, n, d, causal, backward=True):
    """Matmul FLOPs of fwd (+bwd = 2.5x fwd), causal halved: the convention FlashAttention reports."""
    fwd = 4 * b * h * n * n * d / (2 if causal else 1)
    return fwd * (3.5 if backward else 1.0)


def peak_extra_bytes(fn, cuda: bool) -> tuple[float, float]:
    """(bytes held between forward and backward beyond the output, peak bytes beyond the inputs)."""
    if not cuda:
        return math.nan, math.nan
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    held = fn()
    torch.cuda.synchronize()
    return float(held - before), float(torch.cuda.max_memory_allocated() - before)


def make_inputs(b, h, n, d, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def implementations(causal):
    """name -> f(q, k, v) for every contender; SDPA backends imported lazily."""
    impls = {f"memfit[{var}]": (lambda q, k, v, var=var: attention(q, k, v, causal=causal, backward=var))
             for var in VARIANTS}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return impls
    for name in SDPA_BACKENDS:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def run(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        impls[f"sdpa[{name.split('_')[0].lower()}]"] = run
    return impls


def bench_case(b, h, n, d, causal, device, dtype, cuda):
    q, k, v, do = make_inputs(b, h, n, d, device, dtype)
    rows = []
    for name, fn in implementations(causal).items():
        row = {"impl": name, "batch": b, "heads": h, "seq": n, "head_dim": d, "causal": causal,
               "dtype": str(dtype).replace("torch.", "")}
        try:
            def fwd():
                with torch.no_grad():
                    return fn(q, k, v)

            def fwd_bwd():
                return torch.autograd.grad(fn(q, k, v), (q, k, v), do)

            out_ref = fwd()
            fwd_ms = device_ms(fwd, "cuda" if cuda else "cpu")
            fb_ms = device_ms(fwd_bwd, "cuda" if cuda else "cpu")

            def held():
                out = fn(q, k, v)
                now = torch.cuda.memory_allocated() - out.numel() * out.element_size()
                torch.autograd.grad(out, (q, k, v), do)
                return now

            saved, peak = peak_extra_bytes(held, cuda)
            row.update(fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms, saved_extra_bytes=saved, peak_extra_bytes=peak,
                       fwd_tflops=attention_flops(b, h, n, d, causal, False) / fwd_ms / 1e9,
                       fwd_bwd_tflops=attention_flops(b, h, n, d, causal) / fb_ms / 1e9,
                       out_checksum=float(out_ref.float().abs().mean()))
        except Exception as exc:  # a backend that does not run here is a row, not a crash
            row.update(error=f"not available: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        rows.append(row)
    return rows


def study_bytes(b, h, n, d, causal, variant, elem, slots, tile=128):
    """(least bytes the variant must move to/from memory, extra fp32 accumulation traffic)."""
    io = b * h * n * d * elem
    rows = b * h * n * 4
    base = 4 * io + 3 * io  # read q, k, v, do; write dq, dk, dv
    pairs = (b * h * (n / tile) ** 2) / (2 if causal else 1)
    if variant.startswith("separate"):
        # forward writes O and lse, backward reads them back (and reads q, k, v twice)
        base += 2 * io + 2 * rows + 3 * io + rows * 2
        extra = pairs * tile * d * 4 * 2 if variant.endswith("atomic") else 0.0
    elif variant == "fused[two_pass]":
        base += 2 * rows * 2
        extra = 0.0
    elif variant == "fused[partial_buffers]":
        extra = 2 * pairs * tile * d * 4 * 2 + 2 * slots * b * h * n * d * 4  # RMW of tiles + the final sum
    else:
        extra = 2 * pairs * tile * d * 4 * 2  # fp32 atomics on dK and dV tiles (read+write in L2)
    return base, extra


def study_case(b, h, n, d, causal, device, dtype, cuda, ceilings):
    q, k, v, do = make_inputs(b, h, n, d, device, dtype)
    q, k, v = (t.detach() for t in (q, k, v))
    elem = q.element_size()
    slots = partial_slots(q.device, math.ceil(n / 32), b * h)

    def separate(var):
        def run():
            leaves = [t.requires_grad_() for t in (q.detach(), k.detach(), v.detach())]
            return torch.autograd.grad(attention(*leaves, causal=causal, backward=var), leaves, do)
        return run

    cases = {f"fused[{var}]": (lambda var=var: attention_recompute_backward(q, k, v, do, causal=causal, backward=var))
             for var in VARIANTS}
    cases["separate[two_pass]"] = separate("two_pass")
    cases["separate[atomic]"] = separate("atomic")
    flops = attention_flops(b, h, n, d, causal)
    rows = []
    for name, fn in cases.items():
        row = {"variant": name, "batch": b, "heads": h, "seq": n, "head_dim": d, "causal": causal}
        try:
            ms = device_ms(fn, "cuda" if cuda else "cpu")
            least, extra = study_bytes(b, h, n, d, causal, name, elem, slots)
            floor = ceilings.floor_ms(flops, least)
            row.update(ms=ms, tflops=flops / ms / 1e9, least_bytes=least, accumulation_bytes=extra,
                       achieved_gbps=(least + extra) / ms / 1e6, floor_ms=floor, floor_fraction=floor / ms,
                       partial_slots=slots if "partial" in name else None)
        except Exception as exc:
            row.update(error=f"not available: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        rows.append(row)
    naive = next((r["ms"] for r in rows if r["variant"] == "fused[atomic]" and "ms" in r), None)
    for row in rows:
        if naive and "ms" in row:
            row["speedup_vs_naive_fused"] = naive / row["ms"]
    return rows


def plot(rows, study_rows, out_dir: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, causal in zip(axes, (False, True)):
        sel = [r for r in rows if r["causal"] == causal and "fwd_bwd_tflops" in r]
        seqs = sorted({r["seq"] for r in sel})
        impls = sorted({r["impl"] for r in sel})
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            ys = [next((r["fwd_bwd_tflops"] for r in sel if r["impl"] == impl and r["seq"] == s), 0) for s in seqs]
            ax.bar([x + i * width for x in range(len(seqs))], ys, width, label=impl)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(seqs))], [f"N={s}" for s in seqs])
        ax.set_title(f"fwd+bwd TFLOP/s, {'causal' if causal else 'non-causal'}")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "attention.png", dpi=120)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, causal in zip(axes, (False, True)):
        sel = [r for r in study_rows if r["causal"] == causal and "ms" in r]
        for variant in sorted({r["variant"] for r in sel}):
            pts = sorted((r["seq"], r["tflops"]) for r in sel if r["variant"] == variant)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (16K tokens per batch)")
        ax.set_ylabel("TFLOP/s (recompute + backward)")
        ax.set_title(f"fused vs separate, {'causal' if causal else 'non-causal'}")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "attention_study.png", dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        device, dtype, heads, dim, tokens, seqs = "cpu", torch.float16, 2, 16, 64, (16, 32)
        ceilings = Ceilings(matmul_flops=1e12, bandwidth=1e11)  # placeholder: nothing is timed for real on CPU
    else:
        device, dtype, heads, dim, tokens, seqs = "cuda", torch.bfloat16, 32, 128, 16384, (1024, 4096, 16384)
        ceilings = measure_ceilings()
    from rich.progress import Progress

    rows, study_rows = [], []
    cases = [(s, c) for s in seqs for c in (False, True)]
    with Progress() as progress:
        task = progress.add_task("attention", total=2 * len(cases))
        for seq, causal in cases:
            rows += bench_case(tokens // seq, heads, seq, dim, causal, device, dtype, cuda)
            progress.advance(task)
        for seq, causal in cases:
            study_rows += study_case(tokens // seq, heads, seq, dim, causal, device, dtype, cuda, ceilings)
            progress.advance(task)
    targets = []
    for seq, causal in cases:
        ours = next((r for r in rows if r["impl"] == "memfit[two_pass]" and r["seq"] == seq and r["causal"] == causal),
                    {})
        flash = next((r for r in rows if r["impl"] == "sdpa[flash]" and r["seq"] == seq and r["causal"] == causal),
                     {})
        if "fwd_bwd_tflops" in ours and "fwd_bwd_tflops" in flash:
            targets.append(target(f"fwd+bwd TFLOP/s >= SDPA FLASH, N={seq}{' causal' if causal else ''}",
                                  ours["fwd_bwd_tflops"], flash["fwd_bwd_tflops"], "TFLOP/s", "higher"))
    ceil = {"matmul_tflops": ceilings.matmul_flops / 1e12, "bandwidth_gbps": ceilings.bandwidth / 1e9,
            "smoke": args.smoke}
    out_dir = args.out
    suffix = "_smoke" if args.smoke else ""          # a smoke run goes to a temp dir, never over GPU results
    path = write_results("attention" + suffix, rows, targets, out_dir, ceilings=ceil)
    write_results("attention_study" + suffix, study_rows, [], out_dir, ceilings=ceil)
    plot(rows, study_rows, path.parent)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"attention TFLOP/s ({'smoke, CPU: numbers meaningless' if args.smoke else device})")
    for col in ("impl", "seq", "causal", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "saved extra MiB"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(r["impl"], str(r["seq"]), str(r["causal"]), f"{r.get('fwd_tflops', math.nan):.3g}",
                      f"{r.get('fwd_bwd_tflops', math.nan):.3g}", f"{r.get('saved_extra_bytes', math.nan) / 2**20:.1f}"
                      if "error" not in r else r["error"][:40])
    Console().print(table)
    print(f"wrote {path} and {path.parent / 'attention_study.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
