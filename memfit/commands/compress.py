"""``memfit compress``: convert a model's linear layers to low-rank, Monarch or BLAST structure."""
from __future__ import annotations

EXAMPLES = """\
examples:
  memfit compress llama-3.2-1b --method monarch --out ./monarch-1b
  memfit compress ./my-llama --method blast --activation-aware --calib-builtin --out ./my-llama-blast
  memfit compress ./my-llama --method lowrank --ratio 0.3 --skip none --out ./my-llama-lowrank

A preset has random weights: its result is for shapes and speed, not accuracy. OUT is written
only once every layer is projected; until then each group of layers projected is kept in
.OUT.memfit-progress beside it (about the disk the compressed layers take), so a run that is
interrupted (Ctrl-C, an error, a lost session) continues where it stopped when the same command
runs again (a layer whose weight or calibration inputs changed since is projected again).
From Python, memfit.compress(MODEL, OUT, method=...) does the same, and
memfit.compress.load_compressed(OUT) loads the result.
"""


def add_parser(sub):
    import argparse

    parser = sub.add_parser(
        "compress", help="compress a model's linear layers to block-low-rank structure",
        description="Replace the q/k/v/o/gate/up/down projections of a Llama-family model by low-rank,\n"
                    "Monarch or BLAST layers holding --ratio of their parameters, and save the result\n"
                    "(safetensors + memfit_compress.json). MODEL is a preset (random weights) or a local\n"
                    "Hugging Face directory.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", help="preset name or local model directory")
    parser.add_argument("--method", choices=("blast", "monarch", "lowrank"), default="blast",
                        help="the structure: BLAST (default), Monarch, or plain low-rank U V^T")
    parser.add_argument("--ratio", type=float, default=0.5, help="fraction of the linear parameters kept (default 0.5)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks per side for monarch/blast (default 16)")
    parser.add_argument("--skip", default=None,
                        help="comma-separated kinds kept dense (default: k_proj,v_proj for GQA models; 'none' for none)")
    parser.add_argument("--out", required=True,
                        help="output directory (refused if it exists, unless it holds an earlier compress and --force)")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier memfit compress output at --out: the whole directory, with "
                             "anything added to it since; also discard the layers an interrupted compress to --out "
                             "kept under other settings (under the same settings a run continues from them)")
    parser.add_argument("--calib", metavar="FILE", help="calibration text file")
    parser.add_argument("--calib-builtin", action="store_true", help="calibrate on the built-in Python-docs corpus")
    parser.add_argument("--calib-samples", type=int, default=None, help="calibration windows (default 32)")
    parser.add_argument("--calib-seq", type=int, default=None, help="tokens per calibration window (default 512)")
    parser.add_argument("--activation-aware", action="store_true",
                        help="minimise each layer's output error on the calibration inputs (whitened projection, "
                             "the input covariance damped by 1e-4 of its mean variance, more where that does not make "
                             "it positive definite (said); BLAST and Monarch then refine on the full input "
                             "covariance, slower). Give more calibration tokens than a layer has inputs (said "
                             "otherwise): fewer fit those tokens")
    parser.add_argument("--steps", type=int, default=None, help="BLAST descent steps per matrix (default 300)")
    parser.add_argument("--device", default="auto",
                        help="where projections run: auto (cuda if present), cpu, cuda or cuda:N. The model stays "
                             "in CPU memory: each group of weights visits the device for its projection, and each "
                             "decoder layer in turn for the calibration forward")
    return parser


def run(args) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from memfit.compress import compress
    from memfit.compress.io import CONFIG_NAME

    _refuse_unused(args)
    blocks = 16 if args.blocks is None else args.blocks
    result = compress(args.model, args.out, args.method, args.ratio, blocks, skip=args.skip,
                      calib=args.calib, calib_builtin=args.calib_builtin,
                      calib_samples=32 if args.calib_samples is None else args.calib_samples,
                      calib_seq=512 if args.calib_seq is None else args.calib_seq,
                      activation_aware=args.activation_aware, steps=300 if args.steps is None else args.steps,
                      device=args.device, force=args.force)
    labels = {"weight_error": "weight err"}
    if any(r["output_error"] is not None for r in result.report):          # calibration was given
        labels["output_error"] = "output err"
    on_calibration = ("; output errors on the calibration tokens" + (", those the projection was fitted to: "
                      "held-out text may read higher" if args.activation_aware else "")) if "output_error" in labels else ""
    table = Table(title=f"memfit compress: {args.method}, {result.summary()['linear_ratio']:.1%} of linear params",
                  caption=f"relative errors of the saved layers, mean and max over the layers of each kind"
                          f"{on_calibration} (each layer's: {Path(args.out).expanduser() / CONFIG_NAME})")
    for column in ("kind", "shape", "rank", "params", *(f"{label} mean/max" for label in labels.values())):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for kind, kp in result.plan.items():
        rows = [r for r in result.report if r["kind"] == kind]
        table.add_row(kind, f"{kp.in_features}->{kp.out_features}", str(kp.rank) if kp.rank else f"dense ({kp.reason})",
                      f"{kp.params / kp.dense_params:.0%}",
                      *(_mean_max([r[key] for r in rows if r[key] is not None]) for key in labels))
    Console().print(table)
    Console(stderr=True).print(f"saved to {Path(args.out).expanduser()}", soft_wrap=True, markup=False, highlight=False)
    return 0


def _refuse_unused(args) -> None:
    """Refuse an option this run would not read (it was accepted and dropped, unsaid): --blocks for low-rank,
    --steps for a method other than BLAST (the only iterative projection), the calibration window options without
    calibration text."""
    from memfit.errors import MemfitError

    if args.method == "lowrank" and args.blocks is not None:
        raise MemfitError("--blocks: a low-rank layer has no blocks (it is for monarch and blast)")
    if args.method != "blast" and args.steps is not None:
        raise MemfitError(f"--steps: {args.method}'s projection is closed-form (truncated SVD); the descent steps are "
                          "BLAST's")
    unread = [flag for flag, value in (("--calib-samples", args.calib_samples), ("--calib-seq", args.calib_seq))
              if value is not None]
    if unread and not (args.calib or args.calib_builtin):
        raise MemfitError(f"{', '.join(unread)}: shape the calibration windows, and no calibration text is given "
                          "(--calib FILE or --calib-builtin)")


def _mean_max(values: list[float]) -> str:
    """The mean and max of a kind's per-layer errors as one table cell (the table then fits 80 columns): the mean
    says what the kind lost, the max whether one layer lost much more; "-" where there are none (a kind kept dense)."""
    return f"{sum(values) / len(values):.3f}/{max(values):.3f}" if values else "-"
