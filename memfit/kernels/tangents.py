"""Forward-mode AD (``torch.autograd.forward_ad``) through memfit's ops.

A Triton kernel sees only the primal of a dual tensor, and a torch custom op drops the tangent where no gradient is
recorded (and raises where one is), so without this a BLR layer called on a dual input, on its Triton path, returned
an output with no tangent and said nothing: ``torch.func.jvp`` (which opens the same dual levels) read a zero
tangent. The BLR ops are linear in x and in each weight factor separately, so their tangent is the op itself, called
once per input that carries one with that input's tangent in its place (:func:`carries_tangents`). The fused
SwiGLU, whose backward overwrites its inputs, refuses dual inputs (:func:`refuse_tangents`).
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch.autograd import forward_ad

from memfit.errors import MemfitError


def _dual_level_open() -> bool:
    """Whether a ``forward_ad.dual_level`` is open (only then can a tensor carry a tangent). A module global of
    torch's, read at every op call: the check costs one attribute lookup where forward-mode AD is not in use."""
    return forward_ad._current_level >= 0


def _tangent(value) -> torch.Tensor | None:
    return forward_ad.unpack_dual(value).tangent if isinstance(value, torch.Tensor) else None


def carries_tangents(op):
    """``op`` (a BLR op's wrapper, ``op(x, *factors, bias=None, *options)``: linear in x and in each factor, plus a
    bias) with forward-mode AD: on inputs carrying tangents, the output carries
    ``sum_k op(.., t_k, ..)`` (every other tensor at its primal, the bias left out) plus the bias's tangent, the
    exact derivative of a multilinear map, each term computed by the op itself (its kernels, its pick)."""
    signature = inspect.signature(op)

    @functools.wraps(op)
    def with_tangents(*args, **kwargs):
        if not _dual_level_open():
            return op(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        tangents = {name: t for name, value in bound.arguments.items() if (t := _tangent(value)) is not None}
        if not tangents:
            return op(*args, **kwargs)
        primals = {name: forward_ad.unpack_dual(value).primal if isinstance(value, torch.Tensor) else value
                   for name, value in bound.arguments.items()}
        out = op(**primals)
        tangent = torch.zeros_like(out)
        for name, t in tangents.items():
            tangent = tangent + (t.to(out.dtype) if name == "bias" else op(**{**primals, name: t, "bias": None}))
        return forward_ad.make_dual(out, tangent)

    return with_tangents


def refuse_tangents(op: str, *tensors: torch.Tensor) -> None:
    """Raise where any of ``tensors`` carries a forward-mode AD tangent, which ``op`` would drop."""
    if _dual_level_open() and any(_tangent(t) is not None for t in tensors):
        raise MemfitError(f"{op} does not carry forward-mode AD tangents (torch.autograd.forward_ad); use its "
                          "PyTorch reference where a jvp is needed")
