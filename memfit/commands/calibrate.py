"""``memfit calibrate``: rank a model's FFN neurons on calibration prompts (for partial loading)."""
from __future__ import annotations

from pathlib import Path


def add_parser(sub):
    parser = sub.add_parser(
        "calibrate", help="rank FFN neurons on calibration prompts (for memfit generate --load/--compute)",
        description="Run calibration prompts through a local model and rank each layer's FFN neurons by mean |h| at the "
                    "down-projection input, overall and per task label; writes rankings.safetensors next to the model.")
    parser.add_argument("model", help="local model directory (config.json + safetensors)")
    parser.add_argument("--data", required=True, help='JSONL, one {"text": ..., "task": optional label} a line')
    parser.add_argument("--out", help="output file (default: MODEL/rankings.safetensors)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite an existing rankings file (one an earlier calibrate wrote; no other file)")
    parser.add_argument("--max-tokens", type=int, default=512, help="truncate each prompt to this many tokens (default 512)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass (default 8)")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: the model's)")
    return parser


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memfit.errors import MemfitError
    from memfit.infer.calibrate import RANKINGS_FILE, calibrate, is_rankings_file, prompt_batches, read_prompts
    from memfit.infer.partial_load import dir_fingerprint, load_model
    from memfit.infer.text import load_codec
    from memfit.local import check_model_dir, output_dir_problem, refuse_blank_out, resolve_device

    model_dir = check_model_dir(args.model)
    if args.out is not None:                           # blank, it had written MODEL/rankings.safetensors, unsaid
        refuse_blank_out(args.out, "the rankings file, or leave --out out for MODEL/rankings.safetensors")
    out = Path(args.out) if args.out else model_dir / RANKINGS_FILE
    if out.is_dir():
        raise MemfitError(f"--out {out} is a directory: name the rankings file (e.g. {out / RANKINGS_FILE})")
    if out.exists() and not is_rankings_file(out):       # --force had replaced MODEL/model.safetensors itself
        raise MemfitError(f"{out} exists and is not a rankings file an earlier memfit calibrate wrote, so it is never "
                          "replaced (not even with --force); choose another --out")
    if out.exists() and not args.force:
        raise MemfitError(f"{out} exists; pass --force to overwrite it or --out to write elsewhere")
    if problem := output_dir_problem(out.parent):      # before the model loads, not at the save
        raise MemfitError(f"--out {out}: {problem}")
    if args.max_tokens < 1 or args.batch_size < 1:
        raise MemfitError(f"--max-tokens and --batch-size must be >= 1, got {args.max_tokens} and {args.batch_size}")
    prompts = read_prompts(args.data)
    device = resolve_device(args.device)
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        loading = progress.add_task("loading", total=None)
        model = load_model(model_dir, dtype=args.dtype, device=device,
                           progress=lambda done, total: progress.update(loading, completed=done, total=total))
        codec = load_codec(model_dir, model.config.vocab_size)
        batches = list(prompt_batches(prompts, codec.encode, args.max_tokens, args.batch_size))
        total = sum(int(mask.sum()) for _, mask, _ in batches)
        running = progress.add_task("calibrating (tokens)", total=total)
        rankings = calibrate(model, batches, progress=lambda n: progress.advance(running, n),
                             fingerprint=dir_fingerprint(model_dir, model.config.num_hidden_layers))
    rankings.save(out)
    tasks = ", ".join(f"{t} ({rankings.tokens[f'task.{t}']} tokens)" for t in rankings.tasks) or "none"
    console.print(f"wrote {out}: general ranking over {rankings.tokens['general']} tokens; task rankings: {tasks}")
    return 0
