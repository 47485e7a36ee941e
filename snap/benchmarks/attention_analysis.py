"""Read the attention results and print the study's tables (markdown).

    python benchmarks/attention_analysis.py [--results benchmarks/results]

Inputs: attention.json and attention_study.json (benchmarks/attention.py) and, when
present, attention_counters.csv (Nsight Compute over benchmarks/attention_counters.py).
The numbers in benchmarks/attention_study.md are pasted from this output, never typed.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

from memfit.kernels.attention import VARIANTS

RESULTS = Path(__file__).resolve().parent / "results"

# The profiled run (benchmarks/attention_counters.py): its shape and its order of variants.
COUNTER_SHAPE = {"batch": 4, "heads": 32, "seq": 4096, "head_dim": 128, "causal": False}
COUNTER_ORDER = tuple(f"fused[{v}]" for v in VARIANTS) + ("separate[two_pass]",)
# memfit's own launches per variant, in launch order (memfit/kernels/attention.py).
MEMFIT_LAUNCHES = {**{f"fused[{v}]": ("_query_bwd_kernel",) for v in VARIANTS},
                   "fused[two_pass]": ("_query_bwd_kernel", "_key_bwd_kernel"),
                   "separate[two_pass]": ("_fwd_kernel", "_delta_kernel", "_key_bwd_kernel", "_query_bwd_kernel")}
METRICS = {"ms": ("gpu__time_duration.sum", 1e-6), "dram": ("dram__bytes.sum", 1.0),
           "red": ("lts__t_sectors_op_red.sum", 1.0), "atom": ("lts__t_sectors_op_atom.sum", 1.0),
           "l2": ("lts__t_sectors.sum", 1.0),
           "tensor": ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", 1.0)}
SECTOR = 32  # bytes per L2 sector


def _fmt(x, spec=".0f"):
    return "n/a" if x is None else format(x, spec)


def comparison_table(rows) -> str:
    impls = sorted({r["impl"] for r in rows})
    lines = ["| seq x batch | causal | " + " | ".join(impls) + " |", "|---|---|" + "---|" * len(impls)]
    for seq, causal in sorted({(r["seq"], r["causal"]) for r in rows}):
        cells = []
        for impl in impls:
            r = next(r for r in rows if r["impl"] == impl and r["seq"] == seq and r["causal"] == causal)
            cells.append(f"{_fmt(r.get('fwd_tflops'))} / {_fmt(r.get('fwd_bwd_tflops'))}" if "error" not in r
                         else "n/a")
        batch = next(r["batch"] for r in rows if r["seq"] == seq)
        lines.append(f"| {seq} x {batch} | {causal} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(rows) -> str:
    lines = ["| impl | seq | causal | held for backward beyond O (MiB) | peak beyond inputs (MiB) |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" not in r:
            lines.append(f"| {r['impl']} | {r['seq']} | {r['causal']} | {r['saved_extra_bytes'] / 2**20:.1f} | "
                         f"{r['peak_extra_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def study_table(rows) -> str:
    lines = ["| seq | causal | variant | ms | TFLOP/s | x naive fused | floor/ms | GB/s (least+accum.) | accum. GB | "
             "slots |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["causal"], r["seq"], r["variant"])):
        if "ms" not in r:
            lines.append(f"| {r['seq']} | {r['causal']} | {r['variant']} | {r.get('error', '')} ||||||| ")
            continue
        lines.append(f"| {r['seq']} | {r['causal']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                     f"{r.get('speedup_vs_naive_fused', float('nan')):.2f} | {r['floor_fraction']:.2f} | "
                     f"{r['achieved_gbps']:.0f} | {r['accumulation_bytes'] / 1e9:.2f} | {r.get('partial_slots') or '-'} |")
    return "\n".join(lines)


def findings(study) -> str:
    """The two questions of the original study, answered from the measurements."""
    out = []
    for seq, causal in sorted({(r["seq"], r["causal"]) for r in study}):
        sel = {r["variant"]: r for r in study if r["seq"] == seq and r["causal"] == causal and "ms" in r}
        if "fused[atomic]" not in sel:
            continue
        naive = sel["fused[atomic]"]["ms"]
        best_fix = max((naive / sel[v]["ms"], v) for v in ("fused[atomic_remap]", "fused[partial_buffers]") if v in sel)
        sep = min((sel[v]["ms"], v) for v in sel if v.startswith("separate"))
        fused_best = min((sel[v]["ms"], v) for v in sel if v.startswith("fused"))
        out.append(f"- N={seq}{' causal' if causal else ''}: best contention fix {best_fix[1]} = {best_fix[0]:.2f}x "
                   f"naive fused; fastest fused {fused_best[1]} {fused_best[0]:.3f} ms vs fastest separate "
                   f"{sep[1]} {sep[0]:.3f} ms ({'fused wins' if fused_best[0] < sep[0] else 'separate wins'})")
    return "\n".join(out)


def read_launches(path: Path) -> list[dict]:
    """Kernel launches of an ``ncu --csv`` file in launch order: name, grid and METRICS values.

    ncu writes its own messages into the same stream; data lines are the ones that start
    with a double quote (the first of them is the header).
    """
    lines = [line for line in path.read_text().splitlines() if line.startswith('"')]
    launches: dict[str, dict] = {}
    for rec in csv.DictReader(lines):
        launch = launches.setdefault(rec["ID"], {"name": rec["Kernel Name"], "grid": rec["Grid Size"]})
        for key, (metric, scale) in METRICS.items():
            if rec["Metric Name"] == metric:
                launch[key] = float(rec["Metric Value"].replace(",", "")) * scale
    return [launches[i] for i in sorted(launches, key=int)]


def _is_memfit(launch) -> bool:
    return re.fullmatch(r"_\w+_kernel", launch["name"]) is not None


def _is_setup(launch) -> bool:
    """A fill (torch.zeros / empty accumulators, placeholder pointers) runs before the kernel it feeds."""
    return "FillFunctor" in launch["name"]


def group_by_variant(launches: list[dict]) -> dict[str, list[dict]]:
    """Assign every launch to a variant of COUNTER_ORDER.

    memfit's kernels are matched in order against MEMFIT_LAUNCHES; a torch kernel between
    them belongs to the next memfit kernel when it is a fill (setup) and to the previous
    one otherwise (casts and partial-buffer sums finish a variant). A launch sequence that
    does not match the expected one is an error, not a guess.
    """
    owner = [v for v in COUNTER_ORDER for _ in MEMFIT_LAUNCHES[v]]
    expected = [k for v in COUNTER_ORDER for k in MEMFIT_LAUNCHES[v]]
    found = [launch["name"] for launch in launches if _is_memfit(launch)]
    if found != expected:
        raise SystemExit(f"attention_counters.csv: memfit launches {found} do not match the expected {expected}")
    groups: dict[str, list[dict]] = {v: [] for v in COUNTER_ORDER}
    index = -1  # memfit kernels seen so far - 1
    pending: list[dict] = []
    for launch in launches:
        if _is_memfit(launch):
            index += 1
            groups[owner[index]] += pending + [launch]
            pending = []
        elif _is_setup(launch) or index < 0:
            pending.append(launch)
        else:
            groups[owner[index]].append(launch)
    if pending:
        groups[owner[-1]] += pending
    return groups


def _torch_kind(launch) -> str:
    name = launch["name"]
    return next((kind for kind, tag in (("fill", "FillFunctor"), ("cast", "copy_kernel"), ("sum", "reduce_kernel"))
                 if tag in name), name.split("<")[0])


def _counter_cells(launches: list[dict], flops: float | None, bandwidth: float) -> str:
    ms = sum(x["ms"] for x in launches)
    dram = sum(x["dram"] for x in launches)
    red = sum(x["red"] for x in launches)
    tensor = sum(x["tensor"] * x["ms"] for x in launches) / ms  # time-weighted
    tflops = f"{flops / ms / 1e9:.0f}" if flops else "n/a"
    return (f"{ms:.3f} | {tflops} | {dram / 1e9:.2f} | {dram / ms / 1e6:.0f} ({dram / ms / 1e6 / bandwidth:.0%}) | "
            f"{red / 1e6:.0f} | {red * SECTOR / 1e9:.2f} | {sum(x['atom'] for x in launches) / 1e6:.0f} | "
            f"{sum(x['l2'] for x in launches) / 1e6:.0f} | {tensor:.1f}")


def counters_table(groups: dict[str, list[dict]], study_rows, bandwidth: float) -> str:
    """Per variant: each memfit kernel, the torch kernels around it (summed), and the total."""
    lines = ["| variant | kernel (grid) | ms | TFLOP/s | DRAM GB | DRAM GB/s (of measured) | L2 red sectors (M) | "
             "L2 red GB | L2 atom sectors (M) | L2 sectors (M) | tensor pipe % |", "|---" * 11 + "|"]
    for variant, launches in groups.items():
        row = next((r for r in study_rows if r["variant"] == variant and "ms" in r
                    and all(r[k] == v for k, v in COUNTER_SHAPE.items())), None)
        flops = row["tflops"] * row["ms"] * 1e9 if row else None
        for launch in launches:
            if _is_memfit(launch):
                lines.append(f"| {variant} | {launch['name']} {launch['grid']} | {_counter_cells([launch], None, bandwidth)} |")
        torch_launches = [x for x in launches if not _is_memfit(x)]
        kinds = sorted({_torch_kind(x) for x in torch_launches})
        lines.append(f"| {variant} | torch: {len(torch_launches)} launches ({', '.join(kinds)}) | "
                     f"{_counter_cells(torch_launches, None, bandwidth)} |")
        lines.append(f"| **{variant}** | **total** | {_counter_cells(launches, flops, bandwidth)} |")
    return "\n".join(lines)


def counter_findings(groups: dict[str, list[dict]], study_rows) -> str:
    """The counter comparisons the study's explanations rest on."""
    def main_kernel(variant):
        return next(x for x in groups[variant] if x["name"] == "_query_bwd_kernel")

    shape = COUNTER_SHAPE
    naive, remap, parts = (main_kernel(f"fused[{v}]") for v in ("atomic", "atomic_remap", "partial_buffers"))
    plain = main_kernel("fused[two_pass]")  # same sweeps, no dK/dV accumulation (stats + dQ)
    n_programs = 1
    for size in re.findall(r"\d+", naive["grid"]):  # "(x, y, z)"
        n_programs *= int(size)
    adds = n_programs * 2 * shape["seq"] * shape["head_dim"]  # every query block adds all of a head's dK and dV
    model = next(r["accumulation_bytes"] for r in study_rows if r["variant"] == "fused[atomic]"
                 and all(r[k] == v for k, v in COUNTER_SHAPE.items()))
    accumulators = shape["batch"] * shape["heads"] * shape["seq"] * shape["head_dim"] * 4 * 2
    out = [
        f"- N={shape['seq']} (B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}, non-causal), "
        f"fused query kernels only:",
        f"  - remap vs naive atomic: time {remap['ms'] / naive['ms']:.3f}x, L2 reduction sectors "
        f"{remap['red'] / naive['red']:.3f}x, DRAM bytes {remap['dram'] / naive['dram']:.3f}x",
        f"  - naive atomic: {n_programs} query-block programs x 2 x N x D fp32 adds = {adds * 4 / 1e9:.2f} GB of "
        f"payload; L2 reduction traffic {naive['red'] * SECTOR / 1e9:.2f} GB ({naive['red'] * SECTOR / adds:.1f} B "
        f"per 4-B add)",
        f"  - DRAM bytes above the non-accumulating two_pass query kernel: atomic "
        f"{(naive['dram'] - plain['dram']) / 1e9:.2f} GB, partial buffers {(parts['dram'] - plain['dram']) / 1e9:.2f}"
        f" GB; byte model of a read+write of every accumulated tile {model / 1e9:.2f} GB; the fp32 dK+dV "
        f"accumulators are {accumulators / 1e9:.2f} GB in all",
        f"  - L2 sectors above the two_pass query kernel: atomic {(naive['l2'] - plain['l2']) / 1e6:.0f} M, "
        f"partial buffers {(parts['l2'] - plain['l2']) / 1e6:.0f} M ({(parts['l2'] - plain['l2']) / (naive['l2'] - plain['l2']):.2f}x)",
        f"  - achieved DRAM bandwidth: atomic {naive['dram'] / naive['ms'] / 1e6:.0f} GB/s, partial buffers "
        f"{parts['dram'] / parts['ms'] / 1e6:.0f} GB/s, two_pass query kernel {plain['dram'] / plain['ms'] / 1e6:.0f} GB/s",
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    bench = json.loads((args.results / "attention.json").read_text())
    study = json.loads((args.results / "attention_study.json").read_text())
    c = bench.get("ceilings", {})
    print(f"GPU {bench['gpu']}, torch {bench['torch']}, triton {bench['triton']}, commit {bench['commit']}; "
          f"measured ceilings {c.get('matmul_tflops', 0):.0f} TFLOP/s bf16 matmul, {c.get('bandwidth_gbps', 0):.0f} GB/s\n")
    print("## fwd / fwd+bwd TFLOP/s\n\n" + comparison_table(bench["rows"]) + "\n")
    print("## Targets\n\n" + "\n".join(f"- {t['name']}: {t['measured']:.0f} vs {t['target']:.0f} "
                                        f"{'met' if t['met'] else 'NOT met'}" for t in bench["targets"]) + "\n")
    print("## Memory\n\n" + memory_table(bench["rows"]) + "\n")
    print("## Study\n\n" + study_table(study["rows"]) + "\n\n" + findings(study["rows"]))
    counters = args.results / "attention_counters.csv"
    if counters.exists():
        groups = group_by_variant(read_launches(counters))
        print(f"\n## Counters (ncu, {counters.name}; "
              + ", ".join(f"{k}={v}" for k, v in COUNTER_SHAPE.items()) + ", bf16)\n\n"
              + counters_table(groups, study["rows"], c.get("bandwidth_gbps", float("nan"))) + "\n\n"
              + counter_findings(groups, study["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
