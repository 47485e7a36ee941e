"""Probe: how long the first fused linear cross-entropy call (forward + backward) takes in a process whose Triton
cache is empty, against later calls at the same shape (median of five) and torch's F.linear + F.cross_entropy
(median of five, after one), and how many kernel binaries the first call compiled.

Why: on the H200 under ``MEMFIT_TEST_DEVICE=cuda`` a tiny fp16 training test (tests/test_finetune_resume.py) spent
its whole 200 s limit in ptxas, and test_finetune.py's fused-loss test did not finish in 100 s alone on a fresh
machine: the kernels autotune over their tile configurations, and each configuration is a compile. This measures
what a user's first step pays. Each case runs in a child process with a Triton cache of its own.
Usage: ``python benchmarks/probes/linear_ce_first_call.py [--out FILE]`` (JSON lines on stdout, and in FILE)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {   # name: (tokens, hidden, vocab, dtype, weight trains)
    "tiny_fp32": (128, 64, 512, "float32", True),
    "llama3b_bf16_lora": (4096, 3072, 128256, "bfloat16", False),
    "llama1b_fp32_lora": (2048, 2048, 128256, "float32", False),   # IEEE fp32: torch's default matmul precision
}


def _seconds(step) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def head_inputs(tokens: int, hidden: int, vocab: int, dtype: str, weight_trains: bool):
    """(hidden states, output-head weight, labels) on the GPU, seeded: N(0, 1) states, a weight of std 1/sqrt(hidden)
    (logits of unit spread), half the tokens without a loss, as in a chat batch."""
    import torch

    dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=dtype, generator=gen) / hidden ** 0.5).requires_grad_(weight_trains)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    labels[::2] = -100
    return h, w, labels


def _case(name: str) -> dict:
    import torch
    import torch.nn.functional as F

    from memfit.kernels.linear_ce import linear_cross_entropy

    h, w, labels = head_inputs(*CASES[name])
    fused = _seconds(lambda: linear_cross_entropy(h, w, labels).backward())
    cubins = sum(1 for _ in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))
    later = statistics.median(_seconds(lambda: linear_cross_entropy(h, w, labels).backward()) for _ in range(5))
    torch_step = lambda: F.cross_entropy(F.linear(h, w).float(), labels).backward()   # noqa: E731
    torch_step()
    reference = statistics.median(_seconds(torch_step) for _ in range(5))
    return {"case": name, "first_call_s": fused, "later_call_s": later, "torch_reference_s": reference,
            "kernel_binaries": cubins, "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)   # the child's side
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case)))
        return
    for name in args.cases:
        with tempfile.TemporaryDirectory() as cache:
            child = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True,
                                   env={**os.environ, "TRITON_CACHE_DIR": cache})
        line = child.stdout.strip().splitlines()[-1] if child.returncode == 0 else json.dumps(
            {"case": name, "error": child.stderr.strip().splitlines()[-1:]})
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write(line + "\n")


if __name__ == "__main__":
    main()
