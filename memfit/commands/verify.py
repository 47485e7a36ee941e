"""``memfit verify``: run the job, measure its peak, and hold it against the ledger."""
from __future__ import annotations

import argparse
import json

from memfit.commands.job_args import (
    add_job_arguments,
    defer_job_defaults,
    fill_job_defaults,
    given_job_options,
    job_from_args,
    job_from_plan_file,
    loop_words,
    print_json_error,
)
from memfit.errors import MemfitError
from memfit.units import format_bytes

EXAMPLES = """\
examples:
  memfit verify --model tiny --task lora --seq 256 --device cpu
  memfit verify --model llama-3.2-1b --task full --seq 2048 --checkpoint-layers 8 --optimizer adamw8bit
  memfit verify --model qwen2.5-1.5b --task infer --seq 4096 --json
  memfit verify --model llama-3.2-1b --task infer --seq 16384 --generator memfit   # `memfit generate`'s loop
  memfit verify --model llama-3.2-1b --task lora --seq 2048 --blr monarch   # random-init BLR layers, planned ranks
  memfit plan --model llama-3.2-1b --task full --seq 2048 --gpu-memory 12GiB --json > plans.json
  memfit verify --plan plans.json --pick 2      # the second plan listed: its job and techniques

The model is random-init (memory does not depend on values). On CUDA the peak is
torch.cuda.max_memory_allocated over one step after a warm-up step; on CPU the same
from the allocator's events (torch.profiler). Exits 1 when the total is off by more than --tolerance.
"""


def add_parser(sub):
    parser = sub.add_parser("verify", help="measure a job's peak and compare it with the prediction",
                            description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(parser, partial=False)    # memfit.ledger.verify builds no partial-FFN model
    defer_job_defaults(parser)                  # --plan refuses a job option even where it is given its default
    plan = parser.add_argument_group("a plan instead of the job options")
    plan.add_argument("--plan", metavar="FILE",
                      help="measure a plan that `memfit plan --json` wrote to FILE (- reads stdin): its job and "
                           "techniques, in place of the job options above, which are refused with it (--tolerance, "
                           "--warmup and --json still apply)")
    plan.add_argument("--pick", type=int, default=None, metavar="N",
                      help="with --plan: which plan, numbered as `memfit plan` lists them (default 1, the fastest "
                           "that fits); 0 is the job as asked")
    parser.add_argument("--tolerance", type=_fraction, default=0.05,
                        help="allowed relative error of the total, a fraction or a percentage (default 0.05, or 5%%)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first, at least 1 (default 1)")
    parser.add_argument("--json", action="store_true",
                        help="machine-readable output on stdout; an error found once the options are parsed (exit 2) "
                             "too, as {\"job\", \"error\"}")
    return parser


def _fraction(text: str) -> float:
    """--tolerance as a fraction (0.05) or a percentage (5%): '5%' had been argparse's "invalid float value"."""
    number = text.strip()
    try:
        return float(number[:-1]) / 100 if number.endswith("%") else float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction (0.05) or a percentage (5%), got {text!r}") from None


def run(args) -> int:
    """Verify the job; with --json, an error that ends the command (exit 2) is a JSON object on stdout too, as
    ``memfit plan --json`` prints one, with the job as far as it was read (null before)."""
    from rich.console import Console

    from memfit.local import use_expandable_segments

    use_expandable_segments()          # before CUDA starts: the allocator the ledger's overhead assumes

    from torch.cuda import is_available as cuda_available

    from memfit.ledger.verify import NO_PARTIAL_FFN, verify

    job, techniques = None, None
    try:
        given = given_job_options(args)
        fill_job_defaults(args)
        if args.partial_load is not None or args.partial_compute is not None:   # not job_from_args' "for --task infer"
            raise MemfitError(NO_PARTIAL_FFN)
        if args.plan is not None:
            if given:
                raise MemfitError(f"{', '.join(given)}: --plan {args.plan} sets the job; leave out the job options")
            job, knobs, techniques = job_from_plan_file(args.plan, 1 if args.pick is None else args.pick)
            if job.device == "cuda" and not cuda_available():   # check_runnable's line would say --device cpu
                raise MemfitError(f"--plan {args.plan}: its job runs on cuda and this machine has no CUDA GPU; run it "
                                  "on one, or plan again with --device cpu")
        elif args.pick is not None:
            raise MemfitError("--pick chooses among a --plan file's plans; pass --plan FILE too")
        else:
            job, knobs = job_from_args(args)
        with Console(stderr=True).status(f"verify: {job.spec.name} {job.task} on {job.device}") as status:
            result = verify(job, knobs, tolerance=args.tolerance, warmup=args.warmup,
                            progress=lambda phase: status.update(f"verify: {job.spec.name} {job.task} on "
                                                                 f"{job.device}: {phase}"))
    except MemfitError as err:
        if args.json:
            print_json_error(err, job)
        raise
    picked = None if args.plan is None else {"file": args.plan, "pick": 1 if args.pick is None else args.pick,
                                             "techniques": techniques}
    if args.json:
        print(json.dumps({**result.to_dict(), **({"plan": picked} if picked else {})}, indent=1))
    else:
        from rich.table import Table

        blr = f" ({knobs.blr_method} block-low-rank, {knobs.blr_ratio:g})" if knobs.blr_method else ""
        table = Table(title=f"{job.spec.name}{blr} {job.task} batch {job.batch} x seq {job.seq}"
                            f"{loop_words(job, knobs)} on {job.device}")
        for column in ("component", "predicted", "measured"):
            table.add_column(column, justify="left" if column == "component" else "right")
        for name, predicted, measured in result.rows():
            table.add_row(name, format_bytes(predicted), "-" if measured is None else format_bytes(measured))
        console = Console()
        if picked:
            which = "the job as asked" if picked["pick"] == 0 else f"plan {picked['pick']}"
            console.print(f"{which} of {args.plan}: {', '.join(techniques) or 'no technique added'}")
        for note in result.ledger.notes:
            console.print(f"[yellow]note: {note}[/]")
        console.print(table)
        verdict = "[green]within[/]" if result.ok else "[red]outside[/]"
        console.print(f"error {100 * result.error:+.3g}%, {verdict} the tolerance of {100 * args.tolerance:.4g}%"
                      + (f"; reserved {format_bytes(result.measured.reserved)}" if job.device == "cuda" else ""))
    return 0 if result.ok else 1
