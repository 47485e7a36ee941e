"""``memfit finetune``: LoRA fine-tune a local Hugging Face model (or a preset) on a JSONL file.

With no arguments it runs the built-in first job: the tiny preset (random init), the
byte tokenizer and the bundled data set, on CPU in well under a minute, and the loss
visibly falls. The memory techniques come from flags, or, with ``--gpu-memory`` on a
GPU, from the ledger's planner: the fastest plan that fits (``choose_techniques``).
"""
from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.commands.options import seed
from memfit.errors import MemfitError
from memfit.files import atomic_dir, follow_umask, serializing, set_aside_of
from memfit.log import warn_once

if TYPE_CHECKING:  # the annotations only; torch loads when a run starts, not for `memfit --help`
    import torch

DEFAULT_MODEL = "tiny"
APPLIED_BY_PATCH = ("checkpoint", "fused_ce", "four_bit")  # the planner's techniques this command can run


@dataclass(frozen=True)
class Techniques:
    """The memory techniques of one fine-tuning run (what a plan supplies)."""

    checkpoint: str = "none"
    offload_layers: object = "none"
    offload_to: str = "cpu"
    four_bit: bool = False
    fused_ce: bool = True
    places: tuple[str, ...] | None = None  # a per-layer checkpoint policy from a plan (overrides checkpoint)
    fused_swiglu: bool = False             # on only for a SiLU model (fused_swiglu_of), which this class cannot see

    def patch_kwargs(self) -> dict:
        return {"checkpoint": self.checkpoint, "offload_layers": self.offload_layers, "offload_to": self.offload_to,
                "four_bit": self.four_bit, "fused_ce": self.fused_ce, "fused_swiglu": self.fused_swiglu}

    def __str__(self) -> str:
        """The run banner's words, e.g. 'checkpoints on 12 of 28 layers (4 of them offloaded to cpu), 4-bit base, fused
        loss', or 'no memory technique'."""
        parts = []
        if self.places is not None:                    # a plan's per-layer places
            kept = sum(place != "none" for place in self.places)
            offloaded = [place for place in self.places if place in ("cpu", "disk")]
            if kept:
                parts.append(f"checkpoints on {kept} of {len(self.places)} layers" + (
                    f" ({len(offloaded)} of them offloaded to {' and '.join(sorted(set(offloaded)))})" if offloaded else ""))
        elif self.checkpoint == "layer":
            offloaded = {"none": "", "0": "", "all": " (all offloaded"}.get(str(self.offload_layers),
                                                                           f" (the first {self.offload_layers} offloaded")
            parts.append("checkpoints on every layer" + (f"{offloaded} to {self.offload_to})" if offloaded else ""))
        parts += [name for name, on in (("4-bit base", self.four_bit), ("fused loss", self.fused_ce),
                                        ("fused SwiGLU", self.fused_swiglu)) if on]
        return ", ".join(parts) or "no memory technique"


def add_parser(sub):
    parser = sub.add_parser(
        "finetune", help="LoRA fine-tune a model on a JSONL data set",
        description="LoRA fine-tune a local Hugging Face model directory or a preset (random init) on JSONL "
                    "(prompt/response or chat messages; loss only on response tokens). Saves the adapter in peft "
                    "format under OUT/adapter and resumable checkpoints under OUT/checkpoints.")
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"preset name or local model directory (default: {DEFAULT_MODEL}, random init)")
    parser.add_argument("--data", default=None,
                        help='JSONL file, one example a line: {"prompt": ..., "response": ...} or {"messages": [{"role": '
                             '"system"|"user"|"assistant", "content": ...}, ...]} (default: memfit\'s bundled small '
                             'data set)')
    parser.add_argument("--gpu-memory", default=None,
                        help="GPU memory budget, e.g. 8GiB: on CUDA the planner picks the techniques (the fastest plan "
                             "that fits, without those turned off by name below); the measured peak is checked against "
                             "it")
    parser.add_argument("--out", default="memfit-finetune",
                        help="output directory, new or empty unless --resume (default: ./memfit-finetune); the run "
                             "writes checkpoints/ and adapter/ there")
    parser.add_argument("--steps", type=int, default=60, help="total optimizer steps (default: 60)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in --out; refused, naming both values, where this "
                             "run's --batch-size, --seed, --lora-r, --lora-alpha, --train-norm, --dtype or data (the "
                             "examples of --data tokenized at --max-len) are not the checkpoint's; --steps, --save-every "
                             "and --lr may change, a new --lr applying to the remaining steps (said once)")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per optimizer step (default: 8)")
    parser.add_argument("--max-len", type=int, default=512,
                        help="truncate examples to this many tokens (default: 512); an example left with no response "
                             "token is dropped, and both are said")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: the checkpoint's with --resume; else 5e-2 for the tiny preset, "
                             "else 2e-4)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the example order and of dropout (default: 0)")
    parser.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and at the end)")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default: 16)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="default: 2 * r")
    parser.add_argument("--train-norm", action=argparse.BooleanOptionalAction, default=None,
                        help="also train the final RMSNorm weight (default: on for the tiny preset, whose random frozen "
                             "output head otherwise caps how far the loss can fall)")
    parser.add_argument("--checkpoint", choices=("none", "layer"), default=None,
                        help="per-layer activation checkpoints (default none; with --gpu-memory on CUDA the plan "
                             "chooses, and an explicit none keeps it from checkpointing)")
    parser.add_argument("--offload", default=None,
                        help="checkpoint inputs to move off the GPU: none, all or N first layers (default none; with "
                             "--gpu-memory on CUDA the plan chooses, and an explicit none keeps it from offloading)")
    parser.add_argument("--offload-to", choices=("cpu", "disk"), default="cpu",
                        help="with --offload: pinned host memory or disk")
    parser.add_argument("--four-bit", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the frozen base in NF4 (bitsandbytes, CUDA; default off; --no-four-bit keeps a "
                             "--gpu-memory plan from it too)")
    parser.add_argument("--fused-ce", action=argparse.BooleanOptionalAction, default=True,
                        help="loss from hidden states without building logits (default: on; --no-fused-ce keeps a "
                             "--gpu-memory plan from it too)")
    parser.add_argument("--fused-swiglu", action="store_true",
                        help="the MLP's silu(gate) * up by memfit's kernel, its gradients written over its inputs "
                             "(SiLU models; off by default: bf16 steps with it read 1.09-1.15x at 2K-4K tokens)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    return parser


def parse_offload(text: str) -> object:
    """--offload as the patch takes it: "none", "all" or a number of first layers (ASCII digits: str.isdigit also
    takes '²', which int() refuses)."""
    if text in ("none", "all"):
        return text
    if text.isascii() and text.isdigit():
        return int(text)
    raise MemfitError(f"--offload must be none, all or a number of first layers, got {text!r}")


def check_technique_flags(args, spec, device: torch.device) -> None:
    """Refuse, before the model loads, a technique flag that would do nothing or cannot run: --offload without
    checkpoints or of more layers than ``spec`` has, --offload-to without --offload, --fused-swiglu for a model whose
    MLP is not SiLU, and on CUDA any of the first three but an explicit none with --gpu-memory, whose plan sets
    them."""
    fused_swiglu_of(args, spec)                        # a non-SiLU model with --fused-swiglu, before it loads
    offload = parse_offload(args.offload or "none")
    if isinstance(offload, int) and offload > spec.num_layers:
        raise MemfitError(f"--offload {args.offload}: {spec.name} has {spec.num_layers} layers")
    offloads = offload not in ("none", 0)
    given = [f"{flag} {value}" for flag, value, used in (("--checkpoint", args.checkpoint, args.checkpoint == "layer"),
                                                         ("--offload", args.offload, offloads),
                                                         ("--offload-to", args.offload_to, args.offload_to != "cpu"))
             if used]
    if args.gpu_memory and device.type == "cuda" and given:
        raise MemfitError(f"{', '.join(given)}: with --gpu-memory on CUDA the plan chooses checkpointing and offload; "
                          "leave out either these flags or --gpu-memory")
    if offloads and args.checkpoint != "layer":
        raise MemfitError(f"--offload {args.offload} needs --checkpoint layer (only checkpoint inputs are offloaded)")
    if args.offload_to != "cpu" and not offloads:
        raise MemfitError(f"--offload-to {args.offload_to} needs --offload all or N (N > 0): it says where offloaded "
                          "checkpoint inputs go")


def fused_swiglu_of(args, spec) -> bool:
    """--fused-swiglu as this run takes it (off unless given); asked for a model whose MLP activation is not SiLU,
    refused before the model loads."""
    if args.fused_swiglu and not spec.silu_mlp:
        raise MemfitError(f"--fused-swiglu computes silu(gate) * up; {spec.name}'s MLP activation is "
                          f"{spec.activation!r}")
    return bool(args.fused_swiglu)


def choose_techniques(args, spec, device: torch.device, dtype: torch.dtype, console) -> Techniques:
    """The techniques for this run (flags checked by :func:`check_technique_flags`): the flags, or the planner's
    fastest plan for ``--gpu-memory`` on CUDA, kept from what the flags turn off by name (--checkpoint none,
    --offload none or 0, --no-fused-ce, --no-four-bit)."""
    swiglu = fused_swiglu_of(args, spec)
    flags = Techniques(args.checkpoint or "none", parse_offload(args.offload or "none"), args.offload_to,
                       bool(args.four_bit), args.fused_ce, fused_swiglu=swiglu)
    if not args.gpu_memory:
        return flags
    if device.type != "cuda":
        console.print("--gpu-memory plans for a CUDA GPU; on the CPU the techniques come from the flags")
        return flags
    from memfit.ledger import Job, Knobs, plan
    from memfit.train.checkpoint import CheckpointPolicy
    from memfit.units import format_bytes, parse_bytes

    job = Job(spec, task="lora", seq=args.max_len, batch=args.batch_size, device="cuda")
    base = Knobs(dtype=str(dtype).removeprefix("torch."), lora_rank=args.lora_r, fused_ce=args.fused_ce,
                 four_bit=bool(args.four_bit), fused_swiglu=swiglu)
    # the training loop runs the whole batch with AdamW in the model's dtype: keep plans that change only
    # what patch() applies (checkpointing, offload, fused loss, 4-bit base), less what the flags turned off
    refused = {"checkpoint": args.checkpoint == "none", "fused_ce": not args.fused_ce,
               "four_bit": args.four_bit is False}
    allowed = tuple(name for name in APPLIED_BY_PATCH if not refused[name])
    no_offload = args.offload is not None and parse_offload(args.offload) in ("none", 0)
    keep = (lambda knobs: knobs.offload_layers == 0) if no_offload else None  # noqa: E731
    as_asked = [words for words, off in (("no checkpoints", refused["checkpoint"]), ("no offload", no_offload),
                                         ("no fused loss", refused["fused_ce"]), ("no 4-bit base", refused["four_bit"]))
                if off]
    _, plans = plan(job, base, parse_bytes(args.gpu_memory), limit=1, allowed=allowed, keep=keep)
    knobs = plans[0].knobs
    console.print(f"plan for {format_bytes(parse_bytes(args.gpu_memory))}"
                  f"{' (' + ', '.join(as_asked) + ', as asked)' if as_asked else ''}: "
                  f"{', '.join(plans[0].techniques) or 'no technique needed'}; predicted peak "
                  f"{format_bytes(plans[0].ledger.total)} at batch {job.batch} x {job.seq} tokens")
    places = CheckpointPolicy.first_layers(spec.num_layers, knobs.checkpoint_layers, knobs.offload_layers).places
    return Techniques("layer" if knobs.checkpoint_layers else "none", "none", "cpu", knobs.four_bit, knobs.fused_ce,
                      places if knobs.checkpoint_layers else None, knobs.fused_swiglu)


def load_tokenizer(name: str, spec):
    """A preset's byte tokenizer, or a local HF directory's own tokenizer (or the byte one where it has none), checked
    against the model: an end-of-sequence token, no more tokens than the model's vocabulary. ``spec`` is
    ``load_spec(name)``'s. Read before the model, so that what the data needs is checked first."""
    from memfit.data.tokenizer import ByteTokenizer
    from memfit.local import check_model_dir, load_hf_tokenizer
    from memfit.models import PRESETS

    if name in PRESETS:
        tokenizer = ByteTokenizer()
    else:
        path = check_model_dir(name)
        use_bytes = ByteTokenizer.saved_in(path) or not any(path.glob("tokenizer*"))
        tokenizer = ByteTokenizer() if use_bytes else load_hf_tokenizer(path)
    if tokenizer.eos_token_id is None:
        raise MemfitError(f"{name}: the tokenizer has no end-of-sequence token")
    if len(tokenizer) > spec.vocab:
        raise MemfitError(f"{name}: the tokenizer has {len(tokenizer)} tokens but the model only {spec.vocab}")
    return tokenizer


def load_model(name: str, spec, dtype: torch.dtype, device: torch.device | str):
    """A preset (random init) or a local HF directory's model, in ``dtype`` on ``device``."""
    from memfit.local import check_model_dir, unreadable_weights
    from memfit.models import PRESETS, build_model

    if name in PRESETS:  # only a preset is built with random weights
        return build_model(spec, dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM

    from memfit.models.hf_calls import loading_quietly

    path = check_model_dir(name).resolve()        # the saved adapter's base_model_name_or_path: found from anywhere
    try:
        with loading_quietly():                   # memfit's own bars follow
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers' and safetensors' errors (a truncated file) share no base
        raise unreadable_weights(path, err) from None
    return model.to(device)


def run(args) -> int:
    from rich.console import Console

    from memfit.local import use_expandable_segments

    use_expandable_segments()          # before CUDA starts: the allocator the ledger's overhead assumes

    from memfit.data.jsonl import DEFAULT_DATA, check_source, read_records, tokenize_records
    from memfit.models import dtype_of, load_spec
    from memfit.train.finetune import (
        TrainConfig,
        check_resumable,
        checkpoint_lr,
        checkpoint_setting,
        checkpoint_to_resume,
        data_settings,
        latest_checkpoint,
        lora_settings,
        peak_bytes,
        refuse_overwriting_a_run,
    )
    from memfit.train.patch import lora_config, patch
    from memfit.units import format_bytes, parse_bytes

    console = Console(stderr=True)
    budget = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    from memfit.local import output_dir_problem, refuse_blank_out, resolve_device

    device = resolve_device(args.device)
    dtype = dtype_of(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    refuse_blank_out(args.out, "the directory the run writes into")
    out = Path(args.out).expanduser()
    source = Path(args.model).expanduser()
    if source.is_dir() and out.resolve() == source.resolve():
        raise MemfitError(f"--out {out} is the model directory: the run's checkpoints and adapter go elsewhere")
    if out.exists() and not out.is_dir():
        raise MemfitError(f"--out {out} exists and is not a directory; choose another --out")
    if problem := output_dir_problem(out):             # before the training, not at its first checkpoint
        raise MemfitError(f"--out {out}: {problem}")
    refuse_overwriting_a_run(out, args.resume)
    if not args.resume and (foreign := _entries_not_its_own(out)):
        raise MemfitError(f"--out {out} holds {', '.join(foreign)} and no run to resume, and a new run writes its "
                          "adapter/ and checkpoints/ there, replacing an adapter/; choose a new or empty directory "
                          "(or remove them)")
    checkpoint = latest_checkpoint(out) if args.resume else None
    lr = args.lr
    if lr is None and checkpoint is not None:
        lr = checkpoint_lr(checkpoint)                 # a resumed run keeps its learning rate unless --lr is given
    if args.four_bit is None and checkpoint is not None:
        # and its base unless --four-bit or --no-four-bit is given: a --gpu-memory plan made again may choose another
        recorded = checkpoint_setting(checkpoint, "four_bit")
        args.four_bit = recorded if isinstance(recorded, bool) else None    # another value: check_resumable names it
        if args.four_bit is not None:
            console.print(f"--resume: on a {'4-bit' if args.four_bit else 'dense'} base, as the checkpoint was trained "
                          "(--four-bit or --no-four-bit chooses)")
    if lr is None:
        lr = 5e-2 if args.model == DEFAULT_MODEL else 2e-4
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed, save_every=args.save_every, lr=lr)
    data = check_source(args.data or DEFAULT_DATA, args.max_len)
    records = read_records(data, args.max_len)        # a bad line is found before the model loads
    lora = {"r": args.lora_r, **({"lora_alpha": args.lora_alpha} if args.lora_alpha is not None else {})}
    if args.model == DEFAULT_MODEL if args.train_norm is None else args.train_norm:
        lora["modules_to_save"] = ["model.norm"]  # peft matches a name's end: "norm" took every layer's RMSNorms too
    lora = lora_config(lora)  # LoRA settings checked before the model loads
    spec = load_spec(args.model)
    check_technique_flags(args, spec, device)
    tokenizer = load_tokenizer(args.model, spec)
    examples = tokenize_records(data, records, tokenizer, args.max_len)
    if (longest := max((len(e.input_ids) for e in examples), default=0)) > spec.max_position:   # as plan notes it
        warn_once("finetune:positions", f"--max-len {args.max_len}: {data} has examples of {longest} tokens, past "
                                        f"{spec.name}'s max_position_embeddings ({spec.max_position}): they train (RoPE "
                                        "has no table to run out of), but the model was not configured for that length")
    data_name = f"{data} cut at {args.max_len} tokens"
    techniques = choose_techniques(args, spec, device, dtype, console)
    if args.resume:                                    # what a resume needs no model for, checked before loading it
        asked = {**lora_settings(lora), "dtype": str(dtype).removeprefix("torch."), "four_bit": techniques.four_bit,
                 "data": data_settings(examples, data_name)}
        check_resumable(checkpoint_to_resume(out), config, asked)
    if techniques.four_bit:       # the dense weights never all on the GPU: each layer quantized as it arrives there
        from memfit.train.four_bit import to_device_4bit

        model = to_device_4bit(load_model(args.model, spec, dtype, "cpu"), device, dtype)
    else:
        model = load_model(args.model, spec, dtype, device)
    model = patch(model, lora=lora, **techniques.patch_kwargs())
    if techniques.places is not None:
        from memfit.train.checkpoint import CheckpointPolicy
        from memfit.train.patch import patch_state

        patch_state(model).policy = CheckpointPolicy(techniques.places)
    console.print(f"memfit finetune: {spec.name} on {device} ({str(dtype).replace('torch.', '')}), "
                  f"{len(examples)} examples, LoRA r={args.lora_r}, {techniques}")
    reports: list = []
    losses = _train_with_progress(model, examples, tokenizer, config, out, args.resume, device, console, format_bytes,
                                  data_name=data_name, on_step=reports.append)
    adapter = _save_adapter_or_say_how(model, out, len(losses))
    peak = peak_bytes(device)
    console.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps{_throughput(reports)}; adapter "
                  f"saved to {adapter}")
    if budget is not None and device.type == "cuda" and peak > budget:
        console.print(f"[yellow]peak {format_bytes(peak)} exceeded --gpu-memory {format_bytes(budget)}: the plan's "
                      "prediction was short; a smaller --gpu-memory plans with more room[/yellow]")
    return 0


def _throughput(reports: list) -> str:
    """The run's tokens per second over the steps it trained after its first (which builds kernels, allocates the
    optimizer state and warms the allocator), as the summary's words; the progress bar shows each step's alone."""
    timed = reports[1:]
    if not timed:
        return ""
    seconds = sum(report.seconds for report in timed)
    return (f", {sum(report.tokens for report in timed) / max(seconds, 1e-9):,.0f} tok/s over steps "
            f"{timed[0].step}-{timed[-1].step}")


def _train_with_progress(model, examples, tokenizer, config, out, resume, device, console, format_bytes, data_name,
                         on_step):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from memfit.train.finetune import checkpoint_step, checkpoint_to_resume, train

    label = "peak GPU" if device.type == "cuda" else "peak RSS"
    columns = (TextColumn("finetune"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TextColumn("{task.fields[speed]} tok/s"), TextColumn(label + " {task.fields[peak]}"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        # a resume's bar starts at its checkpoint's step (it had shown 0/N, and stayed there with nothing to train)
        done = min(checkpoint_step(checkpoint_to_resume(out)), config.steps) if resume else 0
        task = progress.add_task("finetune", total=config.steps, completed=done, loss="-", speed="-", peak="-")

        def show(report):
            progress.update(task, completed=report.step, loss=f"{report.loss:.3f}",
                            speed=f"{report.tokens / max(report.seconds, 1e-9):,.0f}", peak=format_bytes(report.peak_bytes))
            on_step(report)

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return train(model, examples, pad, config, out, resume=resume, on_step=show, data_name=data_name)


def _entries_not_its_own(out: Path, shown: int = 3) -> list[str]:
    """The first ``shown`` names in ``out`` that a run starting there would not have left (its checkpoints directory
    with no checkpoint yet), sorted; hidden names (.DS_Store, .git, an adapter save's temporary and set-aside copies)
    are not counted. A new run writes adapter/ and checkpoints/ into ``out``, and its adapter save had replaced an
    adapter/ of the user's."""
    from memfit.train.finetune import CHECKPOINTS

    if not out.is_dir():
        return []
    return sorted(path.name for path in out.iterdir()
                  if not path.name.startswith(".") and not (path.name == CHECKPOINTS and path.is_dir()))[:shown]


def _save_adapter_or_say_how(model, out: Path, step: int) -> Path:
    """:func:`_save_adapter`; where the disk or file system refuses it, its OSError also says that the training is not
    lost: the last checkpoint holds it, and a resume with the same --steps writes the adapter without training."""
    from memfit.train.finetune import CHECKPOINTS

    try:
        return _save_adapter(model, out)
    except OSError as err:
        raise OSError(f"{err}; the {step} trained steps are saved in {out / CHECKPOINTS}: once the cause is fixed, "
                      "the same command with --resume writes adapter/ without training again") from err


def _save_adapter(model, out: Path) -> Path:
    """Save the LoRA adapter (peft format) to OUT/adapter, replacing the previous one atomically, with the mark that
    tells generate how its prompts were encoded."""
    from memfit.data.jsonl import record_prompt_template

    final = out / "adapter"
    for leftover in (out / ".adapter.tmp", *set_aside_of(final)):   # left by a run killed while it saved
        shutil.rmtree(leftover, ignore_errors=True)
    with atomic_dir(final, out / ".adapter.tmp") as tmp, serializing(final):
        model.save_pretrained(tmp)
        follow_umask(*tmp.rglob("*.safetensors"))      # peft's weights (below tmp for a named adapter), written 0600
        record_prompt_template(tmp)                    # generate --adapter then encodes prompts as they were trained
    return final
