"""Read attention.json and attention_study.json and print the study's tables (markdown).

    python benchmarks/attention_analysis.py [--results benchmarks/results]

The numbers in benchmarks/attention_study.md are pasted from this output, never typed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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
    lines = ["| seq | causal | variant | ms | TFLOP/s | x naive fused | floor/ms | GB/s (least+accum.) | accum. GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["causal"], r["seq"], r["variant"])):
        if "ms" not in r:
            lines.append(f"| {r['seq']} | {r['causal']} | {r['variant']} | {r.get('error', '')} |||||| ")
            continue
        lines.append(f"| {r['seq']} | {r['causal']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                     f"{r.get('speedup_vs_naive_fused', float('nan')):.2f} | {r['floor_fraction']:.2f} | "
                     f"{r['achieved_gbps']:.0f} | {r['accumulation_bytes'] / 1e9:.2f} |")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
