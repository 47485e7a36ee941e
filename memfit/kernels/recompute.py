"""The block-low-rank custom ops' backward: recompute the op's reference forward in PyTorch ops and differentiate
it, so the forward saves only x and the weights (no intermediates; not x either where no weight needs a gradient);
the price is one extra forward in the backward. :func:`recomputing` gives the reference path (no Triton kernel) the
same memory behaviour."""
import torch

from memfit.kernels.dispatch import constant_when_compiled
from memfit.log import warn_once


def recompute_backward(reference, n_tensors: int, n_options: int = 0):
    """An autograd ``backward`` for a custom op whose first ``n_tensors`` args are tensors: the reference's gradient,
    recomputed from the saved tensors.

    The forward's ``setup_context`` (:func:`save_for_recompute`) saves those tensors (any
    may be None) and the remaining args in ``ctx.rest``; the reference takes the tensors
    and the first ``n_options`` of the rest (the others, e.g. a kernel variant, are ignored).
    Twice differentiable: where the backward records a graph (``create_graph=True``: a gradient penalty, a
    Hessian-vector product) the recompute runs on the saved tensors as they are, still joined to the forward's
    graph, and keeps its own graph; otherwise on detached copies, keeping nothing. Through 2d431bc it always
    detached, and a second derivative came back wrong (the Triton path) or None (the reference path), unsaid.
    """

    def backward(ctx, grad):
        saved = list(ctx.saved_tensors)
        if ctx.x_like is not None:                     # frozen weights: x was not saved (see save_for_recompute)
            saved[0] = ctx.x_like.expand(ctx.x_shape)
        needs = ctx.needs_input_grad[:n_tensors]
        twice = torch.is_grad_enabled()
        inputs = [t if t is None or (twice and t.requires_grad) else t.detach().requires_grad_(need)
                  for t, need in zip(saved, needs)]
        wanted = [t for t, need in zip(inputs, needs) if t is not None and need]
        grads = iter(())
        if wanted:
            with torch.enable_grad():
                out = reference(*inputs, *ctx.rest[:n_options])
                grads = iter(torch.autograd.grad(out, wanted, grad, create_graph=twice))
        result = [next(grads) if t is not None and need else None for t, need in zip(inputs, needs)]
        return (*result, *([None] * len(ctx.rest)))

    return backward


def recomputing(reference, n_tensors: int, n_options: int = 0):
    """``reference`` as an autograd function with the custom ops' memory behaviour (:func:`save_for_recompute`,
    :func:`recompute_backward`): the path where no Triton kernel runs (CPU). Run as plain autograd, a reference
    kept its intermediates for the backward (z and its copies), which the ledger does not count; run inside a
    custom op, its forward's temporaries were hidden from memfit's first CPU memory tracker, which saw an op as one call.
    Twice differentiable (:func:`recompute_backward`). ``torch.compile`` cannot trace its backward's
    ``autograd.grad`` (it broke the graph in training), so under torch.compile the reference is differentiated as
    it is (:func:`_reference_differentiated_when_compiled`, said once). Where no gradient is wanted (no_grad, or
    no input that requires one) the reference runs as it is: nothing is kept for a backward either way, and
    torch.compile then traces it whole (through the autograd function it broke the graph at every layer, and
    crashed inside dynamo on the low-rank reference)."""
    backward = recompute_backward(reference, n_tensors, n_options)

    class Recomputing(torch.autograd.Function):
        @staticmethod
        def forward(*inputs):
            return reference(*inputs[:n_tensors + n_options])

        @staticmethod
        def setup_context(ctx, inputs, output):
            save_for_recompute(ctx, inputs, output, n_tensors)

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx, grad)

    def run(*inputs):
        wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs[:n_tensors])
        if wanted and not (torch.compiler.is_compiling() and _reference_differentiated_when_compiled()) and not (
                torch._C._are_functorch_transforms_active() and _reference_differentiated_under_transforms()):
            return Recomputing.apply(*inputs)
        return reference(*inputs[:n_tensors + n_options])

    return run


@constant_when_compiled
def _reference_differentiated_when_compiled() -> bool:
    """True, said once: under torch.compile the BLR reference path differentiates the reference as it is, since the
    recomputing autograd function's backward (``autograd.grad``) splits the graph at every layer; what the compiled
    graph keeps for the backward is then torch.compile's choice, not the recompute the ledger counts. torch.compile
    runs this while tracing and keeps the result as a constant, so the warning costs no graph break."""
    warn_once("blr:compiled-reference", "block-low-rank layers on the PyTorch reference path under torch.compile: "
              "the reference is differentiated as it is (torch.compile chooses what to keep for the backward), not "
              "recomputed in the backward as eagerly")
    return True


def _reference_differentiated_under_transforms() -> bool:
    """True, said once: under torch.func transforms (vmap, grad, jvp, hessian) the BLR reference path is
    differentiated as it is, since the recomputing autograd function has no vmap or jvp rule (it raised); what is
    kept for the backward is then autograd's choice, not the recompute the ledger counts."""
    warn_once("blr:transformed-reference", "block-low-rank layers on the PyTorch reference path under torch.func "
              "transforms: the reference is differentiated as it is, not recomputed in the backward")
    return True


def save_for_recompute(ctx, inputs, output, n_tensors: int) -> None:
    """Save the op's tensors for :func:`recompute_backward`, but not x (the first) where no weight needs a gradient
    (a frozen BLR layer under LoRA elsewhere): every BLR reference is linear in x, so the gradient for x does not
    depend on it, and the backward differentiates the reference at x = 0 (one zero element, expanded) instead of
    keeping each layer's input alive from its forward to its backward, as the ledger assumes of a frozen layer."""
    x, weights = inputs[0], inputs[1:n_tensors]
    frozen = not any(ctx.needs_input_grad[1:n_tensors])
    ctx.x_like, ctx.x_shape = (x.new_zeros(()), x.shape) if frozen else (None, None)
    ctx.save_for_backward(None if frozen else x, *weights)
    ctx.rest = tuple(inputs[n_tensors:])
