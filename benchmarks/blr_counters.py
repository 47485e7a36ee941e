"""DRAM traffic of the BLR pipelines, read off Nsight Compute's hardware counters.

The layer table times each pipeline against its roofline floor, whose bytes are the ideal: x, the weights and y,
each moved once (``memfit.measure.roofline``). Where a pipeline runs far above its floor, the time alone does not
say whether it moves more bytes than that (an intermediate through DRAM, a weight read twice) or moves them slowly.
This runs each case of CASES once, after warm-up (compile, tune), under ``ncu`` with application replay, the clocks
and the caches left alone (so a stage reads what the stage before it left in L2, as in a real run), and records
per kernel its time and the bytes it read from and wrote to DRAM, per case their sums against the ideal bytes.
Under ncu the kernels run one at a time (no programmatic dependent launch overlaps them): the times are the
kernels' own, not the pipeline's as the layer table reads it. A write still in L2 when the case ends is not counted
(L2 writes back lazily), so a case whose output fits L2 can read below its ideal bytes.

    python benchmarks/blr_counters.py [--out DIR]        # on the GPU: writes blr_counters.json and .csv
    python benchmarks/blr_counters.py --parse FILE.csv   # the JSON again from a saved CSV (no GPU)

The CSV is ncu's raw page after one line of the run's own (RUN_LINE: GPU, versions, commit and cases as JSON), so
a saved CSV is enough to make the JSON again.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import blr_layers  # noqa: E402  (the shapes and layer builders of the layer table)

CASES = [  # structure, shape, N, variant (dense: cuBLAS through F.linear)
    ("dense", "llama-3.2-1b gate", 1, None),
    ("monarch", "llama-3.2-1b gate", 1, "two_stage"),
    ("monarch", "llama-3.2-1b gate", 1, "two_stage_pdl"),
    ("monarch", "llama-3.2-1b q/o", 1, "two_stage_pdl"),       # decode's furthest from its floor
    ("monarch", "llama-7b gate/up", 1, "bmm"),
    ("monarch", "llama-7b qkvo", 16, "two_stage_pdl"),
    ("dense", "llama-3.2-1b q/o", 8192, None),
    ("monarch", "llama-3.2-1b q/o", 8192, "tbmm_tbmm"),
    ("monarch", "llama-3.2-1b q/o", 8192, "tbmm"),
    ("monarch", "llama-3.2-1b q/o", 8192, "fused"),              # z on chip: x re-read per output block
    ("monarch", "llama-3.2-1b gate", 8192, "tbmm_tbmm"),
    ("blast", "llama-3.2-1b gate", 1, "bgemm_mix_bgemm_pdl"),
    ("blast", "llama-3.2-1b q/o", 1, "bgemm_mix_bgemm_pdl"),
    ("blast", "llama-3.2-1b q/o", 1, "bgemm_mix_gemv_pdl"),       # stage 3 a GEMV over U's rank-contiguous rows
    ("blast", "llama-7b gate/up", 1, "bgemm_mix_bgemm_pdl"),
    ("blast", "llama-7b gate/up", 1, "bgemm_mix_gemv_pdl"),       # where that chain lost most
    # (the last three added after the 3ce8478 run; first counted at 7eeb2bd)
    ("blast", "llama-3.2-1b q/o", 1024, "tbmm_mix_tbmm"),
    ("blast", "llama-3.2-1b gate", 128, "tbmm_mix_tbmm"),
    ("blast", "llama-3.2-1b gate", 128, "z_mixgemm"),           # the mixing folded into the last GEMM's loads: no T
    ("blast", "llama-3.2-1b gate", 8192, "tbmm_mix_tbmm"),
]
METRICS = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"]
RUN_LINE = "# memfit run: "   # the CSV's first line: the run's environment and cases, JSON
MARKER = "_case_marker"   # the kernel launched before each case's own, so the profile splits into cases
TIME_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def parse_args():
    from memfit.measure.results import check_out_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--parse", default=None, metavar="CSV", help="write the JSON from this saved ncu CSV")
    parser.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)   # the process ncu runs
    args = parser.parse_args()
    check_out_dir(parser, args.out)
    if args.parse:
        if not Path(args.parse).is_file():
            parser.error(f"--parse {args.parse}: no such file")
        with open(args.parse) as handle:
            if not handle.readline().startswith(RUN_LINE):
                parser.error(f"--parse {args.parse}: not a CSV this benchmark saved (its first line starts with "
                             f"{RUN_LINE.strip()!r})")
    return args


def case_calls(torch):
    """One callable per case of CASES (each checked to run), on bf16 layers of random weights."""
    import torch.nn.functional as F

    shapes = {name: (d_in, d_out, rank) for name, d_in, d_out, rank in blr_layers.SHAPES}
    calls = []
    for kind, shape, n, variant in CASES:
        d_in, d_out, rank = shapes[shape]
        x = torch.randn(n, d_in, device="cuda", dtype=torch.bfloat16)
        if kind == "dense":
            w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) / d_in**0.5
            calls.append(lambda x=x, w=w: F.linear(x, w))
            continue
        make, call, offered = blr_layers.structures(d_in, d_out, rank, blr_layers.BLOCKS, n, torch.bfloat16, "cuda",
                                                    [kind])[kind]
        if variant not in offered:
            raise SystemExit(f"blr_counters: {kind} does not offer {variant} at {shape}, N = {n}")
        layer = make()
        calls.append(lambda layer=layer, x=x, call=call, variant=variant: call(layer, x, path="triton",
                                                                                variant=variant))
    return calls


def profiled_run() -> None:
    """What ncu runs: every case warmed up, then once each between cudaProfilerStart and Stop, after a marker, each
    after an unprofiled read of twice the L2, which writes back the dirty lines earlier work left there. In a first
    run without it (results/earlier/blr_counters_no_flush_80c60c8.json) cuBLAS at Llama-1B gate, N = 1, whose output
    is 16 KB, wrote 9.04 MB to DRAM, and 2.25 MB with it (3ce8478): the flush accounts for part of it only. Until
    the flush became ``autotune.l2_flush`` it summed its uint8 buffer, which first wrote an int64 copy eight times
    its size: the files up to 7eeb2bd's (results/earlier/) were measured with that flush, dfd69a8's
    (results/blr_counters.json) with the read-only one, its decode cases' DRAM bytes as before."""
    import torch
    import triton
    import triton.language as tl

    from memfit.kernels.autotune import l2_flush

    @triton.jit
    def _case_marker(ptr):
        tl.store(ptr, 1)

    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    flush = l2_flush(2 * torch.cuda.get_device_properties().L2_cache_size, torch.device("cuda"))
    calls = case_calls(torch)
    with torch.no_grad():
        for call in calls:                 # compile, tune, and any first-call work outside the profile
            call()
            call()
        _case_marker[(1,)](flag)
        for call in calls:
            flush()                        # unprofiled: the dirty lines left in L2 are written back here, not counted
            torch.cuda.synchronize()       # as the case's writes; the case starts from an L2 of clean, other data
            torch.cuda.cudart().cudaProfilerStart()
            _case_marker[(1,)](flag)
            call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()


def ncu_path() -> str:
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)),
                                        None)                      # else the newest installed
    if found is None:
        raise SystemExit("blr_counters: Nsight Compute (ncu) is not installed here")
    return found


def profile() -> str:
    """The raw CSV of one ncu run of this script (``--profiled``), one row per kernel."""
    ncu = ncu_path()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "blr_counters"
        subprocess.run([ncu, "--clock-control", "none", "--cache-control", "none", "--replay-mode", "application",
                        "--profile-from-start", "off", "--metrics", ",".join(METRICS), "--export", str(report),
                        "--force-overwrite", sys.executable, str(Path(__file__).resolve()), "--profiled"],
                       check=True, env=os.environ.copy())
        return subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--csv", "--page", "raw", "--print-units",
                               "base"], check=True, capture_output=True, text=True).stdout


def number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else float("nan")


def read_profile(csv_text: str, cases: list = CASES) -> list[dict]:
    """Per case of ``cases`` (those of the run profiled), in order: its kernels (name, us, DRAM bytes read and
    written), their sums, the ideal bytes. ``csv_text``: ncu's raw page, a header row, a units row, then one row per
    kernel in launch order; each case's kernels follow a MARKER kernel."""
    from memfit.measure.roofline import layer_cost

    table = list(csv.reader(io.StringIO(csv_text)))
    start = next((i for i, row in enumerate(table) if "Kernel Name" in row), None)
    if start is None:
        raise ValueError("blr_counters: the profile has no kernel table (no 'Kernel Name' header)")
    header, units = table[start], table[start + 1]
    col = {name: header.index(name) for name in ["Kernel Name", *METRICS]}
    scale = {"gpu__time_duration.sum": TIME_US[units[col["gpu__time_duration.sum"]]],
             "dram__bytes_read.sum": BYTES[units[col["dram__bytes_read.sum"]]],
             "dram__bytes_write.sum": BYTES[units[col["dram__bytes_write.sum"]]]}
    kernels_by_case: list[list[dict]] = []
    for row in table[start + 2:]:
        if len(row) < len(header):
            continue
        name = row[col["Kernel Name"]]
        if MARKER in name:
            kernels_by_case.append([])
            continue
        if not kernels_by_case:
            raise ValueError(f"blr_counters: kernel {name!r} before the first {MARKER}")
        kernels_by_case[-1].append({
            "kernel": name[:120],
            "us": number(row[col["gpu__time_duration.sum"]]) * scale["gpu__time_duration.sum"],
            "dram_read": number(row[col["dram__bytes_read.sum"]]) * scale["dram__bytes_read.sum"],
            "dram_write": number(row[col["dram__bytes_write.sum"]]) * scale["dram__bytes_write.sum"]})
    if len(kernels_by_case) != len(cases):
        raise ValueError(f"blr_counters: the profile holds {len(kernels_by_case)} cases, the run {len(cases)}")
    shapes = {name: (d_in, d_out, rank) for name, d_in, d_out, rank in blr_layers.SHAPES}
    rows = []
    for (kind, shape, n, variant), kernels in zip(cases, kernels_by_case):
        d_in, d_out, rank = shapes[shape]
        ideal = layer_cost(kind, "ideal", n, d_in, d_out, rank, blr_layers.BLOCKS)[1]
        moved = sum(k["dram_read"] + k["dram_write"] for k in kernels)
        rows.append({"structure": kind, "shape": shape, "n": n, "variant": variant or "cublas", "kernels": kernels,
                     "us": sum(k["us"] for k in kernels), "dram_bytes": moved, "ideal_bytes": ideal,
                     "dram_over_ideal": moved / ideal})
    return rows


def main() -> int:
    args = parse_args()
    if args.profiled:
        profiled_run()
        return 0
    from memfit.measure.results import environment, results_path, write_results

    if args.parse:                         # the run's GPU, versions, commit and cases: the CSV's first line
        run_line, csv_text = Path(args.parse).read_text().split("\n", 1)
        run = json.loads(run_line.removeprefix(RUN_LINE))
    else:                                  # the CSV, with the run's environment, saved first: a parse error loses neither
        csv_text, run = profile(), environment() | {"cases": CASES}
        saved = results_path("blr_counters", args.out)
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.with_suffix(".csv").write_text(RUN_LINE + json.dumps(run) + "\n" + csv_text)
    try:
        rows = read_profile(csv_text, [tuple(case) for case in run.get("cases", CASES)])
    except ValueError as err:              # a profile that does not hold the run's cases: said, not a traceback
        raise SystemExit(str(err)) from None
    path = write_results("blr_counters", rows, [], args.out, **run, metrics=METRICS,
                         method="ncu --replay-mode application --cache-control none --clock-control none")
    for r in rows:
        print(f"{r['structure']:8} {r['shape']:18} N={r['n']:5} {r['variant']:14} {r['us']:9.1f} us "
              f"DRAM {r['dram_bytes'] / 1e6:8.1f} MB = {r['dram_over_ideal']:5.2f}x ideal "
              f"({len(r['kernels'])} kernels)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
