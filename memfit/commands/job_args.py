"""Options that describe a job, shared by ``memfit plan`` and ``memfit verify``."""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

from memfit.errors import MemfitError
from memfit.ledger.job import GENERATORS, LORA_TARGETS_ALL, OPTIMIZERS, TASK_ONLY_FIELDS, TASKS, Job, Knobs
from memfit.ledger.predict import blr_dense_kinds, check_blr, check_knobs_fit_job
from memfit.models import load_spec

DEFAULT_MODEL = "llama-3.2-3b"
# Options the ledger reads for some tasks only (memfit.ledger.job.TASK_ONLY_FIELDS, by option): the tasks, and why the
# others ignore it. Their parser default is None, so an option given for another task is refused, not dropped.
TASK_OPTIONS = {"--" + name.replace("_", "-"): why for name, why in TASK_ONLY_FIELDS.items()}


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _job_device(text: str) -> str:
    """--device of plan and verify: the kind of device the job is for. The other verbs' auto and cuda:N are refused
    with what to pass instead."""
    if text in ("cuda", "cpu"):
        return text
    if text == "auto":
        raise argparse.ArgumentTypeError("auto would make the job depend on this machine: the job is for cuda or cpu")
    if re.fullmatch(r"cuda:[0-9]+", text):
        raise argparse.ArgumentTypeError(f"the job is for a kind of device, cuda or cpu: for GPU {text[5:]} of several, "
                                         f"run with CUDA_VISIBLE_DEVICES={text[5:]} and --device cuda")
    raise argparse.ArgumentTypeError(f"expected cuda or cpu, got {text!r}")


def add_job_arguments(parser: argparse.ArgumentParser, default_device: str = "cuda", partial: bool = True) -> None:
    """The job's options; ``partial=False`` (a command that cannot run a partial-FFN job) keeps --partial-load and
    --partial-compute out of its --help but still parses them, so that using them gets the reason it refuses them."""
    job = parser.add_argument_group("the job")
    job.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"a preset (see `memfit presets`) or a local model directory with config.json (default {DEFAULT_MODEL})")
    job.add_argument("--task", default="lora", choices=TASKS,
                     help="full fine-tune, LoRA fine-tune, or inference = prefill + decode (default lora)")
    job.add_argument("--seq", type=_int, default=2048, help="tokens per sequence (prompt length for infer; default 2048)")
    job.add_argument("--batch", type=_int, default=1, help="sequences per step (default 1)")
    job.add_argument("--new-tokens", type=_int, help="infer: tokens generated after the prompt (default 128)")
    job.add_argument("--device", default=default_device, type=_job_device, metavar="{cuda,cpu}",
                     help=f"the kind of device the job runs on (default {default_device}; for one GPU of several, "
                          f"set CUDA_VISIBLE_DEVICES)")
    setup = parser.add_argument_group("how it runs (the planner may add techniques on top)")
    setup.add_argument("--dtype", default=None, help="weights/activations dtype: float32, bfloat16, float16 (default: the model's)")
    setup.add_argument("--lora-rank", type=_int, help="lora: LoRA rank (default 16)")
    setup.add_argument("--lora-targets",
                       help="lora: comma-separated linear layers that get adapters (default: all seven; with --blr, "
                            "the ones kept dense: peft wraps nn.Linear layers only)")
    setup.add_argument("--optimizer", choices=OPTIMIZERS,
                       help="full, lora: the optimizer (default adamw; adamw8bit is bitsandbytes', CUDA only)")
    setup.add_argument("--checkpoint-layers", type=_int,
                       help="full, lora: decoder layers with activation checkpointing, counted from the first (default 0)")
    setup.add_argument("--micro-batch", type=_int,
                       help="full, lora: sequences per forward/backward; the rest is gradient accumulation (default: "
                            "the batch)")
    setup.add_argument("--offload-layers", type=_int,
                       help="full, lora: of the checkpointed layers, how many keep their input in pinned CPU memory "
                            "(CUDA only; default 0)")
    setup.add_argument("--fused-ce", action="store_true", default=None,
                       help="full, lora: loss by memfit's fused linear cross-entropy: logits are never built")
    setup.add_argument("--fused-swiglu", action="store_true", default=None,
                       help="full, lora: the gated MLP's silu(gate) * up by memfit's kernel, its gradients written "
                            "over its inputs")
    setup.add_argument("--four-bit", action="store_true",
                       help="lora, infer: a frozen 4-bit NF4 base (bitsandbytes, CUDA)")
    setup.add_argument("--partial-load", type=float,
                       help="infer: share of FFN neurons loaded in the middle layers (default 1: all)"
                       if partial else argparse.SUPPRESS)
    setup.add_argument("--partial-compute", type=float,
                       help="infer: share of FFN neurons computed per decoded token (default: --partial-load)"
                       if partial else argparse.SUPPRESS)
    setup.add_argument("--generator", choices=GENERATORS,
                       help="infer: the loop that runs it: hf, transformers' forward with its growing DynamicCache "
                            "(default), or memfit, `memfit generate`'s (a static KV cache allocated once, the prompt "
                            "in chunks of queries: a long prompt's prefill peaks at one chunk's activations)")
    setup.add_argument("--blr", default=None, choices=("blast", "monarch", "lowrank"),
                       help="the model compressed to block-low-rank layers by `memfit compress` (default: dense)")
    setup.add_argument("--blr-ratio", type=float, default=None,
                       help="with --blr: share of linear parameters kept (default 0.5)")
    setup.add_argument("--blr-blocks", type=_int, default=None, help="with --blr: blocks (default 16)")
    setup.add_argument("--attention", default="sdpa", choices=("sdpa", "memfit"),
                       help="attention kernel: torch SDPA or memfit's Triton kernel (CUDA only; default sdpa)")
    job.add_argument("--loss-fraction", type=float,
                     help="full, lora: share of tokens that carry a loss, e.g. 0.3 when prompts are 70%% of the text "
                          "(default 1)")


def _given(args, *flags: str) -> dict:
    """The options among ``flags`` given on the command line, by their field names (argparse's dest); those left out
    take the defaults of Job and Knobs."""
    dests = (flag[2:].replace("-", "_") for flag in flags)
    return {dest: getattr(args, dest) for dest in dests if getattr(args, dest) is not None}


def loop_words(job: Job, knobs: Knobs) -> str:
    """How a job's title names its decode loop: only where it is memfit's (transformers' is the default)."""
    return " by memfit's decode loop" if job.task == "infer" and knobs.generator == "memfit" else ""


def print_json_error(err: Exception, job: Job | None, **fields) -> None:
    """``--json``'s form of an error that ends ``memfit plan`` or ``memfit verify`` (exit 2), on stdout: the job as far
    as it was built (null before), the command's own fields, and the message."""
    print(json.dumps({"job": None if job is None else job.to_dict(), **fields, "error": str(err)}, indent=1))


NOT_GIVEN = object()    # a job option's parser-level default where given_job_options must tell (not a str: argparse
                        # would run a string default through the option's type)


def defer_job_defaults(parser: argparse.ArgumentParser) -> None:
    """Make every job option of ``parser`` (:func:`add_job_arguments`') default to NOT_GIVEN, so that
    :func:`given_job_options` tells an option typed with its default value from one left out; :func:`fill_job_defaults`
    then puts the defaults in. The --help texts name the defaults themselves, so they do not change."""
    parser.set_defaults(**dict.fromkeys(_job_defaults(), NOT_GIVEN))


def given_job_options(args) -> list[str]:
    """The job options given on the command line (of a parser :func:`defer_job_defaults` marked), as flags: what a
    command that takes its job from elsewhere (``memfit verify --plan``) refuses rather than drops."""
    return ["--" + dest.replace("_", "-") for dest in _job_defaults() if getattr(args, dest) is not NOT_GIVEN]


def fill_job_defaults(args) -> None:
    """Each job option left out takes its default (see :func:`defer_job_defaults`)."""
    for dest, default in _job_defaults().items():
        if getattr(args, dest) is NOT_GIVEN:
            setattr(args, dest, default)


def _job_defaults() -> dict:
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    return vars(parser.parse_args([]))


def job_from_plan_file(path: str, pick: int) -> tuple[Job, Knobs, list[str]]:
    """The job, knobs and techniques of plan ``pick`` (numbered as ``memfit plan`` lists them; 0: the job as asked)
    in ``path``, a ``memfit plan --json`` output ("-": stdin), checked as :func:`job_from_args` checks its own."""
    from memfit.files import input_file, read_input_text

    role = "--plan file"
    source = Path("/dev/stdin") if path == "-" else input_file(path, role, "pass what `memfit plan --json` printed")
    try:
        record = json.loads(read_input_text(source, role))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MemfitError(f"{role} {path!r} is not JSON ({err}); pass what `memfit plan --json` printed") from None
    if not isinstance(record, dict) or not {"job", "asked", "plans"} <= set(record):
        raise MemfitError(f"{role} {path!r} is not `memfit plan --json` output (it has no \"job\", \"asked\" and "
                          "\"plans\")")
    if record.get("error"):
        raise MemfitError(f"{role} {path!r} holds a plan that failed: {record['error']}")
    plans = record["plans"]
    if not isinstance(plans, list) or not all(isinstance(entry, dict) for entry in plans):
        raise MemfitError(f"{role} {path!r}: its \"plans\" is not a list of plans")
    if not 0 <= pick <= len(plans):
        held = f"plans 1-{len(plans)}" if plans else "no plan that fits its budget"
        raise MemfitError(f"--pick {pick}: {path} holds {held}; --pick 0 is the job as asked")
    entry = record["asked"] if pick == 0 else plans[pick - 1]
    try:
        job, knobs = Job.from_dict(entry["job"]), Knobs.from_dict(entry["knobs"])
        check_knobs_fit_job(job, knobs)                # values a plan never holds, named by the options that set them
        check_blr(job, knobs)
    except (KeyError, TypeError) as err:               # an entry that is not a ledger's record
        raise MemfitError(f"{role} {path!r}: its entry {pick} is not a plan's record ({type(err).__name__}: {err})") \
            from None
    except MemfitError as err:
        raise MemfitError(f"{role} {path!r}, entry {pick}: {err}") from None
    techniques = [] if pick == 0 else entry.get("techniques", [])
    if not isinstance(techniques, list) or not all(isinstance(name, str) for name in techniques):
        raise MemfitError(f"{role} {path!r}, entry {pick}: its \"techniques\" is not a list of names")
    return job, knobs, techniques


def job_from_args(args) -> tuple[Job, Knobs]:
    """Build and validate the job and its knobs; bad values raise MemfitError before any work (load_spec refuses a
    directory memfit compress wrote)."""
    spec = load_spec(args.model)
    for flag, (tasks, why) in TASK_OPTIONS.items():
        if args.task not in tasks and _given(args, flag):
            raise MemfitError(f"{flag} does nothing with --task {args.task}: {why}; it is for --task "
                              f"{' or '.join(tasks)}")
    job = Job(spec, task=args.task, seq=args.seq, batch=args.batch, device=args.device,
              **_given(args, "--new-tokens", "--loss-fraction"))
    if args.micro_batch is not None and args.micro_batch < 1:       # 0 would read as "not given"
        raise MemfitError(f"--micro-batch must be at least 1, got {args.micro_batch}")
    micro = args.micro_batch or args.batch
    if args.blr is None and (given := [flag for flag, value in (("--blr-ratio", args.blr_ratio),
                                                                ("--blr-blocks", args.blr_blocks)) if value is not None]):
        raise MemfitError(f"{' and '.join(given)}: only for a --blr model; pass --blr blast|monarch|lowrank too")
    if args.blr == "lowrank" and args.blr_blocks is not None:
        raise MemfitError("--blr-blocks: a low-rank layer has no blocks (it is for --blr monarch and blast)")
    options = _given(args, "--lora-rank", "--checkpoint-layers", "--optimizer", "--offload-layers", "--fused-ce",
                     "--fused-swiglu", "--partial-load", "--partial-compute", "--generator")
    if "partial_load" in options:                      # --partial-compute defaults to --partial-load
        options.setdefault("partial_compute", options["partial_load"])
    knobs = Knobs(dtype=args.dtype or spec.dtype, micro_batch=micro, four_bit=args.four_bit, attention=args.attention,
                  blr_method=args.blr, blr_ratio=0.5 if args.blr_ratio is None else args.blr_ratio,
                  blr_blocks=16 if args.blr_blocks is None else args.blr_blocks, **options)
    dense = blr_dense_kinds(spec, knobs)
    if args.lora_targets is not None:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        if not targets:
            raise MemfitError(f"--lora-targets {args.lora_targets!r} names no module: give a comma-separated list, "
                              f"e.g. q_proj,v_proj")
    else:                                              # with --blr: the projections kept dense (peft wraps nn.Linear)
        targets = LORA_TARGETS_ALL if dense is None else tuple(k for k in LORA_TARGETS_ALL if k in dense)
    if args.task == "lora":                             # the ledger refuses adapter settings for another task
        knobs = replace(knobs, lora_targets=targets)
    check_knobs_fit_job(job, knobs)                    # before any work (the ledger checks them again)
    check_blr(job, knobs)
    return job, knobs
