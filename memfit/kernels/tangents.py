"""Forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``) through memfit's ops.

A Triton kernel sees only the primal of a dual tensor, and a torch custom op drops the tangent where no gradient is
recorded (and raises where one is), so without this a BLR layer called on a dual input, on its Triton path, returned
an output with no tangent and said nothing: ``torch.func.jvp`` (which opens the same dual levels) read a zero
tangent. The BLR ops are linear in x and in each weight factor separately, so their tangent is the op itself, called
once per input that carries one with that input's tangent in its place (:func:`carries_tangents`). That reads one
level of tangents: where jvps nest, or a vmap runs inside a jvp, the op takes its PyTorch reference path, which
torch's transforms differentiate as they do any PyTorch code (said once). The fused SwiGLU, whose backward
overwrites its inputs, refuses dual inputs (:func:`refuse_tangents`).
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad

from memfit.errors import MemfitError
from memfit.log import warn_once


def _dual_level_open() -> bool:
    """Whether a dual level is open (forward_ad's, or the one ``torch.func.jvp`` opens): only then can a tensor carry
    a tangent. A module global of torch's, read at every op call, so the ops' cost where forward-mode AD is not in
    use is this call and the wrapper's frame (under a microsecond on a CPU, next to an op's launches)."""
    return forward_ad._current_level >= 0


def _one_level_of_tangents() -> bool:
    """Whether ``forward_ad.unpack_dual`` reads every tangent an op's inputs carry: no torch.func transform is
    active, or the innermost is the only jvp (vmaps outside it are fine). Nested jvps hide the outer tangents from
    it, and it has no batching rule for a vmap inside a jvp. Reads torch's functorch interpreter stack (private:
    ``torch._functorch.pyfunctorch``), outermost first."""
    transforms = [interpreter.key() for interpreter in retrieve_all_functorch_interpreters()]
    return not transforms or (transforms[-1] == TransformType.Jvp and transforms.count(TransformType.Jvp) == 1)


def _tangent(value) -> torch.Tensor | None:
    return forward_ad.unpack_dual(value).tangent if isinstance(value, torch.Tensor) else None


def carries_tangents(op):
    """``op`` (a BLR op's wrapper, ``op(x, *factors, bias=None, *options, path=None, variant="auto")``: linear in x
    and in each factor, plus a bias) with forward-mode AD: on inputs carrying tangents, the output carries
    ``sum_k op(.., t_k, ..)`` (every other tensor at its primal, the bias left out, t_k in its primal's dtype) plus
    the bias's tangent (in the output's dtype), the exact derivative of a multilinear map, each term computed by the
    op itself (its kernels, its pick). Where that reads too little (nested jvps, a vmap inside a jvp:
    :func:`_one_level_of_tangents`) it runs ``op`` on its reference path. Under torch.compile the dual-level branch
    runs eagerly (a graph break): traced, the tangent read None and the output had none. It is wrapped by
    ``torch.compiler.disable`` there and then, not at import: that imports torch._dynamo, 3 s added to every memfit
    command (see :func:`memfit.kernels.dispatch.constant_when_compiled`)."""
    signature = inspect.signature(op)

    def with_dual_level_open(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if not _one_level_of_tangents():
            warn_once("tangents:nested", f"{op.__name__}: forward-mode AD nested in another jvp, or around a vmap: "
                      "the PyTorch reference path, which torch's transforms differentiate (memfit's kernels carry "
                      "one level of tangents)")
            return op(**{**bound.arguments, "path": "reference", "variant": "auto"})
        tangents = {name: t for name, value in bound.arguments.items() if (t := _tangent(value)) is not None}
        if not tangents:
            return op(*args, **kwargs)
        primals = {name: forward_ad.unpack_dual(value).primal if isinstance(value, torch.Tensor) else value
                   for name, value in bound.arguments.items()}
        out = op(**primals)
        terms = [t.to(out.dtype) if name == "bias" else op(**{**primals, name: t.to(primals[name].dtype), "bias": None})
                 for name, t in tangents.items()]
        return forward_ad.make_dual(out, sum(terms[1:], terms[0]).expand_as(out))     # a bias's alone: broadcast

    @functools.wraps(op)
    def with_tangents(*args, **kwargs):
        if not _dual_level_open():
            return op(*args, **kwargs)
        if torch.compiler.is_compiling():
            return torch.compiler.disable(with_dual_level_open)(*args, **kwargs)
        return with_dual_level_open(*args, **kwargs)

    return with_tangents


def refuse_tangents(op: str, *tensors: torch.Tensor) -> None:
    """Raise where any of ``tensors`` carries a forward-mode AD tangent, which ``op`` would drop (at any jvp level);
    where tangents cannot all be read (nested jvps, a vmap inside a dual level or jvp) it raises whether or not they
    carry one."""
    if _dual_level_open() and (not _one_level_of_tangents() or any(_tangent(t) is not None for t in tensors)):
        raise MemfitError(f"{op} does not carry forward-mode AD tangents (torch.autograd.forward_ad, torch.func.jvp); "
                          "use its PyTorch reference where a jvp is needed")
