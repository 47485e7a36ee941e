"""``memfit plan``: where a job's memory goes, and the fastest ways to fit it in a budget."""
from __future__ import annotations

import json
import sys

from memfit.commands.job_args import add_job_arguments, job_from_args, loop_words, print_json_error
from memfit.errors import MemfitError
from memfit.ledger.predict import COMPONENTS, Ledger
from memfit.units import format_bytes, format_count, parse_bytes

EXAMPLES = """\
examples:
  memfit plan                                   # the built-in default: llama-3.2-3b LoRA, seq 2048, 16GiB
  memfit plan --model llama-3.2-3b --task lora --seq 2048 --batch 1 --gpu-memory 8GiB
  memfit plan --model ./my-model-dir --task full --seq 4096 --gpu-memory 80GiB --json
  memfit plan --model llama-3.1-8b --task infer --seq 8192 --new-tokens 512 --gpu-memory 24GB
  memfit plan --model llama-3.1-8b --task infer --seq 32768 --generator memfit   # as `memfit generate` runs it

The peak is replayed step by step (forward, loss, backward, optimizer step; or prefill and
decode), not summed. Budgets count the CUDA context and allocator overhead too.
"""


def _positive_int(text: str) -> int:
    import argparse

    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def add_parser(sub):
    parser = sub.add_parser("plan", help="predict a job's memory and find plans that fit a budget",
                            description=__doc__, epilog=EXAMPLES,
                            formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    add_job_arguments(parser)
    parser.add_argument("--gpu-memory", default="16GiB", help="the budget: 8GiB, 8GB, 8000MiB, 0.5TiB (default 16GiB)")
    parser.add_argument("--limit", type=_positive_int, default=5, help="how many fitting plans to show (default 5)")
    parser.add_argument("--json", action="store_true",
                        help="machine-readable output on stdout; an error found once the options are parsed (exit 2) "
                             "too, with its message under \"error\" (argparse's own usage errors print none)")
    return parser


def run(args) -> int:
    """Plan the job; with --json, an error that ends the command (exit 2) is a JSON object on stdout too, whatever
    raised it, with the job and the budget as far as they were read (null before)."""
    from rich.progress import Progress

    from memfit.ledger.planner import plan, undominated

    job = budget = None
    try:
        job, knobs = job_from_args(args)
        budget = parse_bytes(args.gpu_memory)
        console = _stderr()
        # a bar only on a terminal: elsewhere rich still ends it with a newline, ahead of any error line
        with Progress(transient=True, console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task("replaying technique combinations", total=None)
            # every plan that fits, then those a faster one does not match in memory, --limit of them
            asked, plans = plan(job, knobs, budget, limit=sys.maxsize,
                                progress=lambda done, total: bar.update(task, completed=done, total=total))
            plans = undominated(plans)[:args.limit]
    except MemfitError as err:
        if args.json:
            print_json_error(err, job, budget_bytes=budget, asked=None, plans=[])
        raise
    if args.json:
        print(json.dumps({"job": job.to_dict(), "budget_bytes": budget, "asked": asked.to_dict(),
                          "plans": [p.to_dict() for p in plans]}, indent=1))
        return 0
    _print(job, knobs, asked, plans, budget)
    return 0


def _stderr():
    from rich.console import Console

    return Console(stderr=True)


def _print(job, knobs, asked: Ledger, plans, budget: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    spec = job.spec
    console.print(f"[bold]{spec.name}[/] ({format_count(spec.num_params())} params), task [bold]{job.task}[/], "
                  f"batch {job.batch} x seq {job.seq}{loop_words(job, knobs)} on {job.device}; budget "
                  f"{format_bytes(budget)}")
    for note in asked.notes:
        console.print(f"[yellow]note: {note}[/]")
    if knobs.blr_method:
        blocks = "" if knobs.blr_method == "lowrank" else f", {knobs.blr_blocks} blocks"
        console.print(f"block-low-rank model ({knobs.blr_method}, {knobs.blr_ratio:g} of the decoder's linear "
                      f"parameters{blocks}). Not in the ledger: a layer shape's first call times "
                      "its kernel variants over copies of its arguments (up to 150 MiB more, or three times the L2 "
                      "where that is larger) and one output per copy, all freed when the pick is made; the "
                      "stream it times on keeps its cuBLAS workspaces (64-96 MiB on the H200).")
    table = Table(title="ledger of the job as asked (at its peak)")
    table.add_column("component")
    table.add_column("bytes", justify="right")
    for component in COMPONENTS:
        if asked.peak.get(component):
            table.add_row(component, format_bytes(asked.peak[component]))
    table.add_row("[bold]peak allocated[/]", f"[bold]{format_bytes(asked.total)}[/]")
    table.add_row("allocator overhead (reserved, est.)", format_bytes(asked.allocator_overhead))
    if job.device == "cuda":                          # a CPU job has no CUDA context
        table.add_row("CUDA context (outside the allocator)", format_bytes(asked.cuda_context))
    table.add_row(f"[bold]needs of the {'GPU' if job.device == 'cuda' else 'CPU job'}[/]",
                  f"[bold]{format_bytes(asked.device_total)}[/]")
    console.print(table)
    console.print("peak in " + f"{asked.peak_phase} at {asked.peak_where}; phase peaks: "
                  + ", ".join(f"{phase} {format_bytes(v)}" for phase, v in asked.phases.items()))
    plans_table = Table(title=f"plans that fit {format_bytes(budget)}: exact first, then fastest, each needing less "
                              "than those above it")
    for column in ("#", "techniques", "needs", "peak", "time", "largest components at the peak"):
        plans_table.add_column(column, justify="right" if column in ("needs", "peak", "time") else "left")
    for index, p in enumerate(plans, 1):
        led = p.ledger
        largest = sorted(((v, c) for c, v in led.peak.items() if v), reverse=True)[:3]
        plans_table.add_row(str(index), ", ".join(p.techniques) or "as asked", format_bytes(led.device_total),
                            format_bytes(led.total), f"{p.relative_time:.2f}x",
                            ", ".join(f"{c} {format_bytes(v)}" for v, c in largest))
    console.print(plans_table)
    by_note: dict[str, list[str]] = {}                 # what a plan's own techniques add (8-bit AdamW's bitsandbytes)
    for index, p in enumerate(plans, 1):
        for note in p.ledger.notes:
            if note not in asked.notes:
                by_note.setdefault(note, []).append(str(index))
    for note, numbers in by_note.items():
        console.print(f"[yellow]note (plan{'s' if len(numbers) > 1 else ''} {', '.join(numbers)}): {note}[/]")
    console.print("time: relative to the plain step (no technique), FLOPs x (1 + recompute) + overheads. "
                  "`memfit plan --json` has every component; `memfit verify --plan FILE --pick N` measures plan N "
                  "from it.")
