"""Fixes for two Triton 3.6 interpreter bugs (``TRITON_INTERPRET=1``, the CPU test path only).

* Interpreter scalars are 1-element arrays whose ``__index__`` calls ``int()`` on them,
  which numpy >= 2.4 refuses, so ``range(lo, hi)`` with computed bounds fails:
  ``__index__`` is re-registered through ``.reshape(-1)[0]``.
* ``tl.dot`` on bfloat16 multiplies the raw uint16 bit patterns: bf16 operands are
  widened to float32 first (exact).

``apply()`` is idempotent; ``memfit.kernels.dispatch`` calls it on import when interpreting,
so every kernel module gets the fixes before its first launch.
"""
from __future__ import annotations


def apply() -> None:
    try:
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    original = interp._patch_lang_tensor
    if getattr(original, "memfit_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.memfit_fixed = True
    interp._patch_lang_tensor = patched

    create_dot = interp.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype == tl.bfloat16:
            return interp.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return handle

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = dot
