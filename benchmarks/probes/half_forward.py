"""Probe: one forward of the tiny preset in float32, bfloat16 and float16, on the CPU and (where there is one) on
CUDA, and one bf16/fp16 CPU matmul against float64 on the same rounded inputs.

Why: tests/test_finetune_resume.py's half-precision output-head test compares three training losses in bf16 and
fp16 with float32's. It passes on the development machine's CPU and failed on the H200 host's CPU (torch 2.11),
already at the first step, before any update, fused loss or not. This prints what a plain forward gives there.
Usage: ``python benchmarks/probes/half_forward.py`` (the output goes to stdout)."""
import torch

from memfit.models import PRESETS, build_model


def main() -> None:
    print("torch", torch.__version__, "cpu capability", torch.backends.cpu.get_cpu_capability())
    ids = torch.randint(0, 259, (2, 64), generator=torch.Generator().manual_seed(0))
    for device in ("cpu",) + (("cuda",) if torch.cuda.is_available() else ()):
        losses = {}
        for dtype in ("float32", "bfloat16", "float16"):
            model = build_model(PRESETS["tiny"], dtype=dtype, device=device)
            with torch.no_grad():
                losses[dtype] = float(model(input_ids=ids.to(device), labels=ids.to(device)).loss)
        print(device, "first-step loss of a fresh model:", losses)
    a = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    b = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.bfloat16, torch.float16):
        got = (a.to(dtype) @ b.to(dtype)).double()
        exact = a.to(dtype).double() @ b.to(dtype).double()
        print(dtype, "CPU matmul against float64 on its rounded inputs, max error / max value:",
              float((got - exact).abs().max() / exact.abs().max()))


if __name__ == "__main__":
    main()
