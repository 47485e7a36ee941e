"""Fused SwiGLU for training: ``silu(gate) * up`` whose backward writes its gradients over its saved inputs.

Why: Hugging Face's gated MLP, ``down(act(gate(x)) * up(x))``, keeps three intermediate-sized tensors for the
backward (gate for the SiLU, the SiLU's output and up for the product) and its backward allocates three more (the
product's two input gradients, then gate's). In an fp32 LoRA step of Llama-3.2-3B at 4K tokens each is 134 MB, and
that backward is where the step peaks once the loss is fused and the layers checkpointed (benchmarks/results/
finetune_ledger.json: the peak at ``1.act_mul``). This op saves gate and up only, and its backward computes both
input gradients in one pass and writes them into gate's and up's own storage (they are not needed after): at that
moment it holds the two saved tensors and the incoming gradient, where the unfused pair holds six.

Kernels: one elementwise pass each way, fp32 arithmetic, one rounding to the tensors' dtype (the unfused pair rounds
the SiLU's output before the product, so results differ from it by rounding only). Off Triton (CPU without the
interpreter) the reference runs with the same saved tensors and the same in-place gradients, through two
temporaries of gate's size in its backward.

Eager calls (:func:`memfit.kernels.dispatch.outside_the_dispatcher`) run the same forward and backward through an
autograd.Function instead of the custom ops, whose calls cost host time that a step issued from Python pays at small
token counts (``benchmarks/swiglu.py`` times both); torch.compile (with a graph break where the inputs are checked,
which needs real tensors), fake tensors, the profiler and memfit's memory trace see the custom ops. That check
also stops torch.export, fullgraph compiles and functorch transforms, on either route.

Layout: the PyTorch reference, the Triton kernels, the forward and backward, the custom ops (fake and autograd
registrations), the eager autograd.Function, then the public function.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from memfit.errors import MemfitError
from memfit.kernels.dispatch import outside_the_dispatcher, triton_importable, use_triton
from memfit.kernels.tangents import refuse_tangents

if triton_importable():
    import triton
    import triton.language as tl

BLOCK = 1024   # elements a program


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The definition: ``silu(gate) * up``, as transformers' gated MLP computes it (two ops, two roundings)."""
    return F.silu(gate) * up


def _backward_reference_(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, write_gate: bool,
                         write_up: bool) -> None:
    """gate <- grad * up * d silu(gate), up <- grad * silu(gate) (each only where wanted), in place, through two
    temporaries of gate's size, in the tensors' dtype: with s = sigmoid(gate), d silu = s (1 + gate - gate s). (s is
    never rebuilt as 1 - (1 - s), which loses a small s entirely in bf16.)"""
    s = torch.sigmoid(gate)
    grad_up_term = grad * up if write_gate else None   # needed before up is overwritten
    if write_up:
        up.copy_(gate).mul_(s).mul_(grad)              # up <- grad * gate * s
    if write_gate:
        gate.addcmul_(gate, s, value=-1).add_(1)       # gate <- 1 + gate - gate s
        gate.mul_(s).mul_(grad_up_term)                # gate <- grad * up * s * (1 + gate - gate s)


if triton_importable():
    @triton.jit
    def _forward_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(grad_ptr, gate_ptr, up_ptr, n, WRITE_GATE: tl.constexpr, WRITE_UP: tl.constexpr,
                         BLOCK: tl.constexpr):
        """gate <- grad * up * d silu(gate) and up <- grad * silu(gate) (each only where its gradient is wanted), each
        element read and written once."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        d = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        if WRITE_UP:
            tl.store(up_ptr + offs, (d * g * s).to(up_ptr.dtype.element_ty), mask=mask)
        if WRITE_GATE:
            tl.store(gate_ptr + offs, (d * u * s * (1.0 + g * (1.0 - s))).to(gate_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def _forward(gate: torch.Tensor, up: torch.Tensor, path: Optional[str]) -> torch.Tensor:
    if not use_triton("swiglu", gate, up, path=path):
        return swiglu_reference(gate, up)
    out = torch.empty_like(gate)
    _forward_kernel[_grid(gate.numel())](gate, up, out, gate.numel(), BLOCK=BLOCK)
    return out


def _backward_(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, write_gate: bool, write_up: bool,
               path: Optional[str]) -> None:
    """gate's and up's gradients written over gate and up (each only where it is wanted: the other keeps its values)."""
    if not use_triton("swiglu", grad, gate, up, path=path):
        _backward_reference_(grad, gate, up, write_gate, write_up)
        return
    _backward_kernel[_grid(gate.numel())](grad, gate, up, gate.numel(), WRITE_GATE=write_gate, WRITE_UP=write_up,
                                          BLOCK=BLOCK)


_swiglu_op = torch.library.custom_op("memfit::swiglu", _forward, mutates_args=())


@_swiglu_op.register_fake
def _(gate, up, path):
    return torch.empty_like(gate)


_swiglu_backward_op = torch.library.custom_op("memfit::swiglu_backward_", _backward_, mutates_args=("gate", "up"))


@_swiglu_backward_op.register_fake
def _(grad, gate, up, write_gate, write_up, path):
    return None


def _backward_outside_the_dispatcher_(grad, gate, up, write_gate, write_up, path) -> None:
    """:func:`_backward_` with what the custom op's mutation adds: the written tensors' versions move on, so a node
    that saved gate or up for its own backward raises instead of reading gradients (the kernel's stores do not move
    them; the reference's in-place ops do, and a second step does no harm). As on the custom op's route, torch does
    not check versions of tensors saved through saved-tensor hooks (non-reentrant checkpointing among them): such a
    node reads the gradients unwarned."""
    _backward_(grad, gate, up, write_gate, write_up, path)
    for t, written in ((gate, write_gate), (up, write_up)):
        if written:
            torch.autograd.graph.increment_version(t)


def _setup_context(ctx, inputs, output):
    gate, up, path = inputs
    ctx.save_for_backward(gate, up)
    ctx.path = path


def _swiglu_grad(ctx, grad):
    if torch.is_grad_enabled():
        raise MemfitError("swiglu has no double backward (create_graph=True): its gradients are written over its "
                          "inputs; use memfit.kernels.swiglu.swiglu_reference where a second derivative is needed")
    gate, up = ctx.saved_tensors
    want_gate, want_up = ctx.needs_input_grad[:2]
    grad = grad.contiguous()
    write = _backward_outside_the_dispatcher_ if outside_the_dispatcher(grad, gate, up) else _swiglu_backward_op
    write(grad, gate, up, want_gate, want_up, ctx.path)
    return gate if want_gate else None, up if want_up else None, None


_swiglu_op.register_autograd(_swiglu_grad, setup_context=_setup_context)


class _EagerSwiglu(torch.autograd.Function):
    """The custom op's forward and backward without its dispatch, for eager calls. Its forward takes ``ctx`` (no
    ``setup_context``): torch binds a ``setup_context`` Function's arguments to its signature by ``inspect`` at
    every call."""

    @staticmethod
    def forward(ctx, gate, up, path):
        _setup_context(ctx, (gate, up, path), None)
        return _forward(gate, up, path)

    backward = staticmethod(_swiglu_grad)


def _owned(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the op may overwrite them in backward (only an input whose gradient is wanted is overwritten):
    a contiguous intermediate (a projection's output) is taken as it is; a strided tensor, or a leaf that wants a
    gradient (a tensor the caller made and holds, a parameter) or a view of one, is copied first, and up is copied
    where it shares storage with gate. A dual input (forward-mode AD) is refused: the op would drop its tangent."""
    refuse_tangents("swiglu", gate, up)
    gate, up = _own(gate), _own(up)
    if gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr():    # swiglu(h, h) or two views of one
        up = up.clone()
    return gate, up


def _own(t: torch.Tensor) -> torch.Tensor:
    caller_holds = t.requires_grad if t.is_leaf else t._is_view() and t._base.is_leaf and t._base.requires_grad
    return t.clone(memory_format=torch.contiguous_format) if caller_holds or not t.is_contiguous() else t


# Under torch.compile _owned runs eagerly (a graph break): a traced graph's inputs do not say what they view, so a
# parameter's view was taken as an intermediate and overwritten with its gradient, storages have no address, and a
# tangent read None.
_owned_eagerly = torch.compiler.disable(_owned)


def swiglu(gate: torch.Tensor, up: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (the gated MLP's product), saving gate and up only and writing their gradients over them
    in backward: it consumes its inputs, whose values are gone once the backward has run (what a projection's output
    in a training step allows; a leaf that wants a gradient, a view of one, or a strided input is copied first, and
    the copy is what is saved and overwritten, and up is copied where it shares memory with gate). gate and up: the
    same shape, dtype and device. Nothing else may keep gate or up for its backward: without saved-tensor hooks
    such an op raises (their versions move), but under them (non-reentrant checkpointing, ``save_on_cpu``) torch
    checks no versions and it reads the gradients, unwarned (a gated MLP's projections feed only this product, as
    in memfit's fine-tuning). No double backward. ``path``: None follows MEMFIT_KERNELS (auto: Triton on CUDA or
    under the interpreter, else the reference, said once), or "auto" | "triton" | "reference"."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise MemfitError(f"swiglu: gate and up must share shape, dtype and device; got {tuple(gate.shape)} "
                          f"{gate.dtype} {gate.device} and {tuple(up.shape)} {up.dtype} {up.device}")
    if not gate.is_floating_point():
        raise MemfitError(f"swiglu: gate and up must be floating point, got {gate.dtype}")
    gate, up = (_owned_eagerly if torch.compiler.is_compiling() else _owned)(gate, up)
    return (_EagerSwiglu.apply if outside_the_dispatcher(gate, up) else _swiglu_op)(gate, up, path)
