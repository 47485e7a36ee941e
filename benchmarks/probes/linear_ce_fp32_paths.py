"""Probe: fused linear cross-entropy in fp32, each of memfit's two paths against torch, at IEEE and TF32 precision.

Why: at torch's default float32 matmul precision ("highest", IEEE) memfit's Triton kernels run their dots as FMAs on
CUDA cores, and a step at Llama-1B's head took 2.17x torch's F.linear + cross_entropy (97.2 against 44.7 ms,
``linear_ce_first_call_ea3eb89.jsonl``). The PyTorch path (``path="reference"``) computes the same chunks of logits
by cuBLAS SGEMMs, N x C fp32 at a time. This measures both paths' time, extra peak memory and error where a user's
fp32 step would run them, so that the op's choice between them rests on a measurement. Two bf16 cases and the
``memfit_chunk2048`` method time the frozen weight's backward step at its former fixed width against the width
``linear_ce._vocab_chunk`` now picks for few loss tokens.

Per case and method: ``ms``, the median forward + backward (``bench_ms``); ``extra_peak_mb``, the peak allocated
memory above the inputs in MiB (gradients included); the relative error of the loss and of each gradient against an
fp64 computation on the GPU.
Usage: ``python benchmarks/probes/linear_ce_fp32_paths.py [--cases ...] [--out FILE]`` (JSON lines)."""
import argparse
import json
from pathlib import Path

from linear_ce_first_call import head_inputs  # this folder: the script's own, first on sys.path

CASES = {   # name: (tokens, hidden, vocab, weight trains, dtype); half the tokens carry a loss
    "llama1b_frozen": (2048, 2048, 128256, False, "float32"),
    "llama1b_trained": (2048, 2048, 128256, True, "float32"),
    "llama3b_frozen": (4096, 3072, 128256, False, "float32"),
    "llama8b_frozen_8k": (8192, 4096, 128256, False, "float32"),
    "llama1b_frozen_bf16": (2048, 2048, 128256, False, "bfloat16"),
    "llama3b_frozen_bf16": (4096, 3072, 128256, False, "bfloat16"),
}
METHODS = {   # name: (memfit path or None for torch, float32 matmul precision, backward vocab chunk or None)
    "memfit_auto": ("auto", "highest", None),      # what a user's fp32 step runs (linear_ce.takes_pytorch_path)
    "memfit_triton": ("triton", "highest", None),
    "memfit_reference": ("reference", "highest", None),
    "torch": (None, "highest", None),
    "memfit_triton_tf32": ("triton", "high", None),
    # the trained weight's width for a frozen one; at 031b9b9 a frozen step was 2048 columns at any loss-token count
    "memfit_triton_tf32_chunk8192": ("triton", "high", 8192),
    "memfit_chunk2048": ("auto", "high", 2048),     # the frozen weight's step width before _vocab_chunk widened it
    "torch_tf32": (None, "high", None),
}


def _exact(h, w, labels):
    """Loss and gradients in fp64 (torch on the GPU), the errors' reference."""
    import torch.nn.functional as F

    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_(w.requires_grad)
    loss = F.cross_entropy(F.linear(h64, w64), labels)
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def _rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def _method(name, h, w, labels, exact) -> dict:
    import torch
    import torch.nn.functional as F

    from memfit.kernels.linear_ce import linear_cross_entropy
    from memfit.measure.timing import bench_ms

    path, precision, chunk = METHODS[name]
    torch.set_float32_matmul_precision(precision)
    if path is None:
        loss_of = lambda: F.cross_entropy(F.linear(h, w).float(), labels)                       # noqa: E731
    else:
        loss_of = lambda: linear_cross_entropy(h, w, labels, path=path, vocab_chunk=chunk)      # noqa: E731

    def step():
        h.grad = w.grad = None
        loss = loss_of()
        loss.backward()
        return loss

    loss = step()                                       # compiles and tunes (the Triton path), then the errors
    row = {"method": name, "float32_matmul_precision": precision, "vocab_chunk": chunk,
           "loss_rel_err": _rel(loss.detach(), exact[0]), "hidden_grad_rel_err": _rel(h.grad, exact[1])}
    if w.requires_grad:
        row["weight_grad_rel_err"] = _rel(w.grad, exact[2])
    del loss
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    row["extra_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    row["ms"] = bench_ms(step)
    h.grad = w.grad = None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    args = parser.parse_args()
    import torch

    from memfit.measure.results import environment

    for case in args.cases:
        tokens, hidden, vocab, weight_trains, dtype = CASES[case]
        h, w, labels = head_inputs(tokens, hidden, vocab, dtype, weight_trains)
        exact = _exact(h, w, labels)
        for name in args.methods:
            line = json.dumps({"case": case, **_method(name, h, w, labels, exact), **environment()})
            print(line, flush=True)
            if args.out:
                with args.out.open("a") as out:
                    out.write(line + "\n")
        del h, w, labels, exact
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
