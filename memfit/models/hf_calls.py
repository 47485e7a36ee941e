"""How memfit calls a Hugging Face ``*ForCausalLM`` across the transformers versions it runs on (5.x here and on the
GPU machine's image), by the names each version has."""
from __future__ import annotations

import contextlib
import inspect
import warnings


def cache_keyword(model) -> str:
    """The keyword of ``model.forward``'s KV cache, which is also its output's field: ``cache`` where the forward
    takes it (transformers 5.24 has it, and warns at the old name), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def loading_quietly(report: bool = True):
    """A ``from_pretrained`` without transformers' own "Loading weights" bar beside memfit's; with ``report`` False its
    load report too (a caller that checks ``output_loading_info`` itself and says what matters). Both restored after."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if not report:
        hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def enable_checkpointing(model) -> None:
    """Turn on transformers' activation checkpointing (non-reentrant) by the name the version has:
    ``activation_checkpointing_enable`` (transformers 5.24 has it, and warns at ``gradient_checkpointing_enable``)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def peft_model(model, config):
    """``peft.get_peft_model(model, config)`` without the FutureWarning peft's own code raises on transformers 5.24 (it
    reads ``is_gradient_checkpointing``, which that version renamed ``is_activation_checkpointing``): every LoRA run
    printed it, and nothing a user can change stops it. Any other warning passes."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)
