"""Layer-level benchmark of the block-low-rank layers (issue 3) against dense and the roofline.

For the paper's shapes (Llama-3.2-1B and Llama-7B projections, b = 16) and N in
{1, 16, 128, 1024, 8192} bf16 tokens it times, in one run:

* dense cuBLAS (``F.linear``), eager and ``torch.compile``d;
* for low-rank, Monarch and BLAST: the plain PyTorch reference, each pipeline
  (variant) the op offers at that shape on its own, and ``ours`` (the layer's default
  path: the variant ``pick_variant`` chooses, which is what a user gets). Monarch runs
  in the layer's default block-major (P-free) output layout, and ``monarch_permuted``
  times the op's pick for the paper's permuted layout on the same weights; each
  Monarch row names its ``layout``;
* the roofline floor of each structure (x + weights + y moved once, all FLOPs at the
  measured matmul rate; memfit.measure.roofline), with the ceilings measured here.

Times are CUDA-graph replays (``memfit.measure.timing.graph_ms``, do_bench_cudagraph's median) so that
decode-sized kernels are timed, not Python's launch overhead, over several copies of
the weights and inputs (together > 2x the 50 MB L2) so nothing is served from L2. Every
implementation of a case is built, run and checked first, then all are timed in
TIMING_ROUNDS rounds, forward and reverse by turns; a row's ``ms`` is the median of its
``ms_rounds``, whose spread shows the noise within the run, and a drift of the GPU's speed
over a case cannot favour whichever implementation is timed first. (Between runs of the same
kernels dense eager read up to 19.8% apart at N = 8192: ``--summarize`` with the 89a2ab1,
43f911d, 04677cb and 9f70ccb runs in results/earlier.)
Writes ``blr_layers.json`` and ``blr_layers_roofline.png`` (both after every case, the JSON
``"complete": false`` until the end; ``--resume`` continues such a file); ``--profile`` also, and
``--profile-only`` instead, writes ``blr_layers_profile.json`` (each pipeline's kernels at PROFILE_CASES).
``--smoke`` runs the same code on tiny shapes on the CPU (Triton interpreter) and writes
``blr_layers_smoke.*`` to a temp dir.
"""
from __future__ import annotations

import argparse
import ast
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

PAPER_MS_N8192_GATE = {"blast": 0.76, "monarch": 0.60}   # arXiv 2512.20861's Triton kernels on an H200
SHAPES = [  # name, in, out, rank
    ("llama-3.2-1b q/o", 2048, 2048, 256), ("llama-3.2-1b gate", 2048, 8192, 512),
    ("llama-3.2-1b up", 2048, 8192, 768), ("llama-3.2-1b down", 8192, 2048, 768),
    ("llama-7b qkvo", 4096, 4096, 1024), ("llama-7b gate/up", 4096, 11008, 1488),
    ("llama-7b down", 11008, 4096, 1488),
]
TOKENS = [1, 16, 128, 1024, 8192]
STRUCTURES = ["lowrank", "monarch", "blast"]
BLOCKS = 16
SMOKE_SHAPES, SMOKE_TOKENS, SMOKE_BLOCKS = [("smoke 48->80", 48, 80, 12)], [1, 40], 4
TIMING_ROUNDS = 4        # every implementation of a case is timed this many times, by turns with the others (median),
ROUND_REP_MS = 2.5       # each time over 2.5 ms of graph replays (together the 10 ms one timing had before)
MAX_REL_ERR = 2e-2       # bf16: every pipeline must match the first row of its structure to this (a wrong one is an error row)


def parse():
    from memfit.measure.results import check_out_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through the Triton interpreter")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"only these N (default {TOKENS}); the results file is then blr_layers_subset.json")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NAME",
                        help="only these shapes (default: all of SHAPES); the results file is then blr_layers_subset.json")
    parser.add_argument("--structures", nargs="+", default=None, choices=STRUCTURES, metavar="KIND",
                        help=f"only these block-low-rank structures, of {', '.join(STRUCTURES)} (dense is always "
                             "timed, as the baseline); the files are then blr_layers_subset.json and "
                             "blr_layers_profile_subset.json")
    parser.add_argument("--profile", action="store_true",
                        help="also write blr_layers_profile.json: every pipeline's kernels, one by one, at PROFILE_CASES")
    parser.add_argument("--profile-only", action="store_true",
                        help="write only blr_layers_profile.json (the full table and the profile together take "
                             "longer than one 10-minute GPU session call)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the results file a stopped run left (same commit and GPU): keep its rows and "
                             "ceilings, time only the cases it lacks")
    parser.add_argument("--summarize", nargs="+", default=None, metavar="FILE",
                        help="time nothing: print the timing noise and pick misses of these finished results files "
                             "(the figures the notes quote) and how far dense eager read apart between them")
    args = parser.parse_args()
    check_out_dir(parser, args.out)
    if args.summarize and (args.smoke or args.tokens or args.shapes or args.structures or args.profile
                           or args.profile_only or args.resume):
        parser.error("--summarize reads results files; it takes no other option")
    if args.profile_only and (args.tokens or args.shapes or args.resume):
        parser.error("--profile-only profiles PROFILE_CASES; --tokens, --shapes and --resume are for the table")
    if args.tokens:
        check_tokens(parser, args.tokens)
    if args.shapes and args.smoke:
        parser.error("--shapes picks among the paper's shapes; --smoke runs its own tiny one")
    args.paper_shapes = select_shapes(parser, args.shapes)
    args.kinds = [kind for kind in STRUCTURES if kind in (args.structures or STRUCTURES)]
    return args


def check_tokens(parser, tokens: list[int]) -> None:
    """A usage error unless ``--tokens`` names positive token counts, each once (a repeated one is a case timed
    twice)."""
    if min(tokens) < 1 or len(set(tokens)) < len(tokens):
        parser.error(f"--tokens takes positive token counts, each once, got {tokens}")


def select_shapes(parser, names: list[str] | None) -> list[tuple]:
    """The entries of SHAPES named by ``--shapes`` (all without it); an unknown name is a usage error."""
    known = [name for name, *_ in SHAPES]
    if unknown := sorted(set(names or ()) - set(known)):
        parser.error(f"unknown shape(s) {unknown}; known: {known}")
    return [shape for shape in SHAPES if names is None or shape[0] in names]


def main() -> int:
    args = parse()
    if args.summarize:
        try:
            runs = {path: json.loads(Path(path).read_text()) for path in args.summarize}
        except (OSError, ValueError) as err:
            print(f"blr_layers: cannot read a results file: {err}", file=sys.stderr)
            return 2
        tables = ("blr_layers", "blr_layers_subset", "blr_layers_smoke", "blr_layers_smoke_subset")
        if wrong := [path for path, data in runs.items()
                     if not isinstance(data, dict) or data.get("benchmark") not in tables]:
            print(f"blr_layers: not a layer table written by this benchmark: {', '.join(wrong)}", file=sys.stderr)
            return 2
        print(summarize(runs))
        return 0
    import torch

    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("blr_layers: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    blocks = SMOKE_BLOCKS if args.smoke else BLOCKS
    if not args.profile_only and run_table(args, torch, device, blocks) != 0:
        return 2
    if args.profile or args.profile_only:
        from memfit.measure.results import write_results

        cases = SMOKE_PROFILE_CASES if args.smoke else PROFILE_CASES
        name = "blr_layers_profile" + ("_smoke" if args.smoke else "") + ("_subset" if args.structures else "")
        start = time.perf_counter()
        stopped = functools.partial(write_results, name, targets=[], out_dir=args.out, blocks=blocks, complete=False)
        profiled = profile_cases(torch, cases, blocks, torch.bfloat16, device, args.kinds, save=stopped)
        path = write_results(name, profiled, [], args.out, blocks=blocks, complete=True,
                             seconds=time.perf_counter() - start)
        print(f"wrote {path}")
    return 0


def run_table(args, torch, device: str, blocks: int) -> int:
    """Time every implementation at every (shape, N) and write blr_layers.json and its roofline plot;
    2 where ``--resume`` finds neither a stopped run of these cases to continue nor a complete one."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from memfit.errors import MemfitError
    from memfit.kernels import autotune
    from memfit.measure.results import partial_results, results_path, target, write_results
    from memfit.measure.roofline import layer_cost, plot_roofline
    from memfit.measure.timing import Ceilings, empty_kernel_ms, measure_ceilings

    dtype = torch.bfloat16
    shapes, tokens = (SMOKE_SHAPES, SMOKE_TOKENS) if args.smoke else (args.paper_shapes, TOKENS)
    tokens = args.tokens or tokens
    timer = functools.partial(gpu_ms, rep=ROUND_REP_MS) if device == "cuda" else cpu_ms
    subset = args.tokens or args.shapes or args.structures
    stem = "blr_layers" + ("_smoke" if args.smoke else "") + ("_subset" if subset else "")
    rows, started, pick_timings, tile_picks, gpu_states, case_seconds = [], time.time(), {}, {}, [], []
    cases = {"shapes": [name for name, *_ in shapes], "tokens": tokens, "blocks": blocks, "structures": args.kinds}
    path = results_path(stem, args.out)
    state = run_state(path)
    if args.resume and state == "complete":              # the run a second call would continue already finished
        written = json.loads(path.read_text())           # of other cases, this run's were never timed: refused
        if differ := [f"{key} {written.get(key)!r}, this run has {value!r}"
                      for key, value in cases.items() if written.get(key) != value]:
            print(f"blr_layers: cannot resume {path}: it was written with {'; '.join(differ)}", file=sys.stderr)
            return 2
        print(f"blr_layers: {path} is a complete run; nothing to resume")
        return 0
    if args.resume:                                      # the stopped run's rows, time so far and ceilings
        try:
            earlier = partial_results(path, **cases)
            rows, started = earlier["rows"], started - earlier["seconds"]
            pick_timings, gpu_states = earlier.get("pick_timings", {}), earlier.get("gpu_states", [])
            tile_picks = earlier.get("tile_picks", {})
            if not (isinstance(tile_picks, dict) and all(isinstance(keys, dict) for keys in tile_picks.values())):
                raise MemfitError(f"cannot resume {path}: its tile_picks is not kernel -> {{key: tile}} (edited?)")
            case_seconds = earlier.get("case_seconds", [])
            ceilings = Ceilings(matmul_flops=earlier["ceilings"]["matmul_tflops"] * 1e12,
                                bandwidth=earlier["ceilings"]["bandwidth_gbs"] * 1e9)
            empty_ms = earlier["ceilings"]["empty_kernel_ms"]
        except MemfitError as err:
            print(f"blr_layers: {err}", file=sys.stderr)
            return 2
        except (KeyError, TypeError) as err:
            print(f"blr_layers: cannot resume {path}: it lacks {err} (not written by this benchmark?)", file=sys.stderr)
            return 2
    elif device == "cuda":
        ceilings, empty_ms = measure_ceilings(), empty_kernel_ms()
    else:
        ceilings, empty_ms = Ceilings(matmul_flops=1e12, bandwidth=1e11), 0.0
    if not args.resume and state == "stopped":
        print(f"blr_layers: replacing the stopped run in {path} (--resume would continue it)")
    if device == "cuda" and (picks := own_pick_cache(path, args.resume)):
        print(f"blr_layers: the variant picks go to {picks}")
    done = {(r["shape"], r["n"]) for r in rows}

    def save(complete: bool):
        """Write the JSON and its roofline plot (after every case too, so a run stopped by its time limit keeps what
        it measured)."""
        floored, floor_rows = floors_at_least_reached(rows, ceilings)
        written = write_results(stem, floor_rows, make_targets(floor_rows, target, smoke=args.smoke), args.out,
                                **cases, dtype="bfloat16", seconds=time.time() - started, complete=complete,
                                ceilings={"matmul_tflops": ceilings.matmul_flops / 1e12,
                                          "floor_matmul_tflops": floored.matmul_flops / 1e12,
                                          "bandwidth_gbs": ceilings.bandwidth / 1e9,
                                          "floor_bandwidth_gbs": floored.bandwidth / 1e9, "empty_kernel_ms": empty_ms},
                                decode_floor_check=decode_floor_check(floor_rows, empty_ms),
                                pick_check=pick_check(floor_rows),
                                pick_slack=PICK_SLACK,
                                pick_timings=pick_timings | autotune.PICK_TIMINGS,
                                tile_picks=merged_tile_picks(tile_picks, autotune.tile_picks()), gpu_states=gpu_states,
                                case_seconds=case_seconds)
        points = [{"label": r["impl"], "flops": r["flops"], "bytes": r["ideal_bytes"], "ms": r["ms"]}
                  for r in rows if r["impl"] in ("dense_eager", "lowrank_ours", "monarch_ours", "blast_ours")]
        plot_roofline(points, floored.matmul_flops, floored.bandwidth, written.with_name(f"{stem}_roofline.png"),
                      title=f"BLR layers, bf16, b={blocks}, N in {tokens}")
        return written

    with Progress() as progress:
        task = progress.add_task("blr layers", total=len(shapes) * len(tokens))
        for name, d_in, d_out, rank in shapes:
            for n in tokens:
                if (name, n) not in done:
                    case_rows, gpu, seconds = bench_case(torch, name, d_in, d_out, rank, blocks, n, dtype, device,
                                                         ceilings, timer, layer_cost, args.kinds)
                    rows += case_rows
                    gpu_states.append({"shape": name, "n": n, **gpu})
                    case_seconds.append({"shape": name, "n": n, **seconds})
                    save(complete=False)
                    progress.console.print(f"{name} N={n}: {seconds['prepare_s']:.0f} s to build, check, tune and "
                                           f"pick, {seconds['rounds_s']:.0f} s to time")
                progress.advance(task)
    elapsed = time.time() - started
    path = save(complete=True)
    _, floor_rows = floors_at_least_reached(rows, ceilings)
    show(Console(), Table, floor_rows, make_targets(floor_rows, target, smoke=args.smoke))
    print(f"wrote {path} in {elapsed:.0f} s")
    return 0


def own_pick_cache(results: Path, resume: bool) -> Path | None:
    """Point the variant pick's cache at a file beside the results (``<stem>_picks.json``), so the table's variant
    picks are its own: run after another benchmark on the same machine, it took the picks that one had cached (at
    1deb9e7 a BLAST pick made during blr_e2e's warm-up read 16.3% slower than the fastest pipeline). The kernels'
    tile configs stay in Triton's own cache, shared. A fresh run starts the file afresh, ``--resume`` keeps it; what
    this process held of the picks is dropped; where MEMFIT_AUTOTUNE_CACHE is set, that cache is used and None
    returned."""
    from memfit.kernels import autotune

    if os.environ.get("MEMFIT_AUTOTUNE_CACHE"):
        return None
    picks = results.with_name(f"{results.stem}_picks.json")
    if not resume:
        picks.unlink(missing_ok=True)
    os.environ["MEMFIT_AUTOTUNE_CACHE"] = str(picks)
    autotune.forget_picks()                       # the next pick reads the new path
    return picks


def summarize(runs: dict) -> str:
    """Per results file (path -> its JSON): the spread of each row's timing rounds (largest over smallest, less
    one; its median and 90th percentile, over all rows and from N = 1024, and the largest at N = 8192), where the
    file keeps rounds, and the cases where the pick trails its fastest pipeline (``pick_check``, recomputed for
    files written before it was recorded), how the pick's own timings of its finalists (``pick_timings``)
    compare with the table's time of the same pipelines, the GPU's SM clock read after timing rounds
    (``gpu_states``) and where the run's time went (``case_seconds``); then, across the files, the pipelines never
    close to their case's fastest (:func:`never_close`) and the largest ratio of one case's dense eager time in
    two of them at N = 8192."""
    def spread(rows):
        values = sorted(max(r["ms_rounds"]) / min(r["ms_rounds"]) - 1 for r in rows
                        if r.get("ms_rounds") and not any(map(math.isnan, r["ms_rounds"])))
        return values and (statistics.median(values), percentile(values, 0.9), values[-1])

    lines = []
    for path, data in runs.items():
        rows = data["rows"]
        lines.append(f"{path} (commit {data.get('commit')}, {len(rows)} rows, complete: {data.get('complete')})")
        for label, subset in (("all N", rows), ("N >= 1024", [r for r in rows if r["n"] >= 1024]),
                              ("N = 8192", [r for r in rows if r["n"] == 8192])):
            if figures := spread(subset):
                lines.append(f"  rounds' spread, {label}: median {figures[0]:.1%}, 90th percentile {figures[1]:.1%}, "
                             f"largest {figures[2]:.1%}")
        misses = pick_check(rows)
        lines.append(f"  pick over {PICK_SLACK - 1:.0%} slower than its fastest pipeline at {len(misses)} cases"
                     + "".join(f"\n    {m['structure']} {m['shape']} N={m['n']}: {m['ratio'] - 1:.1%} ({m['fastest']})"
                               for m in misses))
        ratios = pick_over_table(data)
        for label, subset in (("N <= 128", [r for n, r in ratios if n <= 128]), ("N >= 1024", [r for n, r in ratios
                                                                                            if n >= 1024])):
            if subset := sorted(subset):
                lines.append(f"  the pick's finalists over the table's time of the same pipeline, {label}, {len(subset)} "
                             f"timings: median {statistics.median(subset):.3f}, 10th-90th percentile "
                             f"{percentile(subset, 0.1):.3f}-{percentile(subset, 0.9):.3f}, "
                             f"from {subset[0]:.3f} to {subset[-1]:.3f}")
        lines += clock_lines(data.get("gpu_states", []))
        if spent := data.get("case_seconds"):
            slowest = max(spent, key=lambda c: c["prepare_s"] + c["rounds_s"])
            lines.append(f"  {len(spent)} cases took {sum(c['prepare_s'] for c in spent):.0f} s to build, check, tune "
                         f"and pick and {sum(c['rounds_s'] for c in spent):.0f} s to time; the slowest, "
                         f"{slowest['shape']} N={slowest['n']}, {slowest['prepare_s']:.0f} s and "
                         f"{slowest['rounds_s']:.0f} s")
    if never := never_close(runs):
        lines.append(f"never fastest nor within {NEVER_CLOSE - 1:.0%} of it in these {len(runs)} files: "
                     + ", ".join(f"{impl} ({rows} rows)" for impl, rows in never))
    dense = {path: {r["shape"]: r["ms"] for r in data["rows"] if r["impl"] == "dense_eager" and r["n"] == 8192}
             for path, data in runs.items()}
    pairs = [(max(a[s], b[s]) / min(a[s], b[s]) - 1, s, pa, pb) for (pa, a), (pb, b) in
             itertools.combinations(dense.items(), 2) for s in a.keys() & b.keys()]
    if pairs:
        gap, shape, first, second = max(pairs)
        lines.append(f"dense eager at N = 8192 read up to {gap:.1%} apart between two files ({shape}: {first}, "
                     f"{second})")
    return "\n".join(lines)


def percentile(ordered: list[float], q: float) -> float:
    """The value at fraction ``q`` of ``ordered`` (sorted ascending), by rank, without interpolation."""
    return ordered[int(q * len(ordered))]


def clock_lines(states: list[dict]) -> list[str]:
    """The SM clock nvidia-smi read after a case's timing rounds (``between_rounds``, where recorded, and
    ``after``), its range at N <= 128 and at N >= 1024, and its largest change within one case's rounds."""
    def clocks(state):
        readings = [*state.get("between_rounds", []), state.get("after")]
        return [r["sm_clock_mhz"] for r in readings if r and r.get("sm_clock_mhz") is not None]

    lines = []
    for label, subset in (("N <= 128", [g for g in states if g["n"] <= 128]),
                          ("N >= 1024", [g for g in states if g["n"] >= 1024])):
        if readings := [mhz for g in subset for mhz in clocks(g)]:
            lines.append(f"  SM clock after timing rounds, {label}: {min(readings):.0f}-{max(readings):.0f} MHz "
                         f"({len(readings)} readings)")
    if changes := [max(c) - min(c) for g in states if len(c := clocks(g)) > 1]:
        lines.append(f"  largest SM clock change within one case's rounds: {max(changes):.0f} MHz")
    return lines


def pick_case(record: str) -> tuple[str, int, int, int, int] | None:
    """(structure, N, in, out, rank) of a ``pick_timings`` record ("op shape_key", as each op keys its pick), or
    None for Monarch's permuted layout, which the table times only as the pick."""
    op, key = record.split(" ", 1)
    key = ast.literal_eval(key)
    if op == "monarch_linear":                       # (N, b, in / b, rank, out / b, permute_output, dtype)
        return None if key[5] else ("monarch", key[0], key[1] * key[2], key[1] * key[4], key[3])
    if op == "blast_linear":                         # (N, b, out / b, rank, in / b, dtype)
        return "blast", key[0], key[1] * key[4], key[1] * key[2], key[3]
    if op == "lowrank_linear":                       # (N, out, rank, in, dtype)
        return "lowrank", key[0], key[3], key[1], key[2]
    return None


def pick_over_table(data: dict) -> list[tuple[int, float]]:
    """(N, ratio) for every finalist the pick timed again (``pick_timings``): its median there over the table's time
    of the same pipeline in the same case, how far the pick's view of a pipeline stands from the table's."""
    if not data.get("pick_timings"):
        return []
    table = {(r["structure"], r["n"], r["in"], r["out"], r["rank"], r["impl"]): r["ms"] for r in data["rows"]}
    ratios = []
    for record, timing in data["pick_timings"].items():
        case = pick_case(record)
        for name, ms in timing.get("finalists", {}).items() if case else ():
            ms_table = table.get((*case, f"{case[0]}_{name}"), math.nan)
            if ms_table > 0:
                ratios.append((case[1], ms / ms_table))
    return ratios


def floors_at_least_reached(rows, ceilings):
    """The ceilings raised to the best rates any row reached (its FLOPs, its ideal bytes, over its time), and the rows
    with their floors and ratios against them. One timing of an 8192^3 GEMM is no ceiling: dense cuBLAS ran faster
    (769 TFLOP/s against 736.6 at Llama-7B down, N=1024, in blr_layers.json: a floor above its time), and a floor
    must be what no kernel beats; so for the copy's bandwidth. Where no row beat either, nothing changes."""
    from memfit.measure.timing import Ceilings

    timed = [r for r in rows if "flops" in r and math.isfinite(r.get("ms", math.nan)) and r["ms"] > 0]
    raised = Ceilings(matmul_flops=max([ceilings.matmul_flops, *(r["flops"] / (r["ms"] * 1e-3) for r in timed)]),
                      bandwidth=max([ceilings.bandwidth, *(r["ideal_bytes"] / (r["ms"] * 1e-3) for r in timed)]))
    if raised == ceilings:
        return ceilings, rows
    floors = [raised.floor_ms(r["flops"], r["ideal_bytes"]) if "flops" in r else None for r in rows]
    return raised, [r if floor is None else {**r, "floor_ms": floor, "x_floor": r["ms"] / floor}
                    for r, floor in zip(rows, floors)]


def run_state(path) -> str:
    """What the results file at ``path`` holds: "missing", "unreadable", "complete" or "stopped" (a run cut short)."""
    if not path.exists():
        return "missing"
    try:
        complete = json.loads(path.read_text()).get("complete", True)
    except (OSError, ValueError, AttributeError):
        return "unreadable"
    return "complete" if complete else "stopped"


def decode_floor_check(rows, empty_ms: float) -> list[dict]:
    """Per decode-sized case (N <= 16): the floor, 2x the floor (the target) and one empty kernel's
    time. Where the empty kernel alone exceeds 2x the floor, no kernel can meet that target."""
    out = []
    for r in rows:
        if r["n"] <= 16 and r["impl"] in ("monarch_ours", "blast_ours"):
            out.append({"shape": r["shape"], "n": r["n"], "structure": r["structure"], "floor_ms": r["floor_ms"],
                        "target_ms": 2 * r["floor_ms"], "empty_kernel_ms": empty_ms, "ours_ms": r["ms"],
                        "reachable": empty_ms <= 2 * r["floor_ms"]})
    return out


PICK_SLACK = 1.02        # the pick reading over this factor of its fastest pipeline's time goes into pick_check


def pick_check(rows) -> list[dict]:
    """Per case and structure where the pick (``<kind>_ours``, what a user gets) read over PICK_SLACK times the
    fastest of the pipelines the op offers (:func:`case_pipelines`: on Hopper also those the pick leaves out, so one
    that became the fastest would show here), each timed in its own row of the same rounds: the pick's time, that
    pipeline and its time. Noise puts some cases here (the pick is one of the pipelines); a case listed run after
    run is a ranking that the pick's own timing gets wrong. What the pick measured for each candidate, or that it
    came from the cache, is in the results' ``pick_timings`` (autotune.PICK_TIMINGS, keyed by op and the op's
    shape key: a pick is timed at the first N called in its ``pick_bucket``)."""
    out = []
    pipelines = case_pipelines(rows)
    for r in rows:
        kind = r["structure"]
        if r["impl"] != f"{kind}_ours" or math.isnan(r["ms"]):
            continue
        fastest = min(pipelines.get((r["shape"], r["n"], kind), []), key=lambda q: q["ms"], default=None)
        if fastest and r["ms"] > PICK_SLACK * fastest["ms"]:
            out.append({"shape": r["shape"], "n": r["n"], "structure": kind, "ours_ms": r["ms"],
                        "fastest": fastest["impl"], "fastest_ms": fastest["ms"], "ratio": r["ms"] / fastest["ms"]})
    return out


def case_pipelines(rows) -> dict:
    """(shape, n, structure) -> the rows of the pipelines the op offered (each variant timed on its own, the ones
    the pick leaves out on Hopper included; not the pick, the reference or the permuted layout), those that ran."""
    out = {}
    for q in rows:
        kind = q["structure"]
        if kind != "dense" and q["impl"] not in (f"{kind}_ours", f"{kind}_reference", "monarch_permuted") \
                and not math.isnan(q["ms"]):
            out.setdefault((q["shape"], q["n"], kind), []).append(q)
    return out


NEVER_CLOSE = 1.05       # a pipeline never within this factor of its case's fastest, in every file, is listed


def never_close(runs: dict) -> list[tuple[str, int]]:
    """The pipelines that no case of any file in ``runs`` (path -> its JSON) had as its fastest or within
    NEVER_CLOSE of it, each with the number of rows that timed it over the files (a case in two files counts
    twice): the evidence an op's UNPICKED_WITH_PDL (the pipelines its pick does not time on Hopper) rests on."""
    offered, close = {}, set()
    for data in runs.values():
        for pipelines in case_pipelines(data["rows"]).values():
            fastest = min(q["ms"] for q in pipelines)
            for q in pipelines:
                offered[q["impl"]] = offered.get(q["impl"], 0) + 1
                if q["ms"] <= NEVER_CLOSE * fastest:
                    close.add(q["impl"])
    return sorted((impl, cases) for impl, cases in offered.items() if impl not in close)


PROFILE_CASES = [("llama-3.2-1b gate", 1), ("llama-7b down", 16), ("llama-3.2-1b gate", 1024),
                 ("llama-3.2-1b down", 1024), ("llama-3.2-1b gate", 8192), ("llama-3.2-1b down", 8192),
                 ("llama-7b gate/up", 8192), ("llama-7b down", 1024),
                 ("llama-3.2-1b up", 128)]   # Monarch's and BLAST's slowest against dense at N = 128 (18d9a39)
SMOKE_PROFILE_CASES = [("smoke 48->80", 40)]


def profile_cases(torch, cases, blocks, dtype, device, kinds, save=None) -> list[dict]:
    """One row per (case, structure of ``kinds``, pipeline): the pipeline's kernels with their GPU ms, so a
    pipeline's time splits into its stages (which stage misses its floor). ``save(rows)``, if given, is
    called after each case, so a run stopped by a time limit keeps the cases it profiled."""
    from memfit.measure.kernel_profile import kernel_profile

    shapes = {name: (d_in, d_out, rank) for name, d_in, d_out, rank in (SHAPES + SMOKE_SHAPES)}
    rows = []
    for name, n in cases:
        d_in, d_out, rank = shapes[name]
        for kind, (make, call, variants) in structures(d_in, d_out, rank, blocks, n, dtype, device, kinds).items():
            layer, x = make(), torch.randn(n, d_in, device=device, dtype=dtype)
            for variant in variants:
                step = functools.partial(call, layer, x, path="triton", variant=variant)
                with torch.no_grad():
                    step()                                                    # compile and tune outside the profile
                    kernels, _, idle = kernel_profile(step, device, name_chars=80)
                rows.append({"shape": name, "n": n, "structure": kind, "variant": variant, "kernels": kernels,
                             "span_ms": idle["span_ms"], "idle_ms": idle["idle_ms"]})
        if save:
            save(rows)
    return rows


def gpu_ms(fn, rep: float = 10) -> float:
    """Median ms of one ``fn()`` from CUDA-graph replays (no Python launch overhead), ``rep`` ms of them per replay
    (memfit.measure.timing.graph_ms: do_bench_cudagraph's method on one stream)."""
    from memfit.measure.timing import graph_ms

    return graph_ms(fn, rep)


def cpu_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def copies_for(bytes_per_call: int, device: str) -> int:
    """Copies of inputs and weights to rotate through so nothing is served from L2, by the variant pick's rule
    (one on the CPU smoke run)."""
    from memfit.kernels.autotune import rotation_copies

    return rotation_copies(bytes_per_call) if device == "cuda" else 1


def merged_tile_picks(earlier: dict, now: dict) -> dict:
    """A resumed run's tile picks (kernel -> {autotuning key: config}) with this process's added."""
    return {kernel: earlier.get(kernel, {}) | now.get(kernel, {}) for kernel in earlier.keys() | now.keys()}


def bench_case(torch, name, d_in, d_out, rank, blocks, n, dtype, device, ceilings, timer, layer_cost, kinds):
    """(one row per implementation of one (shape, N) case, dense and the structures of ``kinds``; the GPU's state
    just before their timing rounds, between them and after them; the seconds spent preparing them (build, check,
    which also tunes and picks) and timing them).
    All are built, run and checked first (which also tunes their kernels and picks their variants), then timed
    together in rounds (:func:`time_rounds`), so dense and each structure's pipelines are timed side by side, not
    minutes apart with tuning in between."""
    import torch.nn.functional as F

    from memfit.kernels.monarch import monarch_linear
    from memfit.measure.timing import gpu_state

    groups = []                                           # (kind, impls, copies, flops, ideal bytes, layouts)
    started = time.perf_counter()
    with torch.no_grad():
        dense_flops, dense_bytes = layer_cost("dense", "ideal", n, d_in, d_out)
        k = copies_for(dense_bytes, device)
        xs = [torch.randn(n, d_in, device=device, dtype=dtype) for _ in range(k)]
        weights = [torch.randn(d_out, d_in, device=device, dtype=dtype) / d_in**0.5 for _ in range(k)]
        compiled = torch.compile(F.linear, dynamic=True)
        groups.append(("dense", {"dense_eager": lambda i: F.linear(xs[i], weights[i]),
                                 "dense_compiled": lambda i: compiled(xs[i], weights[i])},
                       k, dense_flops, dense_bytes, {}))
        for kind, (make, call, variants) in structures(d_in, d_out, rank, blocks, n, dtype, device, kinds).items():
            flops, ideal = layer_cost(kind, "ideal", n, d_in, d_out, rank, blocks)
            k = copies_for(ideal, device)
            groups.append((kind, structure_impls(torch, kind, make, call, variants, k, n, d_in, dtype, device,
                                                 monarch_linear), k, flops, ideal, as_block_major(n, d_out, blocks)))
        checks = {impl: result for _, impls, _, _, _, layouts in groups
                  for impl, result in check_impls(impls, layouts).items()}
        prepared = time.perf_counter()
        before, between = gpu_state(), []
        rounds, failures = time_rounds({impl: (fn, copies) for _, impls, copies, *_ in groups
                                        for impl, fn in impls.items()
                                        if checks[impl][1] is None or checks[impl][1].startswith("wrong")}, timer,
                                       lambda: between.append(gpu_state()))
        after = gpu_state()
    seconds = {"prepare_s": prepared - started, "rounds_s": time.perf_counter() - prepared}
    rows = []
    for kind, impls, copies, flops, ideal, _ in groups:
        floor = ceilings.floor_ms(flops, ideal)
        for impl in impls:
            rel_err, checked = checks[impl]
            times = rounds.get(impl, [])
            ms, error = row_time(checked, times, failures.get(impl))
            row = {"shape": name, "in": d_in, "out": d_out, "rank": rank, "blocks": blocks, "n": n, "structure": kind,
                   "impl": impl, "ms": ms, "ms_rounds": times, "flops": flops, "ideal_bytes": ideal, "floor_ms": floor,
                   "x_floor": ms / floor, "copies": copies, "rel_err": rel_err}
            if kind != "dense":
                row["unfused_bytes"] = layer_cost(kind, "unfused", n, d_in, d_out, rank, blocks)[1]
            if kind == "monarch" and impl != "monarch_reference":
                row["layout"] = "permuted" if impl == "monarch_permuted" else "block-major"
            if error:
                row["error"] = error
            rows.append(row)
    return rows, {"before": before, "between_rounds": between, "after": after}, seconds


def check_impls(impls: dict, layouts: dict) -> dict:
    """impl -> (relative error to the group's first impl, None or why it is not timed as correct), each run once on
    copy 0 (which also tunes its kernels and picks its variant outside the timing). The first impl (dense eager, or a
    structure's reference) is the one the others are checked against; a relative error past MAX_REL_ERR, or NaN (a
    NaN or inf in the output), is "wrong". Where the first impl fails, the others are timed unchecked (NaN error)."""
    checker = next(iter(impls))
    results, expected = {}, None
    for impl, fn in impls.items():
        try:
            out = layouts.get(impl, lambda y: y)(fn(0)).float()
        except Exception as err:  # noqa: BLE001 (a competitor that cannot run here is recorded, not fatal)
            results[impl] = (math.nan, f"{type(err).__name__}: {err}"[:300])
            continue
        expected = out if impl == checker else expected
        if expected is None:
            results[impl] = (math.nan, None)
            continue
        rel_err = ((out - expected).norm() / expected.norm()).item()
        results[impl] = (rel_err, None if rel_err <= MAX_REL_ERR
                         else f"wrong result: relative error {rel_err:.3g} to {checker}")
    return results


def time_rounds(calls: dict, timer, between_rounds=None) -> tuple[dict, dict]:
    """(name -> ms of one call per round, name -> why its first failed timing failed): TIMING_ROUNDS rounds over
    every (fn, copies) of ``calls``, forward and reverse by turns (``turn_orders``), each timing ``timer`` of the calls over
    all copies (divided by them). A drift of the GPU's speed across the case then reaches every implementation
    alike. A timing that fails is NaN in its round. ``between_rounds()``, if given, is called after every round
    but the last (to read the GPU's clock there)."""
    from memfit.measure.timing import turn_orders

    times, failures = {name: [] for name in calls}, {}
    for turn, order in enumerate(turn_orders(list(calls), TIMING_ROUNDS)):
        if turn and between_rounds:
            between_rounds()
        for name in order:
            fn, copies = calls[name]
            try:
                times[name].append(timer(lambda fn=fn, copies=copies: [fn(i) for i in range(copies)]) / copies)
            except Exception as err:  # noqa: BLE001 (e.g. a capture this pipeline does not survive: its row says so)
                times[name].append(math.nan)
                failures.setdefault(name, f"{type(err).__name__}: {err}"[:300])
    return times, failures


def row_time(checked: str | None, times: list[float], failure: str | None) -> tuple[float, str | None]:
    """A row's ms, the median of its rounds, and its error: NaN for a pipeline that failed its check (a wrong one's
    time goes into the message: it counts for nothing), failed to run, or failed a timing in any round."""
    ms = statistics.median(times) if times and not any(map(math.isnan, times)) else math.nan
    if checked and checked.startswith("wrong"):
        return math.nan, checked + ("" if math.isnan(ms) else f" (ran in {ms:.4f} ms)")
    if checked:
        return math.nan, checked
    if math.isnan(ms):
        return math.nan, f"timing failed: {failure}"
    return ms, None


def structures(d_in, d_out, rank, blocks, n, dtype, device, kinds) -> dict:
    """kind -> (make a layer, call(layer, x, **op options), the op's pipelines at this N), for the structures
    named in ``kinds``."""
    from memfit.kernels.blast import blast_linear
    from memfit.kernels.blast import variants_for as blast_variants
    from memfit.kernels.lowrank import lowrank_linear
    from memfit.kernels.lowrank import variants_for as lowrank_variants
    from memfit.kernels.monarch import monarch_linear
    from memfit.kernels.monarch import variants_for as monarch_variants
    from memfit.layers import BlastLinear, LowRankLinear, MonarchLinear

    m, t = d_in // blocks, rank // blocks
    every = {
        "lowrank": (lambda: LowRankLinear(d_in, d_out, rank, device=device, dtype=dtype),
                    lambda l, x, **o: lowrank_linear(x, l.U, l.V, **o), lowrank_variants(n)),
        "monarch": (lambda: MonarchLinear(d_in, d_out, rank, blocks, device=device, dtype=dtype),
                    lambda l, x, **o: monarch_linear(x, l.w1, l.w2, None, l.permute_output, **o),
                    monarch_variants(n, blocks, m, t, d_out // blocks, permute_output=False)),
        "blast": (lambda: BlastLinear(d_in, d_out, rank, blocks, device=device, dtype=dtype),
                  lambda l, x, **o: blast_linear(x, l.U, l.V, l.S, **o), blast_variants(n)),
    }
    return {kind: every[kind] for kind in kinds}


def structure_impls(torch, kind, make, call, variants, copies, n, d_in, dtype, device, monarch_linear):
    """name -> fn(copy index) for one structure: reference, each variant, ours (and Monarch's permuted layout)."""
    layers = [make() for _ in range(copies)]
    xs = [torch.randn(n, d_in, device=device, dtype=dtype) for _ in range(copies)]
    impls = {f"{kind}_reference": lambda i: call(layers[i], xs[i], path="reference")}
    for variant in variants:
        impls[f"{kind}_{variant}"] = lambda i, v=variant: call(layers[i], xs[i], path="triton", variant=v)
    impls[f"{kind}_ours"] = lambda i: layers[i](xs[i])
    if kind == "monarch":
        impls["monarch_permuted"] = lambda i: monarch_linear(xs[i], layers[i].w1, layers[i].w2, None, True)
    return impls


def as_block_major(n, d_out, blocks) -> dict:
    """impl -> fn(output) giving the block-major layout every other row of its structure writes (for the check)."""
    return {"monarch_permuted": lambda y: y.view(n, d_out // blocks, blocks).transpose(1, 2).reshape(n, d_out)}


def make_targets(rows, target, smoke: bool):
    """Targets of issue 3, computed from the rows (worst shape per structure and N)."""
    def ms(shape, n, impl):
        return next((r["ms"] for r in rows if r["shape"] == shape and r["n"] == n and r["impl"] == impl), math.nan)

    targets = []
    shapes = sorted({r["shape"] for r in rows})
    for kind in ("monarch", "blast"):
        for n in sorted({r["n"] for r in rows}):
            ours = [r for r in rows if r["impl"] == f"{kind}_ours" and r["n"] == n]
            if not ours:                                     # a --structures run without this one
                continue
            worst = max(math.inf if math.isnan(r["x_floor"]) else r["x_floor"] for r in ours)  # failed: unmet
            if n >= 1024 or smoke and n > 16:
                targets.append(target(f"{kind} ours / floor, N={n}, worst shape", worst, 1.5, "x", "lower"))
            if n <= 16:
                targets.append(target(f"{kind} ours / floor, N={n}, worst shape", worst, 2.0, "x", "lower"))
            if n >= 16:
                speedups = [ms(s, n, "dense_eager") / ms(s, n, f"{kind}_ours") for s in shapes]
                slowest = min(0.0 if math.isnan(x) else x for x in speedups)  # failed: the worst (min's NaN is by order)
                targets.append(target(f"{kind} speedup over dense cuBLAS, N={n}, worst shape", slowest, 1.0, "x",
                                      "higher"))
        gate = ms("llama-3.2-1b gate", 8192, f"{kind}_ours")
        if not math.isnan(gate):
            targets.append(target(f"{kind} llama-3.2-1b gate N=8192 vs 1/3 of the paper's kernel",
                                  gate, PAPER_MS_N8192_GATE[kind] / 3, "ms", "lower"))
    return targets


def cell(rows_by_impl: dict, impl: str, key: str, spec: str) -> str:
    """One figure of the console table, or "-" for a structure the run did not time (--structures)."""
    return format(rows_by_impl[impl][key], spec) if impl in rows_by_impl else "-"


def show(console, Table, rows, targets):
    table = Table(title="BLR layers (ms; x floor)")
    for col in ("shape", "N", "dense", "lowrank", "monarch", "blast", "monarch x floor", "blast x floor"):
        table.add_column(col)
    cases = sorted({(r["shape"], r["n"]) for r in rows}, key=lambda c: (c[0], c[1]))
    for shape, n in cases:
        get = {r["impl"]: r for r in rows if r["shape"] == shape and r["n"] == n}
        table.add_row(shape, str(n), cell(get, "dense_eager", "ms", ".4f"),
                      *(cell(get, f"{k}_ours", "ms", ".4f") for k in STRUCTURES),
                      *(cell(get, f"{k}_ours", "x_floor", ".2f") for k in ("monarch", "blast")))
    console.print(table)
    for t in targets:
        console.print(f"{'met ' if t['met'] else 'MISS'} {t['name']}: {t['measured']:.3f} (target {t['target']:.3f} {t['unit']})")


if __name__ == "__main__":
    sys.exit(main())
