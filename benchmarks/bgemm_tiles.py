"""Tile sweep of bgemm (the BLR kernels' strided batched GEMM with a regrouping store) against cuBLAS.

Most Monarch pipelines run their stage 1 (z = x_j @ w1[j] for every input block j, P^T folded
into the store) on ``batched_gemm.bgemm``, at decode both stages, and ``bmm_gather`` its stage 2.
For the paper's shapes this times, in one run and each alone:

* every tile config of the mode's list (BN x BC x BK, warps, stages) that fits, with the K mask
  and, where K is a multiple of BK, without it (``EVEN_K``);
* ``bgemm`` as the ops call it (its autotuned pick among ``BGEMM_TUNED``);
* cuBLAS's strided batched GEMM of the same product into its natural order (``torch.bmm``):
  the rate a regrouping store that cost nothing would have to match.

Default mode: stage 1 stored token-contiguous as ``tbmm`` stores it, N in {128, 1024, 8192}, large
tiles (``CONFIGS``); writes ``bgemm_tiles.json``. ``--decode``: both stages as ``two_stage`` runs
them at N in {1, 16}, 16-token tiles (``DECODE_CONFIGS``), each row also against the bandwidth floor
(operands moved once at the HBM rate measured in the run); writes ``bgemm_tiles_decode.json``.
``--mid``: both stages as ``two_stage`` runs them at N in {128, 512} (the pick buckets between
decode and the large tiles), with 32- and 64-token tiles of few columns (``MID_CONFIGS``): at N =
128 the large tiles leave most SMs idle (Llama-1B q/o's stage 2 in 128 x 64 tiles: 32 programs on 132
SMs); writes ``bgemm_tiles_mid.json``. ``--gather``: stage 2 as ``bmm_gather`` runs it (a = stage
1's natural (N, b, r) output, P^T gathered by the loads), every tile reading the runs themselves
and, where they start misaligned (Llama-7B's t = 93), aligned windows around them; cuBLAS runs on a
P^T-permuted copy; writes ``bgemm_tiles_gather.json``. ``--runs-z``: stage 1 stored (N, b, r) in
runs of t, as ``bmm`` stores it. ``--groups G ...``: each tile also with G batches (input blocks)
per program (``BATCH_GROUP``: one flat loop over the batches' K steps, so the next batch's tiles
load while this one's result is stored); these options add ``_runs_z`` / ``_groups`` to the file
name, ``--tiles T`` keeps the first T tiles of the list. Times are CUDA-graph replays (median)
rotating through copies of the operands (> 150 MB) so the weights come from HBM.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time

from blr_layers import BLOCKS, check_tokens, copies_for, gpu_ms, select_shapes

TOKENS, DECODE_TOKENS = [128, 1024, 8192], [1, 16]
CONFIGS = [  # BN, BC, BK, warps, stages: BGEMM_CONFIGS' large tiles and candidates beside them
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
    (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 128, 64, 8, 4),
    (64, 256, 64, 8, 4), (128, 128, 32, 4, 5), (128, 64, 128, 4, 3), (64, 128, 128, 4, 3), (256, 64, 64, 8, 4),
]
DECODE_CONFIGS = [  # BGEMM_CONFIGS' 16-token tiles and candidates with fewer columns, more stages or fewer warps
    (16, 32, 256, 4, 3), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3),
    (16, 16, 256, 4, 3), (16, 16, 512, 4, 3), (16, 32, 128, 4, 4), (16, 32, 512, 4, 2), (16, 32, 256, 2, 4),
    (16, 64, 128, 2, 4), (16, 64, 64, 4, 6), (16, 32, 128, 2, 6), (16, 128, 64, 4, 5), (16, 64, 256, 8, 3),
    (16, 16, 128, 2, 6), (16, 32, 64, 2, 8),
]

MID_TOKENS = [128, 512]
MID_CONFIGS = [  # 32- and 64-token tiles, few columns: more programs where N and the columns are small
    (32, 32, 64, 2, 4), (32, 32, 128, 4, 3), (32, 64, 64, 4, 4), (32, 64, 128, 4, 3), (32, 128, 64, 4, 4),
    (32, 128, 128, 4, 3), (32, 64, 64, 2, 5), (32, 256, 64, 4, 3), (64, 32, 64, 4, 4), (64, 32, 128, 4, 3),
    (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 64, 64, 2, 5), (64, 128, 128, 4, 3),
]


def parse():
    from memfit.measure.results import check_out_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--decode", action="store_true", help="both stages at decode-sized N with 16-token tiles")
    parser.add_argument("--mid", action="store_true",
                        help="both stages at N between decode and the large tiles, with 32- and 64-token tiles")
    parser.add_argument("--gather", action="store_true",
                        help="stage 2 reading P^T through its loads, as bmm_gather runs it (runs and aligned windows)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"token counts N (default {TOKENS}, with --decode {DECODE_TOKENS}, with --mid "
                             f"{MID_TOKENS})")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NAME",
                        help="only these shapes (default: all of blr_layers.SHAPES)")
    parser.add_argument("--groups", type=int, nargs="+", default=[1], metavar="G",
                        help="also time each tile with G batches per program (BATCH_GROUP; not with --gather)")
    parser.add_argument("--runs-z", action="store_true",
                        help="stage 1 stored (N, b, r), runs of t, as bmm and two_stage store it (default: token-major)")
    parser.add_argument("--tiles", type=int, default=None, metavar="T", help="only the first T tiles of the mode's list")
    args = parser.parse_args()
    check_out_dir(parser, args.out)
    if args.decode + args.gather + args.mid > 1:
        parser.error("--decode, --mid and --gather each time other stages: give one")
    args.shapes = select_shapes(parser, args.shapes)
    args.tokens = args.tokens or (DECODE_TOKENS if args.decode else MID_TOKENS if args.mid else TOKENS)
    check_tokens(parser, args.tokens)
    if args.runs_z and (args.decode or args.gather or args.mid):
        parser.error("--runs-z chooses the layout of the large-N stage 1; --decode, --mid and --gather time other "
                     "stages")
    if args.tiles is not None and args.tiles < 1:
        parser.error(f"--tiles takes a positive count of tiles, got {args.tiles}")
    if args.tiles is not None and args.tiles > (offered := len(mode_tiles(args)[1])):
        parser.error(f"--tiles {args.tiles}: this mode offers {offered} tiles")
    if min(args.groups) < 1 or ((args.gather or args.mid) and args.groups != [1]):
        parser.error(f"--groups takes positive batch counts, and not with --gather or --mid; got {args.groups}")
    return args


def mode_tiles(args) -> tuple[tuple[int, ...], list[tuple]]:
    """The stages the mode of ``args`` times and its list of tiles, of which --tiles keeps the first T."""
    from memfit.kernels.batched_gemm import BGEMM_SHORT_RUNS

    return (((1, 2), DECODE_CONFIGS) if args.decode else ((1, 2), MID_CONFIGS) if args.mid
            else ((2,), CONFIGS + BGEMM_SHORT_RUNS) if args.gather else ((1,), CONFIGS))


class Gemm:
    """One bgemm call of a Monarch stage: ``copies`` of its operands and how the kernel is called.

    Stage 1 is z = x_j @ w1[j] with P^T folded into the store: token-contiguous z, (b, r, N) in w2's (s, j)
    row order, as ``tbmm`` stores it (``token_major``), or (N, b, r) as ``two_stage`` does (decode). Stage 2
    is y_i = z[:, i] @ w2[i], the block-major output, as ``two_stage`` runs it, w2's rows read interleaved
    (``b_interleaved``); with ``gather``, as ``bmm_gather`` runs it: z in stage 1's natural order, block i's
    operand gathered from b runs of t elements (``runs`` = (t, r)), z allocated with the slack aligned windows
    read past its end.
    """

    def __init__(self, torch, stage, d_in, d_out, rank, n, copies, token_major, device="cuda", gather=False):
        from memfit.kernels.batched_gemm import A_WINDOW_SLACK

        b, m, r, p = BLOCKS, d_in // BLOCKS, rank, d_out // BLOCKS
        t = r // b
        new = functools.partial(torch.randn, device=device, dtype=torch.bfloat16)
        self.runs = (t, r) if gather else None
        self.b_interleaved = 1 if stage == 1 and not gather else b
        if gather:
            self.k, self.cols, self.grp = r, p, p
            self.a_strides, self.b_strides, self.c_strides = (t, b * r, 1), (r * p, p, 1), (p, b * p, 0, 1)
            make = lambda: (new(n * b * r + A_WINDOW_SLACK), new(b, r, p), new(n * b * p))   # noqa: E731
        elif stage == 1:
            self.k, self.cols, self.grp = m, r, t
            self.a_strides, self.b_strides = (m, d_in, 1), (m * r, r, 1)
            self.c_strides = (n, 1, r * n, b * n) if token_major else (t, b * r, r, 1)
            make = lambda: (new(n, d_in), new(b, m, r), new(b * r * n))                   # noqa: E731
        else:
            self.k, self.cols, self.grp = r, p, p
            self.a_strides, self.b_strides, self.c_strides = (r, b * r, 1), (r * p, p, 1), (p, b * p, 0, 1)
            make = lambda: (new(n, b * r), new(b, r, p), new(n * b * p))                   # noqa: E731
        self.n, self.batches = n, b
        self.operands = [make() for _ in range(copies)]
        self.bytes = 2 * b * (n * self.k + self.k * self.cols + n * self.cols)
        self.flops = 2 * b * n * self.k * self.cols

    def views(self, torch, a, b):
        """A (batches, n, k) and B (batches, k, cols) as the kernel reads them (a gathered A: a copy)."""
        sbb, row, sbc = self.b_strides                                             # interleaved: K's rows (j, s)
        g = self.b_interleaved
        bv = b.as_strided((self.batches, g, self.k // g, self.cols), (sbb, row, g * row, sbc)).reshape(
            self.batches, self.k, self.cols)
        if self.runs:
            t, bb = self.runs[0], self.batches
            z = a[:self.n * bb * self.k].view(self.n, bb, bb, t)                  # (n, j, i, s)
            return z.permute(2, 0, 1, 3).reshape(bb, self.n, self.k), bv
        return a.as_strided((self.batches, self.n, self.k), self.a_strides), bv

    def stored(self, torch, c):
        """The (batches, n, cols) product as the kernel's regrouping store laid it out in ``c``."""
        scb, scn, scg, sci = self.c_strides
        bt = torch.arange(self.batches, device=c.device)[:, None, None]
        rows = torch.arange(self.n, device=c.device)[None, :, None]
        col = torch.arange(self.cols, device=c.device)[None, None, :]
        return c[bt * scb + rows * scn + (col // self.grp) * scg + (col % self.grp) * sci]

    def args(self, a, b, c):
        return (a, b, c, self.n, self.k, self.cols, self.batches, self.a_strides, self.b_strides, self.c_strides)

    def run_length(self) -> int:
        """K's run length as the kernel sees it (AGRP): t for a gathered A, else all of K."""
        return self.runs[0] if self.runs else self.k

    def window(self, a) -> int:
        """The aligned-window width bgemm would read this call's A in (0: it reads the runs)."""
        from memfit.kernels import batched_gemm

        return batched_gemm.a_window(a, *self.a_strides, self.runs[1], True) if self.runs else 0

    def launcher(self, a, b, c, config, even_k, window=0, group=1):
        """fn() running this call through the bgemm kernel with one tile config, no autotuning; ``window``:
        a gathered A read in aligned windows of that many elements instead of its runs; ``group``: batches
        per program (``BATCH_GROUP``). An unchained launch (chains time their tile pairs through the op's own
        pipeline: chain_tiles.py)."""

        from memfit.kernels import batched_gemm, blr_common

        bn, bc, bk, warps, stages = config
        jit = batched_gemm.jit_function(batched_gemm._bgemm_kernel)
        grid = batched_gemm.bgemm_grid(self.n, self.cols, self.batches, bn, bc, group)
        run_stride = self.runs[1] if self.runs else 0
        g = self.b_interleaved
        b_strides = batched_gemm.bgemm_b_strides(self.b_strides, self.run_length(), g)
        unchained = blr_common.chain_options(launch_dependents=False, wait_for_previous=False)
        return lambda: jit[grid](a, b, c, c, self.n, self.k, self.cols, self.grp, self.run_length(), self.batches,
                                 blr_common.n_bucket(self.n), *self.a_strides, run_stride, *b_strides,
                                 *self.c_strides, self.k // g if g > 1 else 0, HAS_BIAS=False,
                                 PRECISION=blr_common.blr_precision(a.dtype), B_ROWS_CONTIGUOUS=False,
                                 LINE=blr_common.line_elements(b), BN=bn, BC=bc, BK=bk, EVEN_K=even_k,
                                 A_GROUPED=self.runs is not None, B_INTERLEAVED=g > 1, A_WINDOW=window,
                                 BATCH_GROUP=group,
                                 num_warps=warps, num_stages=stages, **unchained)


def sweep_case(torch, name, d_in, d_out, rank, n, stage, configs, token_major, bandwidth, device="cuda",
               gather=False, groups=(1,)) -> list[dict]:
    """Rows for one (shape, N, stage): each config of ``configs`` alone (and with each batch group of
    ``groups`` above 1), the autotuned call, cuBLAS."""
    import triton

    from memfit.kernels import batched_gemm

    probe = Gemm(torch, stage, d_in, d_out, rank, n, 1, token_major, device, gather)
    gemm = Gemm(torch, stage, d_in, d_out, rank, n, copies_for(probe.bytes, device), token_major, device, gather)
    a0, b0, c0 = gemm.operands[0]
    expected = torch.bmm(*(v.float() for v in gemm.views(torch, a0, b0)))
    floor_ms = 1e3 * gemm.bytes / bandwidth

    def timed(label, fns, checked=True):
        c0.zero_()                                           # a kernel that writes nothing must not pass on the last one's z
        fns[0]()
        error = None
        if checked:
            rel = ((gemm.stored(torch, c0).float() - expected).norm() / expected.norm()).item()
            error = None if rel < 2e-2 else f"wrong result: relative error {rel:.3g}"
        ms = gpu_ms(lambda: [fn() for fn in fns]) / len(fns)
        layout = ("P^T gathered, block-major output" if gather else "block-major output" if stage == 2
                  else "token-major z" if token_major else "(N, b, r) z")
        return {"shape": name, "n": n, "stage": stage, "layout": layout,
                "k": gemm.k, "cols": gemm.cols, "grp": gemm.grp, "candidate": label, "ms": ms,
                "tflops": gemm.flops / ms / 1e9, "gbs": gemm.bytes / ms / 1e6, "x_bandwidth_floor": ms / floor_ms,
                "copies": len(fns), **({"error": error} if error else {})}

    rows = []
    for config in configs:
        bn, bc, bk, warps, stages = config
        tile = triton.Config({"BN": bn, "BC": bc, "BK": bk}, num_warps=warps, num_stages=stages)
        if not batched_gemm.bgemm_tile_fits(tile, gemm.cols, gemm.run_length(), a0.element_size()):
            continue
        even, window_width = [False, True] if gemm.run_length() % bk == 0 else [False], gemm.window(a0)
        variants = [(e, 0, 1) for e in even] + [(even[-1], 0, g) for g in groups if g > 1]   # grouped: as bgemm picks EVEN_K
        for even_k, window, group in variants + ([(False, window_width, 1)] if window_width else []):
            label = (f"{bn}x{bc}x{bk} w{warps} s{stages}" + (" even_k" if even_k else "") + (" windows" if window else "")
                     + (f" g{group}" if group > 1 else ""))
            try:
                rows.append(timed(label, [gemm.launcher(*ops, config, even_k, window, group) for ops in gemm.operands]))
            except Exception as err:  # noqa: BLE001 (a config this GPU cannot run is recorded, not fatal)
                rows.append({"shape": name, "n": n, "stage": stage, "candidate": label, "ms": float("nan"),
                             "error": f"{type(err).__name__}: {err}"[:300]})
    rows.append(timed("bgemm (autotuned)", [lambda ops=ops: batched_gemm.bgemm(*gemm.args(*ops), grp=gemm.grp,
                                                                               a_runs=gemm.runs,
                                                                               b_interleaved=gemm.b_interleaved)
                                            for ops in gemm.operands]))
    rows[-1]["pick"] = str(batched_gemm._bgemm_kernel.best_config)
    natural = [(*gemm.views(torch, a, b), torch.empty(gemm.batches, n, gemm.cols, device=device, dtype=a.dtype))
               for a, b, _ in gemm.operands]                       # a gathered A: its P^T copy, made here, untimed
    rows.append(timed(CUBLAS_GATHERED if gather else CUBLAS,
                      [lambda a=a, b=b, c=c: torch.bmm(a, b, out=c) for a, b, c in natural], checked=False))
    return rows


CUBLAS = "cublas bmm (natural order)"                 # the same product, output in cuBLAS's natural order
CUBLAS_GATHERED = "cublas bmm (P^T copy untimed)"     # and, for a gathered A, from a P^T copy made beforehand


def summary(rows) -> list[dict]:
    """Per (shape, N, stage): the best config, the autotuned pick and cuBLAS, with ratios to cuBLAS (a
    case where any of the three has no valid time is left out; its rows say why)."""
    out = []
    for key in dict.fromkeys((r["shape"], r["n"], r["stage"]) for r in rows):
        case = [r for r in rows if (r["shape"], r["n"], r["stage"]) == key and r["ms"] == r["ms"] and "error" not in r]
        configs = [r for r in case if r["candidate"][0].isdigit()]
        by_name = {r["candidate"]: r for r in case}
        cublas, pick = by_name.get(CUBLAS) or by_name.get(CUBLAS_GATHERED), by_name.get("bgemm (autotuned)")
        if not configs or cublas is None or pick is None:
            continue
        best = min(configs, key=lambda r: r["ms"])
        out.append({"shape": key[0], "n": key[1], "stage": key[2], "best_config": best["candidate"], "best_ms": best["ms"],
                    "best_x_bandwidth_floor": best["x_bandwidth_floor"],
                    "autotuned_x_bandwidth_floor": pick["x_bandwidth_floor"],
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
    from memfit.measure.timing import measure_ceilings

    shapes = args.shapes
    stages, configs = mode_tiles(args)
    configs = configs[:args.tiles]
    mode = "_decode" if args.decode else "_mid" if args.mid else "_gather" if args.gather else ""
    stem = ("bgemm_tiles" + mode
            + ("_runs_z" if args.runs_z else "") + ("_groups" if args.groups != [1] else ""))
    started, rows, bandwidth = time.time(), [], measure_ceilings().bandwidth
    with Progress() as progress:
        task = progress.add_task("bgemm tiles", total=len(shapes) * len(args.tokens) * len(stages))
        for name, d_in, d_out, rank in shapes:
            for n in args.tokens:
                for stage in stages:
                    rows += sweep_case(torch, name, d_in, d_out, rank, n, stage, configs,
                                       not (args.decode or args.mid or args.runs_z), bandwidth, gather=args.gather,
                                       groups=args.groups)
                    progress.advance(task)
                write_results(stem, rows, [], args.out, summary=summary(rows), complete=False,
                              bandwidth_gbs=bandwidth / 1e9)
    path = write_results(stem, rows, [], args.out, summary=summary(rows), complete=True,
                         seconds=time.time() - started, bandwidth_gbs=bandwidth / 1e9)
    for s in summary(rows):
        print(f"{s['shape']:20s} N={s['n']:5d} stage {s['stage']} best {s['best_config']:24s} {1e3 * s['best_ms']:8.1f} us"
              f" (x{s['best_x_bandwidth_floor']:.2f} floor)  autotuned {1e3 * s['autotuned_ms']:8.1f} "
              f"(x{s['autotuned_x_bandwidth_floor']:.2f})  cuBLAS {1e3 * s['cublas_ms']:8.1f}  "
              f"autotuned/cuBLAS {s['autotuned_over_cublas']:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
