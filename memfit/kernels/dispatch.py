"""How an op chooses between its Triton kernel and its PyTorch reference.

The choice is explicit and observable:

* ``MEMFIT_KERNELS=triton`` forces the Triton kernel (on CPU tensors this needs
  ``TRITON_INTERPRET=1``, which is how the tests run kernels without a GPU);
* ``MEMFIT_KERNELS=reference`` forces the reference;
* unset (``auto``): Triton on CUDA tensors or under the interpreter, otherwise the
  reference, and that fallback is logged once per op.

The kernels take float16, bfloat16 and float32 (``TRITON_DTYPES``): a float64 tensor runs the reference in auto mode,
said once, and is refused where the Triton path is forced (the BLR kernels' fp32 accumulators had returned garbage
for it, unsaid).

An op may also take an explicit ``path=`` argument that overrides the environment, and may narrow auto mode further
(``linear_ce.takes_pytorch_path``: fp32 at IEEE precision on CUDA runs its reference, said once).

:func:`outside_the_dispatcher` says when an op's wrapper may run its implementation without its custom op.
"""
from __future__ import annotations

import os

import torch
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode

from memfit.errors import MemfitError
from memfit.log import warn_once

PATHS = ("auto", "triton", "reference")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if interpreting():
    from memfit.kernels import interpreter

    interpreter.apply()


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_mode(op: str, path: str | None = None) -> str:
    """``path``, else env ``MEMFIT_KERNELS``, else ``auto``: one of PATHS."""
    mode = path or os.environ.get("MEMFIT_KERNELS", "auto")
    if mode not in PATHS:
        raise MemfitError(f"kernel path {mode!r} for {op} is not one of {', '.join(PATHS)}")
    return mode


def triton_runnable(device_type: str) -> bool:
    """Whether Triton kernels can run on tensors of ``device_type`` here: CUDA ones, or any under the interpreter."""
    return triton_importable() and (device_type == "cuda" or interpreting())


def use_triton(op: str, *tensors: torch.Tensor, path: str | None = None) -> bool:
    """Decide whether ``op`` runs its Triton kernel on ``tensors``.

    ``path`` (or env ``MEMFIT_KERNELS``) is one of ``auto``, ``triton``, ``reference``; a floating-point tensor of a
    dtype the kernels do not take (``TRITON_DTYPES``) runs the reference in auto mode and is refused in triton mode.
    """
    mode = kernel_mode(op, path)
    if mode == "reference":
        return False
    runnable = triton_runnable("cuda" if all(t.is_cuda for t in tensors) else "cpu")
    other_dtypes = None                # built only for a tensor the kernels do not take: this runs at every op call
    if any(t.is_floating_point() and t.dtype not in TRITON_DTYPES for t in tensors):
        other_dtypes = ", ".join(sorted({str(t.dtype) for t in tensors if t.is_floating_point()
                                         and t.dtype not in TRITON_DTYPES}))
    if mode == "triton":
        if not runnable:
            raise MemfitError(
                f"{op}: the Triton path was forced but cannot run here (needs CUDA tensors, "
                "or TRITON_INTERPRET=1 for CPU tensors, and triton installed)"
            )
        if other_dtypes:
            raise MemfitError(f"{op}: the Triton path was forced, and its kernels take float16, bfloat16 or float32, "
                              f"not {other_dtypes}")
        return True
    if other_dtypes:
        warn_once(f"fallback:{op}:{other_dtypes}", f"{op}: no Triton kernel for {other_dtypes}; running the PyTorch "
                                                    "reference")
        return False
    if not runnable:
        device = tensors[0].device.type if tensors else "?"
        warn_once(f"fallback:{op}:{device}", f"{op}: no Triton kernel on {device}; running the PyTorch reference")
    return runnable


def outside_the_dispatcher(*tensors: torch.Tensor | None) -> bool:
    """Whether an op's wrapper may run the op's implementation itself instead of through its custom op (the same
    functions run): in eager mode, where nothing but autograd needs the dispatcher. Not while torch.compile or export
    traces (the op is opaque to them, with its fake), a dispatch mode is on (fake tensors, a flop counter) or a
    function mode other than a default device (which the implementation, naming its devices, is not affected by),
    a functorch transform runs, the profiler records (its tables name the op), or a tensor is a
    subclass; nor under ``torch.jit.trace``, which would record the ops around the kernels and not the kernels
    (Triton launches are invisible to it). Why: a custom op's call took 17-52 us of host time per BLR layer call on
    the H200's host at 211e095, over the same function called directly (``benchmarks/probes/op_host_cost.py``'s
    op_named and function_named levels)."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._autograd._profiler_enabled()
            or _get_current_dispatch_mode() is not None or torch._C._are_functorch_transforms_active()):
        return False
    if torch._C._is_torch_function_mode_enabled() and not all(
            isinstance(mode, DeviceContext) for mode in torch.overrides._get_current_function_mode_stack()):
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def fp32_matmul_is_ieee() -> bool:
    """Whether torch computes fp32 matmuls in IEEE fp32, its default: not once the user allows TF32, by the per-backend
    setting (``torch.backends.cuda.matmul.fp32_precision``, torch >= 2.9, which the legacy setters set too) or by the
    legacy one (``torch.set_float32_matmul_precision``, ``allow_tf32``). The per-backend setting is read first:
    where the two were mixed, torch's legacy getter can raise, or name another precision than the matmuls run."""
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if setting != "none":
        return setting == "ieee"
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:                  # mixed settings, none of them the matmuls' own: the global one
        return getattr(torch.backends, "fp32_precision", "ieee") != "tf32"


def dot_precision(dtype: torch.dtype, op: str) -> str:
    """``tl.dot``'s input precision for ``op``'s kernels on ``dtype`` inputs.

    fp32 follows torch's float32 matmul precision: IEEE under "highest" (torch's default),
    TF32 once the user allows it for matmuls (``torch.set_float32_matmul_precision("high")``),
    and then said once per op, since TF32 rounds the inputs to 10 mantissa bits. IEEE dots run
    on CUDA cores, over an order of magnitude slower. 16-bit inputs always use the tensor cores.
    """
    if dtype != torch.float32:
        return "tf32"
    if fp32_matmul_is_ieee():
        return "ieee"
    warn_once(f"tf32:{op}", f"{op}: fp32 inputs use TF32 dots, as torch's float32 matmul precision allows "
                            "(set it to 'highest' for IEEE fp32)")
    return "tf32"


def constant_when_compiled(fn):
    """``torch.compiler.assume_constant_result`` without what it costs at import: it imports torch._dynamo (3 s added
    to every memfit command, ``memfit plan`` included, which imports the kernels through the decode path) to
    set one mark on ``fn``, which this sets itself (tests/test_blr_compile.py checks that it is torch's mark)."""
    fn._dynamo_marked_constant = True
    return fn
