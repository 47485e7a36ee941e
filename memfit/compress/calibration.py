"""Calibration token batches for activation-aware compression.

From a text file or from the built-in offline corpus (Python's docs), tokenized as
``memfit generate``/``calibrate``/``finetune`` tokenize text for the same model
(``memfit.infer.text.load_codec``): the directory's Hugging Face tokenizer (found by its
tokenizer.json, sentencepiece tokenizer.model or tokenizer_config.json), else bytes, which is
said once, since byte ids give a model not trained on them the wrong activation statistics.
"""
from __future__ import annotations

from pathlib import Path

import torch

from memfit.errors import MemfitError, is_count
from memfit.files import input_file, read_input_text
from memfit.log import warn_once


def text_tokenizer(model_dir: str | Path | None, vocab: int):
    """``encode(text) -> list[int]`` for the model in ``model_dir`` (None: a preset), by the rule the other
    verbs use (:func:`memfit.infer.text.load_codec`, which says a fallback to bytes once)."""
    from memfit.infer.text import load_codec

    return load_codec(model_dir, vocab).encode


def calibration_batches(encode, text: str, samples: int = 32, seq_len: int = 512, batch: int = 8) -> list[torch.Tensor]:
    """Up to ``samples`` windows of ``seq_len`` tokens, in ``batch``-row tensors; fewer, said once, where the text
    is too short for them."""
    ids = torch.tensor(encode(text), dtype=torch.long)
    if ids.numel() < seq_len:
        raise MemfitError(f"calibration text has {ids.numel()} tokens, fewer than one window of --calib-seq {seq_len}")
    n = min(samples, ids.numel() // seq_len)
    if n < samples:
        warn_once("calibration-windows", f"calibration text has {ids.numel()} tokens: {n} window(s) of --calib-seq "
                                         f"{seq_len}, not the --calib-samples {samples} asked; give more text or ask fewer")
    rows = ids[: n * seq_len].reshape(n, seq_len)
    return list(rows.split(batch))


def load_calibration(calib_file: str | None, builtin: bool, model_dir: str | Path | None, vocab: int,
                     samples: int = 32, seq_len: int = 512) -> list[torch.Tensor] | None:
    """Batches from ``calib_file`` or the built-in corpus; None when neither was asked for."""
    for flag, value in (("--calib-samples", samples), ("--calib-seq", seq_len)):
        if not is_count(value):
            raise MemfitError(f"{flag} must be a positive integer, got {value!r}")
    if calib_file and builtin:
        raise MemfitError("give either --calib FILE or --calib-builtin, not both")
    if not calib_file and not builtin:
        return None
    if calib_file:
        path = input_file(calib_file, "calibration file", "pass a text file")
        text = read_input_text(path, "calibration file", errors="replace")
    else:
        from memfit.data import build_corpus

        text = build_corpus()[0]
    return calibration_batches(text_tokenizer(model_dir, vocab), text, samples, seq_len)
