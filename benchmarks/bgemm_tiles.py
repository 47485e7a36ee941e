"""Tile sweep of bgemm (the BLR kernels' strided batched GEMM with a regrouping store) against cuBLAS.

Monarch's stage 1 (z = x_j @ w1[j] for every input block j, with P^T folded into the
store) runs on ``blr_common.bgemm`` in every Monarch pipeline but the cuBLAS-only ones, and
at N >= 1024 it is the stage furthest from cuBLAS (75317f4 profile: 243.5 us at Llama-1B
down N=8192, where cuBLAS's batched GEMM of the same product takes 170.4 us). For the
paper's shapes and N in {128, 1024, 8192} this times, in one run and each alone:

* every tile config of ``CONFIGS`` (BN x BC x BK, warps, stages) that fits, storing z the way
  ``monarch``'s ``tbmm`` does (token-contiguous, P^T folded in), with the K mask and, where K
  is a multiple of BK, without it (``EVEN_K``);
* ``bgemm`` as the op calls it (its autotuned pick among ``BGEMM_CONFIGS``);
* cuBLAS's strided batched GEMM of the same product into z's natural order (``bmm_into``):
  the rate a regrouping store that cost nothing would have to match.

Times are CUDA-graph replays (median) rotating through copies of x and w1 (> 150 MB) so
the weights come from HBM. Writes ``bgemm_tiles.json``: one row per (case, candidate) with
its ms and TFLOP/s, and per case the best config, the autotuned pick and cuBLAS.
"""
from __future__ import annotations

import argparse
import sys
import time

from blr_layers import BLOCKS, SHAPES, copies_for, gpu_ms

TOKENS = [128, 1024, 8192]
CONFIGS = [  # BN, BC, BK, warps, stages: BGEMM_CONFIGS' large tiles and candidates beside them
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
    (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 128, 64, 8, 4),
    (64, 256, 64, 8, 4), (128, 128, 32, 4, 5), (128, 64, 128, 4, 3), (64, 128, 128, 4, 3), (256, 64, 64, 8, 4),
]


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help=f"token counts N (default {TOKENS})")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NAME",
                        help="only these shapes (default: all of blr_layers.SHAPES)")
    args = parser.parse_args()
    known = [name for name, *_ in SHAPES]
    unknown = sorted(set(args.shapes or ()) - set(known))
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; known: {known}")
    if min(args.tokens) < 1:
        parser.error(f"--tokens takes positive token counts, got {args.tokens}")
    return args


def stage1_case(torch, d_in, rank, n, copies, device):
    """Inputs of Monarch's stage 1 at one shape: ``copies`` of (x, w1, token-major z, natural z)."""
    m, t = d_in // BLOCKS, rank // BLOCKS
    dtype = torch.bfloat16
    return [(torch.randn(n, d_in, device=device, dtype=dtype), torch.randn(BLOCKS, m, rank, device=device, dtype=dtype),
             torch.empty(BLOCKS, rank, n, device=device, dtype=dtype), torch.empty(n, BLOCKS, rank, device=device,
                                                                                   dtype=dtype))
            for _ in range(copies)], m, t


def launcher(x, w1, zp, n, m, r, t, config, even_k):
    """fn() running stage 1 through the bgemm kernel with one tile config, no autotuning."""
    import triton

    from memfit.kernels import blr_common

    bn, bc, bk, warps, stages = config
    jit = blr_common._bgemm_kernel.fn.fn                     # through autotune and heuristics to the jit function
    grid = (triton.cdiv(n, bn) * triton.cdiv(r, bc), BLOCKS)

    def run():
        jit[grid](x, w1, zp, zp, n, m, r, t, BLOCKS, blr_common.n_bucket(n), m, x.stride(0), 1, *w1.stride(),
                  t * n, 1, r * n, n, HAS_BIAS=False, PRECISION=blr_common.blr_precision(x.dtype),
                  LAUNCH_DEPENDENTS=False, WAIT_FOR_PREVIOUS=False, B_ROWS_CONTIGUOUS=False,
                  LINE=blr_common.line_elements(w1), BN=bn, BC=bc, BK=bk, EVEN_K=even_k,
                  num_warps=warps, num_stages=stages)
    return run


def sweep_case(torch, name, d_in, rank, n, device) -> list[dict]:
    from memfit.kernels import blr_common

    m, r = d_in // BLOCKS, rank
    copies = copies_for(2 * (n * d_in + d_in * rank + n * rank), device)
    data, m, t = stage1_case(torch, d_in, rank, n, copies, device)
    flops = 2 * n * d_in * rank
    x0, w0 = data[0][0], data[0][1]
    expected = torch.bmm(x0.view(n, BLOCKS, m).transpose(0, 1).float(), w0.float())   # (b_j, N, b_i t)
    expected = expected.view(BLOCKS, n, BLOCKS, t).permute(2, 0, 3, 1).reshape(BLOCKS, r, n)

    def timed(label, fns, check=None):
        fns[0]()
        error = None
        if check is not None:
            rel = ((check().float() - expected).norm() / expected.norm()).item()
            error = None if rel < 2e-2 else f"wrong result: relative error {rel:.3g}"
        ms = gpu_ms(lambda: [fn() for fn in fns]) / len(fns)
        return {"shape": name, "n": n, "m": m, "r": r, "t": t, "candidate": label, "ms": ms,
                "tflops": flops / ms / 1e9, "copies": copies, **({"error": error} if error else {})}

    rows = []
    for config in CONFIGS:
        bn, bc, bk, warps, stages = config
        if bc > max(32, blr_common.pow2_at_least(r)) or bk > max(32, blr_common.pow2_at_least(m)):
            continue
        if stages * bk * (bn + bc) * 2 > blr_common.SMEM_BYTES:
            continue
        for even_k in ([False, True] if m % bk == 0 else [False]):
            label = f"{bn}x{bc}x{bk} w{warps} s{stages}" + (" even_k" if even_k else "")
            fns = [launcher(x, w1, zp, n, m, r, t, config, even_k) for x, w1, zp, _ in data]
            try:
                rows.append(timed(label, fns, check=lambda: data[0][2]))
            except Exception as err:  # noqa: BLE001 (a config this GPU cannot run is recorded, not fatal)
                rows.append({"shape": name, "n": n, "candidate": label, "ms": float("nan"),
                             "error": f"{type(err).__name__}: {err}"[:300]})
    autotuned = [lambda x=x, w1=w1, zp=zp: blr_common.bgemm(x, w1, zp, n, m, r, BLOCKS, (m, x.stride(0), 1),
                                                            w1.stride(), (t * n, 1, r * n, n), grp=t)
                 for x, w1, zp, _ in data]
    rows.append(timed("bgemm (autotuned)", autotuned, check=lambda: data[0][2]))
    rows[-1]["pick"] = str(blr_common._bgemm_kernel.best_config)
    cublas = [lambda x=x, w1=w1, z=z: blr_common.bmm_into(x.view(n, BLOCKS, m).transpose(0, 1), w1, z.transpose(0, 1))
              for x, w1, _, z in data]
    rows.append(timed("cublas bmm (natural order)", cublas))
    return rows


def summary(rows) -> list[dict]:
    """Per (shape, N): the best config, the autotuned pick and cuBLAS, with ratios to cuBLAS."""
    out = []
    for key in dict.fromkeys((r["shape"], r["n"]) for r in rows):
        case = [r for r in rows if (r["shape"], r["n"]) == key and r["ms"] == r["ms"] and "error" not in r]
        configs = [r for r in case if r["candidate"][0].isdigit()]
        best = min(configs, key=lambda r: r["ms"])
        by_name = {r["candidate"]: r for r in case}
        cublas, pick = by_name["cublas bmm (natural order)"], by_name["bgemm (autotuned)"]
        out.append({"shape": key[0], "n": key[1], "best_config": best["candidate"], "best_ms": best["ms"],
                    "autotuned_ms": pick["ms"], "autotuned_pick": pick.get("pick"), "cublas_ms": cublas["ms"],
                    "best_over_cublas": best["ms"] / cublas["ms"], "autotuned_over_cublas": pick["ms"] / cublas["ms"]})
    return out


def main() -> int:
    args = parse()
    import torch

    if not torch.cuda.is_available():
        print("bgemm_tiles: needs a CUDA GPU", file=sys.stderr)
        return 2
    from rich.progress import Progress

    from memfit.measure.results import write_results

    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes]
    started, rows = time.time(), []
    with Progress() as progress:
        task = progress.add_task("bgemm tiles", total=len(shapes) * len(args.tokens))
        for name, d_in, _, rank in shapes:
            for n in args.tokens:
                rows += sweep_case(torch, name, d_in, rank, n, "cuda")
                progress.advance(task)
                write_results("bgemm_tiles", rows, [], args.out, summary=summary(rows), complete=False)
    path = write_results("bgemm_tiles", rows, [], args.out, summary=summary(rows), complete=True,
                         seconds=time.time() - started)
    for s in summary(rows):
        print(f"{s['shape']:20s} N={s['n']:5d} best {s['best_config']:28s} {1e3 * s['best_ms']:8.1f} us  "
              f"autotuned {1e3 * s['autotuned_ms']:8.1f}  cuBLAS {1e3 * s['cublas_ms']:8.1f}  "
              f"best/cuBLAS {s['best_over_cublas']:.2f}  autotuned/cuBLAS {s['autotuned_over_cublas']:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
