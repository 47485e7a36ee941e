"""Drop-in nn.Modules built on memfit's kernels."""
from memfit.layers.blast import BlastLinear
from memfit.layers.lowrank import LowRankLinear
from memfit.layers.monarch import MonarchLinear, fold_output_permutation
from memfit.layers.structured import StructuredLinear

__all__ = ["BlastLinear", "LowRankLinear", "MonarchLinear", "StructuredLinear", "fold_output_permutation"]
