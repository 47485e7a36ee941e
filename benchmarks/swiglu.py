"""Fused SwiGLU (memfit.kernels.swiglu) against Hugging Face's gated-MLP product, ``act_fn(gate) * up``.

At Llama-3.2-3B's MLP width (8192) and 1024..16384 tokens, bf16 and fp32, each way one training step's share of the
product: forward, then backward from a fixed gradient into gate and up (as the MLP's projections would receive them).
Per case: the time of forward + backward (CUDA events, median), and the peak allocated during it above the inputs and
the incoming gradient (``max_memory_allocated``). Where the host takes longer to issue a step than the GPU to run it,
that time is the host's; so each way is also timed with its steps queued behind a sleep kernel
(memfit.measure.timing.queued_ms): the GPU's time, what a step costs where the host keeps ahead of the GPU, and the
host's time to issue one step, what it costs where the host does not (in the host-bound fine-tuning steps of
results/finetune_steps_ab.json, for one). The fused op is timed on the route an eager call takes (an
autograd.Function) and, for its host time, through its two custom ops, forward and backward (the route before
96de685, and the one compile and dispatch modes take). That peak includes this harness's own tensors, the same in both
(fresh copies of gate and up each step, and their gradients), so it shows a smaller share of the op's saving than a
training step does: benchmarks/finetune_memory.py's fused-SwiGLU row measures it there. At 1K tokens the unfused pair took
about 0.3 ms in either dtype on the H200 (97ff95e) and the fused op 0.55-0.66 ms, 5-21 times what their bytes need,
timed step by step only. The floor is the bytes one pass each way must move
(forward: read gate and up, write the product; backward: read the gradient, gate and up, write both gradients), at the
copy bandwidth measured in this run (memfit.measure.timing.measure_ceilings).

Targets, per case: fused time no more than the unfused pair's, timed both ways (what the planner would need to count
the technique as free; it does not propose it: README's list of techniques says why), and the fused peak below the
unfused one.

    python benchmarks/swiglu.py            # H200: well under a minute
    python benchmarks/swiglu.py --smoke    # CPU, tiny shapes, same code path
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

if "--smoke" in sys.argv:  # before Triton is imported: the kernel runs through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from memfit.kernels import swiglu as swiglu_module  # noqa: E402
from memfit.kernels.swiglu import swiglu, swiglu_reference  # noqa: E402
from memfit.measure.results import check_out_dir, target, write_results  # noqa: E402
from memfit.measure.timing import device_ms, measure_ceilings, queued_ms  # noqa: E402

WIDTH = 8192
TOKENS = (1024, 4096, 16384)
DTYPES = (torch.bfloat16, torch.float32)
OP_PASSES = 8       # tensor passes of the op alone: forward 3 (gate, up in; out), backward 5 (grad, gate, up in; two out)
STEP_PASSES = 12    # what step() adds around it, timed with it: two clones, two multiplies by 1, their backward (4 each)


def step(fn, gate0, up0, grad):
    """One forward and backward of ``fn`` on fresh copies of gate and up (non-leaf, as a projection's outputs)."""
    gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    g, u = gate * 1, up * 1
    fn(g, u).backward(grad)
    return gate.grad, up.grad


@contextlib.contextmanager
def through_the_custom_ops():
    """swiglu's forward and backward through its two custom ops, as every call took before 96de685: its check for
    eager mode (memfit.kernels.dispatch.outside_the_dispatcher, which both look up at each call) answers no."""
    eager_check = swiglu_module.outside_the_dispatcher
    swiglu_module.outside_the_dispatcher = lambda *tensors: False
    try:
        yield
    finally:
        swiglu_module.outside_the_dispatcher = eager_check


def peak_above(fn, gate0, up0, grad, device) -> int:
    """Peak bytes allocated during one step above what is live before it (inputs and gradient)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(fn, gate0, up0, grad)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through the Triton interpreter")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = parser.parse_args()
    check_out_dir(parser, args.out)
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = ((16, 40),) if args.smoke else tuple((t, WIDTH) for t in TOKENS)
    bandwidth = measure_ceilings().bandwidth if device.type == "cuda" else 0.0
    rows, targets = [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in DTYPES:
        for n, w in shapes:
            gate0 = torch.randn(n, w, device=device, dtype=dtype, generator=gen)
            up0 = torch.randn(n, w, device=device, dtype=dtype, generator=gen)
            grad = torch.randn(n, w, device=device, dtype=dtype, generator=gen)
            ref = step(swiglu_reference, gate0.double(), up0.double(), grad.double())
            row = {"dtype": str(dtype), "tokens": n, "width": w}
            for name, fn in (("unfused", swiglu_reference), ("fused", swiglu)):  # the reference is the pair
                grads = step(fn, gate0, up0, grad)
                row[f"{name}_grad_rel_err"] = max(((g.double() - r).norm() / r.norm()).item()
                                                  for g, r in zip(grads, ref, strict=True))
                row[f"{name}_ms"] = device_ms(lambda fn=fn, args=(gate0, up0, grad): step(fn, *args), device)
                row[f"{name}_peak_bytes"] = peak_above(fn, gate0, up0, grad, device)
            if device.type == "cuda":
                for name, fn, route in (("unfused", swiglu_reference, contextlib.nullcontext),
                                        ("fused", swiglu, contextlib.nullcontext),
                                        ("fused_custom_ops", swiglu, through_the_custom_ops)):
                    with route():
                        row[f"{name}_gpu_ms"], row[f"{name}_host_ms"] = queued_ms(
                            lambda fn=fn, args=(gate0, up0, grad): step(fn, *args))
            element = gate0.element_size() * n * w
            row["floor_ms"] = OP_PASSES * element / bandwidth * 1e3 if bandwidth else None
            row["step_floor_ms"] = (OP_PASSES + STEP_PASSES) * element / bandwidth * 1e3 if bandwidth else None
            rows.append(row)
            label = f"{str(dtype).removeprefix('torch.')}, {n} x {w}"
            targets.append(target(f"fused / unfused time, {label}", row["fused_ms"] / row["unfused_ms"], 1.0, "x",
                                  "lower"))
            if device.type == "cuda":
                targets.append(target(f"fused / unfused GPU time, steps queued, {label}",
                                      row["fused_gpu_ms"] / row["unfused_gpu_ms"], 1.0, "x", "lower"))
                targets.append(target(f"fused / unfused peak, {label}",
                                      row["fused_peak_bytes"] / row["unfused_peak_bytes"], 1.0, "x", "lower"))
            print(f"{label}: unfused {row['unfused_ms']:.3f} ms, fused {row['fused_ms']:.3f} ms; peak above inputs "
                  f"{row['unfused_peak_bytes'] / 2**20:.0f} -> {row['fused_peak_bytes'] / 2**20:.0f} MiB")
            if device.type == "cuda":
                print("    queued, GPU / host ms a step: " + ", ".join(
                    f"{name} {row[f'{name}_gpu_ms']:.3f} / {row[f'{name}_host_ms']:.3f}"
                    for name in ("unfused", "fused", "fused_custom_ops")))
    path = write_results("swiglu_smoke" if args.smoke else "swiglu", rows, targets, out_dir=args.out,
                         copy_bandwidth_gbs=bandwidth / 1e9)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
