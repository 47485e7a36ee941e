"""Probe: where the fused SwiGLU's host time in a training step goes, on a GPU (bf16, a small tensor, so the host
sets the pace). ``benchmarks/swiglu.py`` measured the host issuing a fused step in 0.46-0.74 ms against 0.25-0.50 for
the unfused pair (732a4bd), and ``triton_launch_cost.py`` put the fused forward with its autograd node at 63.8 us
against 35.5 for the pair (57f53fe): most of the difference is in the backward, which runs on autograd's device
thread, where cProfile does not look. Levels, each benchmarks/swiglu.py's ``step`` (fresh copies of gate and up,
``* 1`` so they are not leaves, forward, backward from a fixed gradient):

    unfused_step        silu(gate) * up: two ATen ops and their C++ autograd nodes
    fused_step          memfit.kernels.swiglu.swiglu, the eager route (an autograd.Function)
    fused_custom_ops    the same through its two custom ops (benchmarks/swiglu.py's through_the_custom_ops)
    aten_mul_step       gate * up: one ATen op and its C++ node
    python_mul_step     gate * up through a Python autograd.Function whose forward and backward are ATen muls: what a
                        Python node costs against a C++ one, each way, with no Triton launch
    fused_no_triton     fused_step with its two Triton launches (``_forward``, ``_backward_``) replaced by one ATen
                        mul and nothing: the eager route's own Python and autograd node
    forward_launch      ``_forward(gate, up)`` alone, no autograd (its path check, output allocation, Triton launch)
    backward_launch     ``_backward_`` alone, on scratch copies (its path check and Triton launch)
    aten_silu, aten_mul one ATen launch each, for scale

and, for fused_step, the time spent inside its Python pieces, measured around them with ``perf_counter`` on whichever
thread runs them: the forward's and the backward's Python (``_EagerSwiglu.forward``, ``_swiglu_grad``) and the Triton
launches within them (``_forward``, ``_backward_``). Writes OUT/swiglu_step_host.json:

    OUT=/some/dir python benchmarks/probes/swiglu_step_host.py
"""
import contextlib
import functools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_host_cost import issue_us  # noqa: E402

from benchmarks.swiglu import step, through_the_custom_ops  # noqa: E402
from memfit.kernels import swiglu as swiglu_module  # noqa: E402

ELEMENTS = 4096
CALLS = 200
# The host's pace drifted within the run at 81489bb: every level's last of five rounds read 16-33% below its first.
ROUNDS = 9


class _PythonMul(torch.autograd.Function):
    """gate * up with a Python node each way and ATen's muls inside."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return gate * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return grad * up, grad * gate


@contextlib.contextmanager
def without_triton_launches():
    """swiglu's eager route with its forward computing ``gate * up`` in one ATen launch and its backward writing
    nothing: what is left is its own Python and its autograd node."""
    forward, backward = swiglu_module._forward, swiglu_module._backward_
    swiglu_module._forward = lambda gate, up, path: torch.mul(gate, up)
    swiglu_module._backward_ = lambda *args: None
    try:
        yield
    finally:
        swiglu_module._forward, swiglu_module._backward_ = forward, backward


def timed_inside(names: list[str]) -> dict:
    """Wrap each of swiglu_module's functions ``names`` (and the eager Function's forward and backward) so the time
    inside them adds up per name; returns the totals and call counts, live."""
    totals = defaultdict(lambda: [0.0, 0])

    def wrap(label, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label][0] += time.perf_counter() - start
                totals[label][1] += 1
        return timed

    for name in names:
        setattr(swiglu_module, name, wrap(name, getattr(swiglu_module, name)))
    eager = swiglu_module._EagerSwiglu
    eager.forward = staticmethod(wrap("_EagerSwiglu.forward", eager.forward))
    eager.backward = staticmethod(wrap("_swiglu_grad", eager.backward))
    return totals


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, up, grad = (torch.randn(ELEMENTS, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    args = (gate, up, grad)

    def custom_ops_step():
        with through_the_custom_ops():
            return step(swiglu_module.swiglu, *args)

    def no_triton_step():
        with without_triton_launches():
            return step(swiglu_module.swiglu, *args)

    scratch_gate, scratch_up = gate.clone(), up.clone()
    calls = {
        "unfused_step": lambda: step(swiglu_module.swiglu_reference, *args),
        "fused_step": lambda: step(swiglu_module.swiglu, *args),
        "fused_custom_ops": custom_ops_step,
        "aten_mul_step": lambda: step(torch.mul, *args),
        "python_mul_step": lambda: step(_PythonMul.apply, *args),
        "fused_no_triton": no_triton_step,
        "forward_launch": lambda: swiglu_module._forward(gate, up, None),
        "backward_launch": lambda: swiglu_module._backward_(grad, scratch_gate, scratch_up, True, True, None),
        "aten_silu": lambda: torch.nn.functional.silu(gate),
        "aten_mul": lambda: torch.mul(gate, up),
    }
    us = issue_us(calls, rounds=ROUNDS, count=CALLS)
    totals = timed_inside(["_forward", "_backward_"])
    for _ in range(20):
        step(swiglu_module.swiglu, *args)                              # warm the wrappers
    totals.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        step(swiglu_module.swiglu, *args)
    wrapped_step_us = 1e6 * (time.perf_counter() - start) / CALLS
    torch.cuda.synchronize()
    inside = {label: {"us_per_call": 1e6 * total / count, "calls_per_step": count / CALLS}
              for label, (total, count) in totals.items()}
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("MEMFIT_COMMIT"), "elements": ELEMENTS, "us": us,
              "fused_step_wrapped_us": wrapped_step_us, "fused_step_inside_us": inside}
    (out_dir / "swiglu_step_host.json").write_text(json.dumps(report, indent=1))
    print({label: round(v["issue_us"], 1) for label, v in us.items()})
    print(f"wrapped fused step {wrapped_step_us:.1f} us;",
          {label: round(v["us_per_call"], 1) for label, v in inside.items()})


if __name__ == "__main__":
    main()
