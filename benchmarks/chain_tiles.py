"""Monarch's chained pipeline (``two_stage_pdl``) with each pair of stage tiles, timed together.

bgemm's autotuner picks each launch's tile from that launch timed alone, after an L2 flush. In a chain the
second stage starts early and waits (programmatic dependent launch), so its programs share the GPU with
the first stage's: the two tiles that are each fastest alone need not be the fastest pair. The layer
tables read ``two_stage_pdl`` at Llama-1B up, N = 128, at 11.15, 12.69 and 13.32 us (1476f91, 273092a,
f969028; the first and the last offered the same tiles), and none of them recorded the tiles taken. The first
run of this benchmark (19084f9, each stage autotuned alone) put the op at 1.00-1.07x the best pair and the pairs
of Llama-1B up at 10.88-18.47 us, 13.33 with a stage-2 tile its autotuner may take alone; since then the op
times the pairs itself (``batched_gemm.pick_chain_tiles``). For the paper's shapes at the token counts given
(default N = 128) this times, in one run:

* every pair (stage-1 tile, stage-2 tile) of the tiles bgemm offers the two chained launches
  (``batched_gemm.bgemm_tiles_offered``), run through the op's own pipeline with that pair fixed
  (``monarch._chained_two_stage``, which allocates z and y as the op does), each pair's output checked against
  torch (until 34f6713 the pairs ran through bgemm_tiles' launcher into preallocated z and y);
* ``two_stage_pdl`` as the op runs it, with the tiles it took (``tile_picks``): its own pick among the same
  pairs, so it should read as the best pair, within the timing noise.

Times are CUDA-graph replays (median) rotating through copies of the operands (> 150 MB), so the weights
come from HBM. Writes ``chain_tiles.json``.

    python benchmarks/chain_tiles.py [--tokens 128] [--shapes NAME ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
import time

from blr_layers import BLOCKS, check_tokens, copies_for, gpu_ms, select_shapes

TOKENS = [128]
OP = "two_stage_pdl (as the op runs it)"
MAX_REL_ERR = 2e-2


def parse():
    from memfit.kernels.monarch import TWO_STAGE_PDL_MAX_N
    from memfit.measure.results import check_out_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help=f"token counts N (default {TOKENS})")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NAME",
                        help="only these shapes (default: all of blr_layers.SHAPES)")
    args = parser.parse_args()
    check_out_dir(parser, args.out)
    check_tokens(parser, args.tokens)
    if too_many := [n for n in args.tokens if n > TWO_STAGE_PDL_MAX_N]:
        parser.error(f"--tokens {too_many}: the chained pipeline runs up to {TWO_STAGE_PDL_MAX_N} tokens")
    args.shapes = select_shapes(parser, args.shapes)
    return args


class Chain:
    """``copies`` of one Monarch layer's operands (x, w1, w2), bf16, and the bytes one chained call moves."""

    def __init__(self, torch, d_in, d_out, rank, n, copies, device="cuda"):
        b, m, p = BLOCKS, d_in // BLOCKS, d_out // BLOCKS
        new = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16)   # noqa: E731
        self.operands = [(new(n, d_in), new(b, m, rank), new(b, rank, p)) for _ in range(copies)]
        self.bytes = 2 * (n * d_in + d_in * rank + 2 * n * b * rank + rank * d_out + n * d_out)


def chained(x, w1, w2, tiles):
    """fn() running ``two_stage_pdl``'s pipeline as the op does, with this pair of tiles instead of its pick."""
    from memfit.kernels.monarch import _chained_two_stage

    return lambda: _chained_two_stage(x, w1, w2, None, False, tiles=tiles)


def sweep_pairs(torch, name, d_in, d_out, rank, n, tiles1, tiles2, device="cuda") -> list[dict]:
    """Rows for one (shape, N): each pair of ``tiles1`` x ``tiles2`` and the op as it runs (its own pick of a pair)."""
    from memfit.kernels.monarch import monarch_linear, monarch_linear_reference

    probe = Chain(torch, d_in, d_out, rank, n, 1, device)
    chain = Chain(torch, d_in, d_out, rank, n, copies_for(probe.bytes, device), device)
    x0, w10, w20 = chain.operands[0]
    expected = monarch_linear_reference(x0.float(), w10.float(), w20.float())

    def timed(label, fns):
        """The row of ``fns`` (one per copy): checked on the first copy's output, then timed over all copies."""
        rel = ((fns[0]().view(n, -1).float() - expected).norm() / expected.norm()).item()
        row = {"shape": name, "n": n, "candidate": label, "rel_err": rel, "copies": len(fns)}
        if rel >= MAX_REL_ERR:
            return row | {"ms": float("nan"), "error": f"wrong result: relative error {rel:.3g}"}
        return row | {"ms": gpu_ms(lambda: [fn() for fn in fns]) / len(fns)}

    rows = []
    for tile1 in tiles1:
        for tile2 in tiles2:
            label = " + ".join("{}x{}x{} w{} s{}".format(*tile) for tile in (tile1, tile2))
            try:
                rows.append(timed(label, [chained(*ops, (tile1, tile2)) for ops in chain.operands]))
            except Exception as err:  # noqa: BLE001 (a pair this GPU cannot run is recorded, not fatal)
                rows.append({"shape": name, "n": n, "candidate": label, "ms": float("nan"),
                             "error": f"{type(err).__name__}: {err}"[:300]})
    rows.append(timed(OP, [lambda x=x, w1=w1, w2=w2: monarch_linear(x, w1, w2, variant="two_stage_pdl")
                           for x, w1, w2 in chain.operands]))
    return rows


def summary(rows) -> list[dict]:
    """Per (shape, N): the fastest pair and the op as it runs, with their ratio (a case without both is left out)."""
    out = []
    for key in dict.fromkeys((r["shape"], r["n"]) for r in rows):
        case = [r for r in rows if (r["shape"], r["n"]) == key and "error" not in r]
        pairs, op = [r for r in case if r["candidate"] != OP], next((r for r in case if r["candidate"] == OP), None)
        if pairs and op:
            best = min(pairs, key=lambda r: r["ms"])
            out.append({"shape": key[0], "n": key[1], "best_pair": best["candidate"], "best_ms": best["ms"],
                        "op_ms": op["ms"], "op_over_best": op["ms"] / best["ms"], "pairs": len(pairs)})
    return out


def main() -> int:
    args = parse()
    import torch

    if not torch.cuda.is_available():
        print("chain_tiles: needs a CUDA GPU (programmatic dependent launch)", file=sys.stderr)
        return 2
    from rich.progress import Progress

    from memfit.kernels import autotune, batched_gemm
    from memfit.measure.results import write_results

    started, rows = time.time(), []
    with Progress() as progress:
        task = progress.add_task("chained tile pairs", total=len(args.shapes) * len(args.tokens))
        for name, d_in, d_out, rank in args.shapes:
            for n in args.tokens:
                probe = torch.empty(1, device="cuda", dtype=torch.bfloat16)
                tiles1 = batched_gemm.bgemm_tiles_offered(probe, n, d_in // BLOCKS, rank, BLOCKS, launch_dependents=True)
                tiles2 = batched_gemm.bgemm_tiles_offered(probe, n, rank, d_out // BLOCKS, BLOCKS, wait_for_previous=True)
                rows += sweep_pairs(torch, name, d_in, d_out, rank, n, tiles1, tiles2)
                write_results("chain_tiles", rows, [], args.out, summary=summary(rows), complete=False,
                              tile_picks=autotune.tile_picks())
                progress.advance(task)
    path = write_results("chain_tiles", rows, [], args.out, summary=summary(rows), complete=True,
                         seconds=time.time() - started, tile_picks=autotune.tile_picks())
    for s in summary(rows):
        print(f"{s['shape']:20s} N={s['n']:5d} best pair {s['best_pair']:40s} {1e3 * s['best_ms']:7.2f} us  "
              f"op {1e3 * s['op_ms']:7.2f} us (x{s['op_over_best']:.2f}, {s['pairs']} pairs)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
