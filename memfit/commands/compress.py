"""``memfit compress``: convert a model's linear layers to low-rank, Monarch or BLAST structure."""
from __future__ import annotations


def add_parser(sub):
    parser = sub.add_parser(
        "compress", help="compress a model's linear layers to block-low-rank structure",
        description="Replace the q/k/v/o/gate/up/down projections of a Llama-family model by low-rank, "
                    "Monarch or BLAST layers holding --ratio of their parameters, and save the result "
                    "(safetensors + memfit_compress.json). MODEL is a preset (random weights) or a local HF directory.")
    parser.add_argument("model", metavar="MODEL", help="preset name or local model directory")
    parser.add_argument("--method", choices=("blast", "monarch", "lowrank"), default="blast")
    parser.add_argument("--ratio", type=float, default=0.5, help="fraction of the linear parameters kept (default 0.5)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per side for monarch/blast (default 16)")
    parser.add_argument("--skip", default=None,
                        help="comma-separated kinds kept dense (default: k_proj,v_proj for GQA models; 'none' for none)")
    parser.add_argument("--out", required=True, help="output directory (refused if it exists, unless --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--calib", metavar="FILE", help="calibration text file")
    parser.add_argument("--calib-builtin", action="store_true", help="calibrate on the built-in Python-docs corpus")
    parser.add_argument("--calib-samples", type=int, default=32, help="calibration windows (default 32)")
    parser.add_argument("--calib-seq", type=int, default=512, help="tokens per calibration window (default 512)")
    parser.add_argument("--activation-aware", action="store_true",
                        help="minimise each layer's output error on the calibration inputs (whitened projection; BLAST "
                             "also refines on the full input covariance, slower)")
    parser.add_argument("--steps", type=int, default=300, help="BLAST descent steps per matrix (default 300)")
    parser.add_argument("--device", default="auto", help="where projections run: auto (cuda if present), cpu, cuda or cuda:N")
    return parser


def _skip(text):
    if text is None:
        return None
    return () if text.strip().lower() in ("", "none") else tuple(k.strip() for k in text.split(",") if k.strip())


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from memfit.commands.calibrate import check_model_dir, resolve_device
    from memfit.compress import compress_model, plan_kinds, save_compressed
    from memfit.compress.calibration import load_calibration
    from memfit.compress.convert import decoder_linears, model_shapes
    from memfit.compress.io import check_output
    from memfit.errors import MemfitError
    from memfit.log import warn_once
    from memfit.models import PRESETS, build_model, load_spec

    console = Console(stderr=True)
    check_output(args.out, args.force)  # before any work
    if args.steps < 1:
        raise MemfitError(f"--steps must be >= 1, got {args.steps}")
    skip = _skip(args.skip)
    spec = load_spec(args.model)
    plan_kinds(spec.linear_shapes(), args.method, args.ratio, args.blocks, skip=skip)  # shape errors up front
    if args.activation_aware and not (args.calib or args.calib_builtin):
        raise MemfitError("--activation-aware needs --calib FILE or --calib-builtin")
    model_dir = None if args.model in PRESETS else check_model_dir(args.model)
    device = resolve_device(args.device)
    calibration = load_calibration(args.calib, args.calib_builtin, model_dir, spec.vocab,
                                   args.calib_samples, args.calib_seq)
    if model_dir is None:
        warn_once("compress:random", f"{args.model} is a preset: compressing random weights (shapes only)")
        model = build_model(spec, dtype="float32")
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype="auto").eval()
    model.to(device)
    linears = decoder_linears(model)
    plan = plan_kinds(model_shapes(linears), args.method, args.ratio, args.blocks, skip=skip)
    total = sum(plan[name.rsplit(".", 1)[-1]].rank is not None for name in linears)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(f"{args.method} projection", total=total)
        result = compress_model(model, args.method, args.ratio, args.blocks, skip=skip, calibration=calibration,
                                activation_aware=args.activation_aware, steps=args.steps, device=device,
                                progress=lambda kind, n: bar.update(task, advance=n, description=f"{args.method} {kind}"))
    info = {"source": str(args.model), **result.summary(), "activation_aware": args.activation_aware,
            "report": result.report}
    out = save_compressed(model, args.out, result.layers, info, source_dir=model_dir, force=args.force)
    table = Table(title=f"memfit compress: {args.method}, {result.summary()['linear_ratio']:.1%} of linear params")
    for column in ("kind", "shape", "rank", "params", "weight err", "output err"):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for kind, kp in result.plan.items():
        rows = [r for r in result.report if r["kind"] == kind]
        werr = sum(r["weight_error"] for r in rows) / len(rows) if rows else None
        oerrs = [r["output_error"] for r in rows if r["output_error"] is not None]
        table.add_row(kind, f"{kp.in_features}->{kp.out_features}", str(kp.rank) if kp.rank else f"dense ({kp.reason})",
                      f"{kp.params / kp.dense_params:.0%}", f"{werr:.3f}" if werr is not None else "-",
                      f"{sum(oerrs) / len(oerrs):.3f}" if oerrs else "-")
    Console().print(table)
    console.print(f"saved to {out}")
    return 0
