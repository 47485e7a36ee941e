"""Small BLR op cases shared by the tests of their derivatives (forward mode, second order): each op with its
float64-checkable reference, random tensors (x, factors..., bias) at awkward sizes, and the options both take."""
import torch

from memfit.kernels.blast import blast_linear, blast_linear_reference
from memfit.kernels.lowrank import lowrank_linear, lowrank_linear_reference
from memfit.kernels.monarch import monarch_linear, monarch_linear_reference

B, M, P, T, N = 3, 11, 7, 5, 19     # blocks, block in and out sizes, per-block rank, tokens


def monarch_case(permute_output):
    tensors = (torch.randn(2, N, B * M), torch.randn(B, M, B * T) / M**0.5, torch.randn(B, B * T, P) / T**0.5,
               torch.randn(B * P))
    return monarch_linear, monarch_linear_reference, tensors, {"permute_output": permute_output}


def blast_case():
    r = B * T
    tensors = (torch.randn(2, N, B * M), torch.randn(B, P, r) / r**0.5, torch.randn(B, M, r) / M**0.5,
               torch.randn(B, B, r), torch.randn(B * P))
    return blast_linear, blast_linear_reference, tensors, {}


def lowrank_case():
    tensors = (torch.randn(2, N, B * M), torch.randn(B * P, T) / T**0.5, torch.randn(B * M, T) / M**0.5,
               torch.randn(B * P))
    return lowrank_linear, lowrank_linear_reference, tensors, {}


def on_path(path, name):
    """The op's options for ``path``; on the Triton path the low-rank op is pinned to its Triton kernel (its pick
    off the GPU is the two cuBLAS GEMMs, which would test torch's matmul instead)."""
    return {"path": path, **({"variant": "bgemm"} if path == "triton" and name == "lowrank" else {})}


CASES = {"monarch": lambda: monarch_case(False), "monarch_permuted": lambda: monarch_case(True),
         "blast": blast_case, "lowrank": lowrank_case}
