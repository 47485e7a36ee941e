"""The cold cost of the BLR layers' variant pick: the seconds a model's first call of each layer takes.

A layer's first call for a shape compiles the kernels of every candidate pipeline, tunes their tiles, times the
candidates and keeps the fastest (``autotune.pick_variant``). This runs, in one process with an empty pick cache
and an empty Triton cache (both in a temporary directory, so nothing an earlier run compiled or picked is
reused), the first and the second call of the low-rank, Monarch and BLAST layers at each of ``blr_layers``'
shapes and each N asked (default 1 and 16: decode, where the pick offers the most pipelines), and records the
wall-clock seconds of each and how many candidates the pick timed. Kernels are compiled once for every shape
(shapes are runtime ints), so a later shape's first call is cheaper than the first of all; the order is fixed
(shapes, then N, then structures) so that two runs compare case by case. To compare two commits, run this
script under each (``PYTHONPATH`` naming the other's tree). Writes ``pick_cost.json``; ``--smoke`` runs the same
code on tiny shapes on the CPU (Triton interpreter, where the pick takes its default without timing).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import blr_layers  # noqa: E402  (the shapes and layer builders of the layer table)

DEFAULT_TOKENS = [1, 16]


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parse.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through the Triton interpreter")
    parse.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parse.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS,
                       help=f"token counts to pick for, one per pick bucket (default {DEFAULT_TOKENS})")
    return parse


def first_call(torch, layer, x, pick_timings: dict) -> tuple[float, dict]:
    """Wall-clock seconds of ``layer(x)``, the GPU's work included, and the record of the variant pick it made
    (``pick_timings`` is autotune.PICK_TIMINGS; {} where the call made none: a cached or untimed pick)."""
    before = set(pick_timings)
    start = time.perf_counter()
    layer(x)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    made = [pick_timings[key] for key in pick_timings.keys() - before]
    if len(made) > 1:
        raise RuntimeError(f"pick_cost: one layer call made {len(made)} variant picks, expected one")
    return seconds, (made[0] if made else {})


def main() -> int:
    from memfit.measure.results import check_out_dir

    parse = parser()
    args = parse.parse_args()
    check_out_dir(parse, args.out)
    if bad := [n for n in args.tokens if n < 1]:
        parse.error(f"--tokens must be positive, got {bad}")
    with tempfile.TemporaryDirectory(prefix="memfit_pick_cost_") as scratch:
        os.environ["TRITON_CACHE_DIR"] = str(Path(scratch) / "triton")         # before triton is imported
        os.environ["MEMFIT_AUTOTUNE_CACHE"] = str(Path(scratch) / "picks.json")
        return run(parse, args)


def run(parse, args) -> int:
    """Every first and second call, from the empty caches main set up."""
    import torch

    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("pick_cost: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    from memfit.kernels import autotune, blr_common
    from memfit.measure.results import write_results

    buckets = [blr_common.pick_bucket(n) for n in args.tokens]
    if len(set(buckets)) < len(buckets):
        parse.error(f"--tokens {args.tokens} share pick buckets {buckets}: a later one would reuse the pick")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes, blocks = (blr_layers.SMOKE_SHAPES, blr_layers.SMOKE_BLOCKS) if args.smoke else (blr_layers.SHAPES,
                                                                                              blr_layers.BLOCKS)
    rows = []
    save = functools.partial(write_results, "pick_cost" + ("_smoke" if args.smoke else ""), targets=[],
                             out_dir=args.out, blocks=blocks, tokens=args.tokens)
    for name, d_in, d_out, rank in shapes:
        for n in args.tokens:
            built = blr_layers.structures(d_in, d_out, rank, blocks, n, torch.bfloat16, device,
                                          blr_layers.STRUCTURES)
            for kind, (make, _, _) in built.items():
                layer, x = make(), torch.randn(n, d_in, device=device, dtype=torch.bfloat16)
                first_s, timings = first_call(torch, layer, x, autotune.PICK_TIMINGS)
                rows.append({"structure": kind, "shape": name, "n": n, "first_call_s": first_s,
                             "second_call_s": first_call(torch, layer, x, autotune.PICK_TIMINGS)[0],
                             "candidates_timed": len(timings.get("first", {})), "pick": timings.get("pick")})
                print(f"{kind} {name} N={n}: first call {first_s:.1f} s, {rows[-1]['candidates_timed']} "
                      f"candidates timed, pick {rows[-1]['pick']}", flush=True)
                save(rows, complete=False)                                 # a run stopped by a limit keeps its rows
    path = save(rows, complete=True)
    print(f"{len(rows)} first calls took {sum(r['first_call_s'] for r in rows):.1f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
