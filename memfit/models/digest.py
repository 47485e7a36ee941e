"""A digest of model weights that costs nothing at 8B: whether a run that continues an interrupted one (``memfit
finetune --resume``, ``memfit compress`` run again) has the same weights under it."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

SAMPLE = 16             # values from each end of a weight that the digest reads


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of each tensor's name, shape and first and last SAMPLE values (and of a 4-bit weight's block scales,
    which its packed codes do not change with). A sample, not every value: another model of the same shapes, or the
    same one trained further, differs there too."""
    digest = hashlib.sha256()
    for name, param in named:
        digest.update(f"{name}{tuple(param.shape)}".encode())
        state = getattr(param, "quant_state", None)          # bitsandbytes' Params4bit
        for values in (param, getattr(state, "absmax", None)):
            if values is not None:
                flat = values.detach().reshape(-1)
                sample = torch.cat([flat[:SAMPLE], flat[-SAMPLE:]]).to("cpu", torch.float64)
                digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]
