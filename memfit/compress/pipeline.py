"""One call from a model name to a saved compressed model: what ``memfit compress`` runs.

    import memfit
    result = memfit.compress("llama-3.2-1b", "./blast-1b", method="blast", ratio=0.5, blocks=16)
    model = memfit.compress.load_compressed("./blast-1b")

Every argument is checked before a model is built or loaded (an existing ``out``, a bad shape
for the structure, a missing calibration source, an unknown device), so a mistake costs no time
and leaves nothing behind; the output directory is written only once the projection is done. Each group of layers
projected is kept beside it until then (:mod:`memfit.compress.resume`): an interrupted run, run again with the same
settings, continues where it stopped.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from memfit.compress.convert import CompressionResult


def compress(model: str | Path, out: str | Path, method: str = "blast", ratio: float = 0.5, blocks: int = 16, *,
             skip: str | tuple[str, ...] | None = None, calib: str | Path | None = None, calib_builtin: bool = False,
             calib_samples: int = 32, calib_seq: int = 512, activation_aware: bool = False, steps: int = 300,
             device: str = "auto", force: bool = False, progress: bool = True) -> CompressionResult:
    """Compress ``model`` (a preset, random weights, or a local Hugging Face directory) and save it to ``out``.

    ``method``: blast, monarch or lowrank; ``ratio``: the fraction of the decoder's dense linear parameters
    that remain, the kinds kept dense counted in full (so each compressed kind keeps less than ``ratio`` of its
    own: :mod:`memfit.compress.plan`); ``blocks``: blocks per side (Monarch, BLAST); ``skip``: projection kinds kept
    dense, as a tuple or a comma-separated string ("none" or "" for none; default: k_proj and v_proj
    of GQA models). ``activation_aware`` minimises each layer's
    output error on calibration text (``calib``, a text file, or ``calib_builtin``, the built-in
    Python-docs corpus) instead of its weight error; ``steps``: BLAST's descent steps per matrix.
    ``force`` replaces an earlier compress output at ``out`` (nothing else) and discards the layers an interrupted
    compress to ``out`` kept under other settings (under the same settings they are always taken up).
    ``progress``: a progress bar on stderr. Errors name the ``memfit compress`` flags, as the calibration loader's
    do. A preset is built and saved in its own dtype. Returns :class:`CompressionResult`: the plan, per-layer errors
    and the compressed model itself (``.model``, on the CPU, as the dense model was read; ``device`` holds only each
    group of weights as it is projected, and each decoder layer in turn for the calibration forward);
    ``load_compressed(out)`` loads the saved copy.
    """
    from memfit.compress.calibration import load_calibration
    from memfit.compress.convert import compress_model, decoder_linears, model_shapes
    from memfit.compress.io import check_output, save_compressed
    from memfit.compress.plan import plan_kinds
    from memfit.compress.projection import check_steps
    from memfit.compress.resume import KeptLayers, code_digest
    from memfit.errors import MemfitError
    from memfit.local import check_model_dir, resolve_device, unreadable_weights
    from memfit.log import logger, warn_once
    from memfit.models import PRESETS, load_spec

    model, skip = str(model), parse_skip(skip)
    out_dir = check_output(out, force)
    check_steps(steps, "--steps")
    spec = load_spec(model)
    kinds = plan_kinds(spec.linear_shapes(), method, ratio, blocks, skip=skip)  # shape errors before any work
    if activation_aware and not (calib or calib_builtin):
        raise MemfitError("--activation-aware needs --calib FILE or --calib-builtin")
    model_dir = None if model in PRESETS else check_model_dir(model)
    torch_device = resolve_device(device)
    if device == "auto" and torch_device.type == "cpu":     # no silent fallback: the slow path is said once
        warn_once("compress:cpu", "no CUDA GPU: --device auto projects on the CPU" + (
            ", where BLAST's iterative descent takes far longer than on a GPU" if method == "blast" else ""))
    calibration = load_calibration(calib, calib_builtin, model_dir, spec.vocab, calib_samples, calib_seq)
    if activation_aware:
        _say_few_calibration_tokens(sum(batch.numel() for batch in calibration), spec.linear_shapes(), kinds)
    kept = KeptLayers.open(out_dir, {     # the settings every kept layer shares: before any work too
        "code": code_digest(), "method": method, "blocks": 1 if method == "lowrank" else blocks,
        "ranks": {kind: kp.rank for kind, kp in kinds.items()}, "steps": steps if method == "blast" else None,
        "activation_aware": activation_aware}, force)
    if model_dir is None:
        warn_once("compress:random", f"{model} is a preset: compressing random weights (shapes only)")
        import memfit.models

        # in the preset's dtype, whose size `memfit plan --blr` assumes; compress_model projects in float32
        net = memfit.models.build_model(spec)
    else:
        from transformers import AutoModelForCausalLM

        from memfit.models.hf_calls import loading_quietly

        try:                                           # the check below says what matters of its load report
            with loading_quietly(report=False):
                net, loading = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype="auto",
                                                                    output_loading_info=True,
                                                                    ignore_mismatched_sizes=True)
        except Exception as err:  # noqa: BLE001 - transformers' and safetensors' errors (a truncated file) share no base
            raise unreadable_weights(model_dir, err) from None
        reshaped = [f"{key} saved as {tuple(saved)}, needed {tuple(needed)}"
                    for key, saved, needed in loading.get("mismatched_keys", ())]
        if bad := sorted(loading.get("missing_keys", ())) + reshaped:
            raise MemfitError(f"{model_dir}: its weights lack {len(bad)} tensor(s) the model needs, or hold them in "
                              f"another shape (first: {bad[0]}); compressing would project random weights")
        if unused := sorted(loading.get("unexpected_keys", ())):
            warn_once(f"compress:unused:{model_dir}", f"{model_dir}: its weights hold {len(unused)} tensor(s) its "
                      f"config.json does not describe (first: {unused[0]}); the compressed model leaves them out")
        net.eval()
    # the model stays on the CPU: each group of weights visits the device for its projection (and each decoder layer
    # for the calibration forward: convert.input_covariances), so the device never holds the dense model
    linears = decoder_linears(net)
    plan = plan_kinds(model_shapes(linears), method, ratio, blocks, skip=skip)
    chosen = [name for name in linears if plan[name.rsplit(".", 1)[-1]].rank is not None]
    if kept.count:
        logger.warning(f"continuing an interrupted memfit compress: {kept.count} of {len(chosen)} layers projected "
                       f"with these settings are kept in {kept.directory} (each taken where its weights and "
                       "calibration inputs are this run's)")
    try:
        with _progress_bar(progress, f"{method} projection", len(chosen)) as advance:
            result = compress_model(net, method, ratio, blocks, skip=skip, calibration=calibration,
                                    activation_aware=activation_aware, steps=steps, device=torch_device,
                                    progress=lambda kind, n: advance(n, f"{method} {kind}"), kept=kept)
        source = model if model_dir is None else str(model_dir.resolve())     # a plan names it from any directory
        info = {"source": source, **result.summary(), "activation_aware": activation_aware, "report": result.report}
        save_compressed(net, out, result.layers, info, source_dir=model_dir, force=force)
    except BaseException:
        if kept.count:
            logger.warning(f"{kept.count} of {len(chosen)} layers' projections are kept in {kept.directory}: the "
                           "same command continues from there")
        raise
    kept.remove()
    return result


def _say_few_calibration_tokens(tokens: int, shapes: dict[str, tuple[int, int]], kinds: dict) -> None:
    """Said once where the calibration has fewer tokens than a projected layer has inputs: that layer's covariance
    then has rank at most ``tokens`` (the rest is the projection's ridge), and the activation-aware projection fits those
    tokens, which can leave it worse than the plain one on other text."""
    from memfit.log import warn_once

    narrow = sorted(kind for kind, plan in kinds.items() if plan.rank is not None and shapes[kind][0] > tokens)
    if narrow:
        warn_once("compress:few-calibration-tokens", f"--activation-aware: {tokens} calibration tokens, fewer than "
                  f"the {max(shapes[kind][0] for kind in narrow)} inputs of {', '.join(narrow)}: their covariance has "
                  f"rank at most {tokens}, and the projection fits those tokens (it can generalise worse than the "
                  "plain one); give more with --calib-samples and --calib-seq")


def parse_skip(skip: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    """``skip`` as projection kinds: a comma-separated string ("none" or "" for none) or a sequence;
    None keeps the default (k_proj and v_proj of GQA models)."""
    from memfit.errors import MemfitError

    if skip is None:
        return None
    if not isinstance(skip, str):
        if not all(isinstance(kind, str) for kind in (skip if isinstance(skip, (list, tuple, set)) else [skip])):
            raise MemfitError(f"skip takes projection kinds as a comma-separated string or a sequence of names, "
                              f"got {skip!r}")
        return tuple(skip)
    return () if skip.strip().lower() in ("", "none") else tuple(k.strip() for k in skip.split(",") if k.strip())


@contextlib.contextmanager
def _progress_bar(show: bool, description: str, total: int):
    """A rich progress bar on stderr over ``total`` layers, or none when ``show`` is false: yields
    ``advance(n, description)``."""
    if not show:
        yield lambda n, text: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n, text: bar.update(task, advance=n, description=text)
