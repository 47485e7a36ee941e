"""Do the planner's plans fit in the memory they were planned for? Each run on the GPU with the allocator capped.

``memfit plan`` says a plan needs ``device_bytes``: its predicted peak, the caching allocator's overhead above it and
the CUDA context (the ledger's CUDA_CONTEXT). ``ledger_accuracy.py`` checks the peak; this checks the whole claim. For
each case (a model, a job, a budget) the planner's first plans are written as ``memfit plan --json`` writes them, and
each plan is read back as ``memfit verify --plan FILE --pick N`` reads it and run as verify runs it (random-init model,
a warm-up step, a measured step), in a process of its own, with torch's caching allocator set as memfit's commands
set it (expandable segments; ``--allocator`` sets another) and limited
(``torch.cuda.set_per_process_memory_fraction``) to the plan's share: ``device_bytes`` less the predicted context. An
allocation past the limit makes the allocator free its cached blocks and try again before it raises, as it does at
the card's end, so a plan that runs needed no more of the allocator than the ledger said. What the process holds
outside the allocator (context, loaded kernels, library handles) is measured at its end (mem_get_info's used bytes
less memory_reserved; nothing else runs on the GPU) and held against the predicted context. A plan that is refused by
the cap is run again capped at its budget less the measured context: whether the user's budget still held.

Plans verify cannot build (partial FFN) are listed as not run. The file is written after every plan
(``complete: false`` until the last).

    python benchmarks/plan_fits.py            # a CUDA machine (bitsandbytes for the 8-bit and 4-bit plans), ~15 min
    python benchmarks/plan_fits.py --resume   # the plans a stopped run of this commit did not reach
    python benchmarks/plan_fits.py --smoke    # CPU: the tiny preset, no cap: checks the code path
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memfit.cli import main as cli
from memfit.errors import MemfitError
from memfit.ledger.verify import NO_PARTIAL_FFN
from memfit.local import ALLOCATOR_VARIABLES
from memfit.measure.results import check_out_dir, partial_results, results_path, target, write_results

# (preset, task, seq, batch, budget, plans to run): budgets the job as asked does not fit, so the planner adds techniques
CASES = [
    ("llama-3.2-1b", "lora", 4096, 1, "8GiB", 3),
    ("llama-3.2-1b", "full", 2048, 1, "16GiB", 3),
    ("llama-3.2-3b", "lora", 4096, 1, "12GiB", 3),
    ("qwen2.5-1.5b", "full", 4096, 1, "20GiB", 4),
    ("llama-3.2-3b", "infer", 8192, 8, "16GiB", 2),
    ("llama-3.1-8b", "lora", 2048, 1, "16GiB", 2),
]
SMOKE_CASES = [("tiny", "lora", 64, 2, "4MiB", 2)]
CHILD_SECONDS = 480     # a 4-bit plan builds its model on the CPU: 58-120 s at 1B-3B (d2e16e1), longer at 8B


def plan_file(preset: str, task: str, seq: int, batch: int, budget: str, limit: int, device: str, folder: Path) -> Path:
    """The case's plans, written by ``memfit plan --json`` itself."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli([*"plan --json --model".split(), preset, "--task", task, "--seq", str(seq), "--batch", str(batch),
                    "--gpu-memory", budget, "--device", device, "--limit", str(limit)])
    if code != 0:
        raise SystemExit(f"memfit plan failed for {preset} {task}: {out.getvalue()}")
    path = folder / f"{preset}_{task}_{seq}_{batch}_{budget}.json"
    path.write_text(out.getvalue())
    return path


def run_child(path: Path, pick: int, cap_bytes: int | None, allocator: str | None) -> dict:
    """Plan ``pick`` of ``path`` measured in a process of its own (:func:`child`), its allocator capped at ``cap_bytes``
    and configured by ``allocator`` (torch's allocator variables; None: memfit's, as its commands set it)."""
    command = [sys.executable, __file__, "--child", str(path), str(pick), str(cap_bytes or 0)]
    env = {key: value for key, value in os.environ.items() if key not in ALLOCATOR_VARIABLES}
    if allocator:
        env.update(dict.fromkeys(ALLOCATOR_VARIABLES, allocator))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_SECONDS, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": CHILD_SECONDS}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"status": "failed", "stderr_tail": done.stderr[-2000:]}
    return json.loads(lines[-1])


def child(path: str, pick: int, cap_bytes: int) -> None:
    """Read plan ``pick`` as ``memfit verify --plan`` does, cap the allocator, measure, print one JSON line."""
    import torch

    from memfit.commands.job_args import job_from_plan_file
    from memfit.ledger.verify import measure
    from memfit.local import use_expandable_segments

    use_expandable_segments()          # as memfit finetune and verify run (--allocator's setting is kept)
    job, knobs, _ = job_from_plan_file(path, pick)
    cuda = job.device == "cuda"
    if cuda and cap_bytes:
        torch.cuda.init()
        torch.cuda.set_per_process_memory_fraction(cap_bytes / torch.cuda.get_device_properties(0).total_memory)
    phases = []
    start = time.perf_counter()
    row = {}
    try:
        measured = measure(job, knobs, warmup=1, progress=phases.append)
        row.update(status="ran", peak_bytes=measured.peak)
    except torch.OutOfMemoryError as err:
        row.update(status="out of memory", at=phases[-1] if phases else None, message=str(err).splitlines()[0][:300])
    row["seconds"] = time.perf_counter() - start
    if cuda:
        free, total = torch.cuda.mem_get_info()
        row.update(max_reserved_bytes=torch.cuda.max_memory_reserved(),
                   max_allocated_bytes=torch.cuda.max_memory_allocated(),
                   outside_allocator_bytes=total - free - torch.cuda.memory_reserved())
    print(json.dumps(row), flush=True)


def run(cases, device: str, save, allocator: str | None = None, done: list[dict] = ()) -> list[dict]:
    """Each case's plans, less those ``done`` holds (a stopped run's rows, which lead the result)."""
    rows = list(done)
    measured = {(json.dumps(row["case"], sort_keys=True), row["pick"]) for row in rows}
    with tempfile.TemporaryDirectory() as folder:
        for preset, task, seq, batch, budget, limit in cases:
            path = plan_file(preset, task, seq, batch, budget, limit, device, Path(folder))
            record = json.loads(path.read_text())
            case = {"model": preset, "task": task, "seq": seq, "batch": batch, "budget": budget,
                    "budget_bytes": record["budget_bytes"]}
            for pick, entry in enumerate(record["plans"], 1):
                if (json.dumps(case, sort_keys=True), pick) in measured:
                    continue
                knobs = entry["knobs"]
                row = {"case": case, "pick": pick, "techniques": entry["techniques"], "knobs": knobs,
                       "predicted": {key: entry[key] for key in ("peak_bytes", "allocator_overhead", "cuda_context",
                                                                 "device_bytes")}}
                if (knobs["partial_load"], knobs["partial_compute"]) != (1.0, 1.0):
                    row["not_run"] = NO_PARTIAL_FFN
                else:
                    share = entry["device_bytes"] - entry["cuda_context"]
                    row["within_prediction"] = run_child(path, pick, share if device == "cuda" else None, allocator)
                    row["cap_bytes"] = share
                    outside = row["within_prediction"].get("outside_allocator_bytes")
                    if row["within_prediction"]["status"] != "ran" and outside is not None:
                        row["budget_cap_bytes"] = record["budget_bytes"] - outside
                        row["within_budget"] = run_child(path, pick, row["budget_cap_bytes"], allocator)
                rows.append(row)
                _say(row)
                save(rows)
    return rows


def _say(row: dict) -> None:
    case, gib = row["case"], 2 ** 30
    head = f"{case['model']:13s} {case['task']:5s} seq {case['seq']:5d} b{case['batch']} {case['budget']:>6s} #{row['pick']}"
    if "not_run" in row:
        print(f"{head}  not run: {row['not_run']}", flush=True)
        return
    result = row["within_prediction"]
    line = f"{head}  {result['status']:13s} predicted {row['predicted']['device_bytes'] / gib:6.2f} GiB"
    if "max_reserved_bytes" in result:
        line += (f"  cap {row['cap_bytes'] / gib:6.2f}  max reserved {result['max_reserved_bytes'] / gib:6.2f}  outside "
                 f"the allocator {result['outside_allocator_bytes'] / gib:5.2f}")
    if "within_budget" in row:
        line += f"  at the budget: {row['within_budget']['status']}"
    print(f"{line}  {', '.join(row['techniques']) or 'as asked'}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], int(argv[2]), int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on CPU, no cap: checks the code path")
    parser.add_argument("--allocator", default=None,
                        help="PYTORCH_ALLOC_CONF (and PYTORCH_CUDA_ALLOC_CONF) for the plans' processes, e.g. "
                             "expandable_segments:False for torch's default (default: memfit's, expandable segments); "
                             "the results file's name takes a suffix")
    parser.add_argument("--resume", action="store_true",
                        help="continue a run of this commit that stopped (its file says complete: false), measuring "
                             "only the plans it has no row for")
    parser.add_argument("--out", default=None, help="directory for the JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run with --smoke on CPU", file=sys.stderr)
        return 2
    suffix = "_" + re.sub(r"\W+", "_", args.allocator).strip("_").lower() if args.allocator else ""
    name = "plan_fits" + suffix + ("_smoke" if args.smoke else "")
    try:
        done = partial_results(results_path(name, args.out), allocator=args.allocator)["rows"] if args.resume else []
    except MemfitError as err:
        parser.error(str(err))
    rows = run(SMOKE_CASES if args.smoke else CASES, device, allocator=args.allocator, done=done,
               save=lambda rows: write_results(name, rows, [], args.out, allocator=args.allocator, complete=False))
    ran = [row for row in rows if "within_prediction" in row]
    fit = [row for row in ran if row["within_prediction"]["status"] == "ran"]
    targets = [target("plans run within their predicted allocator share", len(fit), len(ran), "plans", "higher")]
    if device == "cuda" and fit:                       # a child that failed or timed out measured nothing outside
        outside = max(row["within_prediction"]["outside_allocator_bytes"] / row["predicted"]["cuda_context"]
                      for row in fit)
        targets.append(target("most memory outside the allocator, against the predicted CUDA context", outside, 1.0,
                              "x", "lower"))
    path = write_results(name, rows, targets, args.out, allocator=args.allocator, complete=True)
    print(f"{len(fit)} of {len(ran)} plans ran within their predicted allocator share -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
