"""Probe: the host time of one Triton launch, by what runs in it, against an ATen launch of the same size (bf16, one
small elementwise kernel, memfit.kernels.swiglu's forward, so the GPU's share is a few microseconds). Eager BLR
prefill and the fused SwiGLU at small token counts were host-bound on the H200's host, and cProfile put most of a BLR
layer call in Triton's ``JITFunction.run`` and ``Autotuner.run`` (``results/probes/op_host_profile_*``). Levels:

    jit             _forward_kernel[grid](...): JITFunction.run (device, stream, binding and specialisation of the
                    arguments, cache key, launch)
    compiled_run    the CompiledKernel that call returned, launched by its own ``run`` (Triton's launcher: a Python
                    wrapper around the C launch; what is left once JITFunction.run's binding, specialisation and
                    cache lookup are skipped)
    aten_mul        torch.mul into a preallocated output (an ATen launch)
    eager_forward   memfit.kernels.swiglu.swiglu under no_grad (the eager route: an autograd.Function)
    op_forward      torch.ops.memfit.swiglu under no_grad (the custom op)
    fused_graph     swiglu(a * 1, b * 1) with a and b wanting gradients: the eager forward with its autograd node
    unfused_graph   silu(a * 1) * (b * 1) the same way (the pair: two ATen launches and nodes)

(the last two, against benchmarks/swiglu.py's host time per step, split a step's host time between forward and
backward).

Checks first that compiled_run's output equals jit's. Writes OUT/triton_launch_cost.json:

    OUT=/some/dir python benchmarks/probes/triton_launch_cost.py
"""
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_host_cost import issue_us  # noqa: E402
from triton import knobs  # noqa: E402

from memfit.kernels import swiglu as swiglu_module  # noqa: E402

ELEMENTS = 4096


@torch.no_grad()
def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, up = (torch.randn(ELEMENTS, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out, out_again = torch.empty_like(gate), torch.empty_like(gate)
    kernel, block = swiglu_module._forward_kernel, swiglu_module.BLOCK
    grid = (triton.cdiv(ELEMENTS, block),)
    compiled = kernel[grid](gate, up, out, ELEMENTS, BLOCK=block)

    def compiled_run(target):
        stream = torch.cuda.current_stream().cuda_stream
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, gate, up, target, ELEMENTS, block)

    compiled_run(out_again)
    torch.cuda.synchronize()
    if not torch.equal(out, out_again):
        raise SystemExit("compiled_run's output differs from jit's: its argument list is not the launcher's")
    calls = {
        "jit": lambda: kernel[grid](gate, up, out, ELEMENTS, BLOCK=block),
        "compiled_run": lambda: compiled_run(out),
        "aten_mul": lambda: torch.mul(gate, up, out=out),
        "eager_forward": lambda: swiglu_module.swiglu(gate, up),
        "op_forward": lambda: torch.ops.memfit.swiglu(gate, up, None),
        "fused_graph": lambda: with_grad(swiglu_module.swiglu),
        "unfused_graph": lambda: with_grad(swiglu_module.swiglu_reference),
    }
    leaves = (gate.clone().requires_grad_(), up.clone().requires_grad_())

    def with_grad(fn):
        with torch.enable_grad():
            return fn(leaves[0] * 1, leaves[1] * 1)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "commit": os.environ.get("MEMFIT_COMMIT"),
              "elements": ELEMENTS, "us": issue_us(calls)}
    (out_dir / "triton_launch_cost.json").write_text(json.dumps(report, indent=1))
    print({label: round(v["issue_us"], 1) for label, v in report["us"].items()})


if __name__ == "__main__":
    main()
