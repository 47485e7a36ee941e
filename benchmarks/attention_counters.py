"""Hardware counters for the attention study: run under Nsight Compute (ncu).

Each fused recompute+backward variant (and the separate two-pass backward) runs once,
after warm-up and autotuning, between cudaProfilerStart/Stop, so that

    ncu --clock-control none --profile-from-start off --csv \
        --metrics gpu__time_duration.sum,dram__bytes.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
        python benchmarks/attention_counters.py > counters.csv

profiles exactly one launch set per variant. Kernel launches are tagged by NVTX-free
ordering: the script prints the order of the variants to stderr.
"""
from __future__ import annotations

import argparse
import sys

import torch

from memfit.kernels.attention import VARIANTS, attention, attention_recompute_backward


def main(argv=None) -> int:
    """Parse the command line first (--help needs no GPU), then profile each variant once; 2 without a CUDA GPU."""
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_counters: needs a CUDA GPU (and ncu, see --help)", file=sys.stderr)
        return 2
    b, h, n, d = 4, 32, 4096, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    runs = {f"fused[{var}]": (lambda var=var: attention_recompute_backward(q, k, v, do, backward=var)) for var in VARIANTS}

    def separate():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(attention(*leaves, backward="two_pass"), leaves, do)

    runs["separate[two_pass]"] = separate
    for fn in runs.values():  # compile and autotune outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in runs.items():
        print(name, file=sys.stderr, flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
