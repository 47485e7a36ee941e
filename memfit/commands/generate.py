"""``memfit generate``: stream text from a local model, optionally loading/computing a fraction of its FFN neurons;
or from a directory ``memfit compress`` wrote (its block-low-rank layers run as they are; no partial FFN there)."""
from __future__ import annotations

import math
import sys
from dataclasses import replace

from memfit.commands.options import seed
from memfit.errors import MemfitError


def add_parser(sub):
    parser = sub.add_parser(
        "generate", help="generate text (static KV cache + CUDA graphs), with partial FFN load/compute",
        description="Generate from a local model directory. --load keeps only that fraction of the FFN neurons of the "
                    "middle layers in memory (needs `memfit calibrate` rankings); --compute decodes with that fraction, "
                    "chosen per prompt. A directory `memfit compress` wrote runs with its block-low-rank layers (the "
                    "partial-FFN options are for dense models). Reports decode tokens/s and peak memory; `memfit "
                    "plan --task infer --generator memfit` predicts that peak before a run (--seq: the longest "
                    "prompt's tokens, --batch: the prompts, --new-tokens: --max-new).")
    parser.add_argument("model", help="local model directory (config.json + safetensors), dense or from memfit compress")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat for a batch (one shared neuron selection, see "
                             "memfit.infer.selection). Each prompt's continuation is printed up to its end-of-text "
                             "token; one prompt streams it, a batch prints each under a '--- prompt N' line")
    parser.add_argument("--max-new", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--load", type=float, default=1.0, help="gamma: fraction of FFN neurons loaded in partial layers")
    parser.add_argument("--compute", type=float, default=None, help="phi: fraction computed at decode (default: = --load)")
    parser.add_argument("--base", type=float, default=None, help="delta: top task-ranked fraction always loaded and computed "
                                                                "(default min(0.3, compute))")
    parser.add_argument("--full-first", type=int, help="first layers loaded fully (default 2)")
    parser.add_argument("--full-last", type=int, help="last layers loaded fully (default 2)")
    parser.add_argument("--compute-all-layers", action="store_true",
                        help="apply --compute to the fully loaded first/last layers too")
    parser.add_argument("--task", help="task ranking to take the base neurons from (default: the general ranking)")
    parser.add_argument("--rankings", help="rankings file (default: MODEL/rankings.safetensors)")
    parser.add_argument("--adapter", help="a LoRA adapter directory (memfit finetune's OUT/adapter, or any plain peft "
                                          "LoRA adapter of MODEL), merged into the weights before decoding. For one "
                                          "memfit finetune saved, each --prompt is encoded as its prompts were trained: "
                                          "the text and a newline, no special tokens (no BOS); a chat-trained one reads "
                                          "its markers as typed, e.g. --prompt $'<|user|>\\nhi<|assistant|>'")
    parser.add_argument("--raw-prompt", action="store_true",
                        help="with an --adapter memfit finetune saved, encode each --prompt as given, as without one "
                             "(with the tokenizer's default special tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=seed, default=None,
                        help="seed of the sampling with --temperature > 0: the same seed, the same text (default: "
                             "another draw each run)")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: the model's)")
    parser.add_argument("--no-graphs", action="store_true", help="decode eagerly instead of replaying a CUDA graph")
    return parser


def _refuse_unused_selection(args, partial, intermediate: int) -> None:
    """--rankings, --task, --base and --compute-all-layers choose the neurons of partial layers, --full-first and
    --full-last which layers are partial: refuse them where every FFN neuron is loaded and computed, where they would
    do nothing (the library takes a ranking there, for a sweep over load and compute that includes the full model)."""
    if not partial.loads_everything(intermediate):
        return
    if given := _neuron_choice_flags(args):
        raise MemfitError(f"{', '.join(given)}: only for partial layers; at --load {partial.load:g} and --compute "
                          f"{partial.phi:g} every one of the {intermediate} FFN neurons is loaded and computed")


def _neuron_choice_flags(args) -> list[str]:
    """The options given that choose which FFN neurons a partial layer keeps, and which layers are partial."""
    return [flag for flag, value in (("--rankings", args.rankings), ("--task", args.task), ("--base", args.base),
                                     ("--compute-all-layers", args.compute_all_layers or None),
                                     ("--full-first", args.full_first), ("--full-last", args.full_last))
            if value is not None]


def _refuse_partial_options(args) -> None:
    """A compressed model's MLPs are block-low-rank: there are no FFN neurons to load or compute a fraction of."""
    fractions = [flag for flag, value in (("--load", None if args.load == 1.0 else args.load),
                                          ("--compute", args.compute)) if value is not None]
    if given := fractions + _neuron_choice_flags(args):
        raise MemfitError(f"{', '.join(given)}: partial FFN load and compute are for dense models; {args.model} is "
                          "a memfit-compressed model")


def _compressed_loader(args, device, console):
    """The options and the directory's record checked (no tensor read); returns what loads the model."""
    from memfit.compress import load_compressed
    from memfit.compress.io import read_compressed_dir

    _refuse_partial_options(args)
    if args.adapter is not None:
        raise MemfitError(f"--adapter: a LoRA adapter merges into a dense model's linear layers; {args.model} is a "
                          "memfit-compressed model")
    read_compressed_dir(args.model)

    def load():
        with console.status("loading the compressed model"):
            return load_compressed(args.model, device=device, dtype=args.dtype)
    return load


def _dense_loader(args, device, console):
    """The directory, the partial-FFN options and their rankings checked (no weight read); returns what loads the
    model, with a partial FFN as the options ask."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from memfit.infer.adapter import merge_adapter, read_adapter_config
    from memfit.infer.partial_load import PartialConfig, describe, load_model, partial_rankings
    from memfit.local import check_model_dir
    from memfit.models import load_spec

    model_dir = check_model_dir(args.model)
    spec = load_spec(model_dir)
    fully_loaded = {name: count for name, count in (("full_first", args.full_first), ("full_last", args.full_last))
                    if count is not None}                      # left out: PartialConfig's defaults
    partial = PartialConfig(load=args.load, compute=args.compute, base=args.base, task=args.task,
                            compute_all_layers=args.compute_all_layers, **fully_loaded)
    if partial.loads_everything(spec.intermediate):   # no layer is partial: the full/partial split is moot
        first = min(partial.full_first, spec.num_layers)
        partial = replace(partial, full_first=first, full_last=min(partial.full_last, spec.num_layers - first))
    partial.check(spec.num_layers)
    _refuse_unused_selection(args, partial, spec.intermediate)
    if args.adapter is not None:
        if not partial.loads_everything(spec.intermediate):
            raise MemfitError("--adapter with partial FFN layers (--load or --compute below 1): the adapter's MLP "
                              "updates are for every neuron; leave --load and --compute at 1")
        read_adapter_config(args.adapter)
    rankings = partial_rankings(model_dir, partial, spec, args.rankings)   # None where no layer is partial

    def load():
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task("loading tensors", total=None)
            model = load_model(model_dir, partial, dtype=args.dtype, device=device, rankings=rankings,
                               progress=lambda done, total: bar.update(task, completed=done, total=total))
        if args.adapter is not None:
            with console.status(f"merging the adapter {args.adapter}"):
                merge_adapter(model, args.adapter)
        if not partial.loads_everything(spec.intermediate):
            console.print(f"partial FFN: {describe(partial, spec)}")
        return model
    return load


class TextStream:
    """Writes the text of a growing sequence of token ids to stdout as the ids arrive: what ``decode`` of all of them
    adds to what is already shown.

    A byte-level tokenizer (memfit's, or a Hugging Face one with byte fallback) gets a multi-byte character one byte
    per token, and decodes an unfinished one to U+FFFD (Hugging Face's byte fallback turns the whole trailing run of
    byte tokens into U+FFFD, shortening text already shown). Shown, that U+FFFD would stay: the finished character
    decodes to the same length, so nothing would be added. Trailing U+FFFD is therefore held back, and text that
    does not outgrow what is shown waits, until a later token finishes the character; ``close`` writes whatever is
    left. The text shown is ``decode`` of every id where decoding more ids changes only an unfinished last character
    (memfit's byte tokenizer); a decoder that rewrites earlier text (Hugging Face's byte fallback turning a finished
    character back into U+FFFD beside an unfinished one) can leave shown text that differs from it.
    """

    def __init__(self, decode):
        self.decode, self.ids, self.shown = decode, [], ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        self._show(self.decode(self.ids).rstrip("\ufffd"))

    def close(self) -> None:
        self._show(self.decode(self.ids))

    def _show(self, text: str) -> None:
        if len(text) > len(self.shown):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text


def _stop_index(tokens: list[int], stops: frozenset[int]) -> int | None:
    """Where the first end-of-text id is in a continuation, None where it has none."""
    return next((i for i, token in enumerate(tokens) if token in stops), None)


def _ending(end: int | None, max_new: int, sampled: bool) -> str:
    """Why a continuation ended: at an end-of-text id (``end``, its index) or at --max-new. An empty continuation
    (greedy decoding's first token an end id) had printed an empty line and nothing else."""
    if end is None:
        return f"stopped at --max-new {max_new}"
    if end == 0:
        return "the model's first token is end-of-text: an empty continuation" + (
            "" if sampled else " (--temperature samples others)")
    return f"stopped at the model's end-of-text token after {end} token{'s' * (end != 1)}"


def run(args) -> int:
    from pathlib import Path

    import torch
    from rich.console import Console

    from memfit.data.jsonl import has_prompt_template, prompt_text
    from memfit.infer.generate import Generator, check_decode_length, weight_bytes_per_token
    from memfit.infer.text import load_codec
    from memfit.local import resolve_device
    from memfit.models import dtype_of, model_skeleton
    from memfit.models.spec import is_compressed_dir
    from memfit.units import format_bytes

    if args.max_new < 1:
        raise MemfitError(f"--max-new must be >= 1, got {args.max_new}")
    if args.raw_prompt and args.adapter is None:
        raise MemfitError("--raw-prompt goes with --adapter (without one every --prompt is encoded as given)")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise MemfitError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.seed is not None and args.temperature == 0:
        raise MemfitError("--seed seeds the sampling of --temperature > 0; greedy decoding (temperature 0) draws nothing")
    device = resolve_device(args.device)
    if args.dtype not in (None, "auto"):
        dtype_of(args.dtype)                       # a bad name refused before anything is read
    console = Console(stderr=True)
    model_dir = Path(args.model).expanduser()
    compressed = model_dir.is_dir() and is_compressed_dir(model_dir)
    load = (_compressed_loader if compressed else _dense_loader)(args, device, console)
    skeleton = model_skeleton(model_dir)        # the architecture alone: what a refusal needs, before any weight
    codec = load_codec(model_dir, skeleton.config.vocab_size)
    if args.adapter is not None and not args.raw_prompt and has_prompt_template(args.adapter):   # as it was trained
        encoded = [codec.encode_plain(prompt_text(text)) for text in args.prompt]
        console.print("[dim]--adapter: each prompt encoded as memfit finetune's prompts are (the text and a newline, "
                      "no special tokens); --raw-prompt encodes it as given[/dim]")
    else:
        encoded = [codec.encode(text) for text in args.prompt]
    if not all(encoded):
        raise MemfitError("every --prompt must encode to at least one token")
    width = max(len(ids) for ids in encoded)
    check_decode_length(skeleton, width + args.max_new)
    model = load()
    ids = torch.zeros(len(encoded), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(encoded):   # left padding: every prompt ends at the last position
        ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    if args.seed is not None:                  # before the loop captures its graph, which draws from the generator
        torch.manual_seed(args.seed)
    with console.status("preparing the decode loop: kernel choices (timed once per shape, then cached), compiles, "
                        "the CUDA graph"):
        generator = Generator(model, width + args.max_new, batch=len(encoded),
                              graphs=False if args.no_graphs else None, temperature=args.temperature)
    text = TextStream(codec.decode)
    prefill = console.status(f"prefill of {width} prompt tokens" + (
        ": a compressed model's first prompt of a new length also times its layers' kernels (then cached)"
        if compressed else ""))

    def stream(tokens):
        prefill.stop()
        text.add(int(tokens[0]))

    single = len(encoded) == 1
    prefill.start()
    try:
        result = generator.generate(ids, args.max_new, attention_mask=mask, on_tokens=stream if single else None,
                                    eos=codec.stops if single else None)
    finally:
        prefill.stop()
    if single:
        text.close()
        sys.stdout.write("\n")
        end = _stop_index(result.tokens[0].tolist(), codec.stops)
        console.print(f"[dim]{_ending(end, args.max_new, args.temperature > 0)}[/dim]")
    else:                       # as one prompt shows it: the continuation alone, up to its end-of-text token
        for row in range(len(encoded)):
            tokens = result.tokens[row].tolist()
            end = _stop_index(tokens, codec.stops)
            ending = _ending(end, args.max_new, args.temperature > 0)
            print(f"--- prompt {row + 1}: {args.prompt[row]!r} ({ending})\n{codec.decode(tokens[:end])}")
    peak = format_bytes(result.peak_bytes) if result.peak_bytes is not None else "n/a on CPU"
    console.print(f"decode {result.tokens_per_s:.1f} tokens/s per sequence ({result.steps} steps, "
                  f"{'CUDA graph' if result.graphs else 'eager'}), prefill {result.prefill_s * 1e3:.0f} ms, "
                  f"peak memory {peak}, weights read per token {format_bytes(weight_bytes_per_token(model))}")
    return 0
