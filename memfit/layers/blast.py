"""BlastLinear: block (i, j) of W is U_i diag(s_ij) V_j^T (Lee et al. 2024, "BLAST").

b blocks, in = b m, out = b p, rank r. Parameters U (b, p, r) (U_i shared along block
row i), V (b, m, r) (V_j shared along block column j) and S (b, b, r): r (in + out + b^2)
in all. Forward: Z_j = x_j V_j, T_i = sum_j Z_j diag(s_ij), y_i = T_i U_i^T, so
2 N r (in + out) + 2 N b^2 r FLOPs. Unlike Monarch, the rank r is shared by all blocks
(each block has rank <= r) and r need not divide by b.

``from_dense`` is memfit.compress's weight-space projection
(``compress.projection.blast_project``: the paper's preconditioned alternating descent
from the better of a block-SVD and the truncated SVD's start), ``steps`` sweeps (default 100); memfit.compress adds the
activation-aware projection.
"""
from __future__ import annotations

import torch

from memfit.kernels.blast import blast_linear
from memfit.layers.structured import StructuredLinear, check_divisible, check_positive


class BlastLinear(StructuredLinear):
    """``nn.Linear`` replacement with a BLAST weight (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, rank: int, blocks: int, bias: bool = False,
                 device=None, dtype=None) -> None:
        self.blocks = check_positive("blocks", blocks)
        check_divisible("in_features", in_features, blocks)
        check_divisible("out_features", out_features, blocks)
        super().__init__(in_features, out_features, rank, bias, device, dtype)

    @classmethod
    def _ctor_options(cls):
        return ("blocks",)

    @classmethod
    def params_for_rank(cls, in_features, out_features, rank, blocks=1):
        return rank * (in_features + out_features + blocks * blocks)

    def _factor_shapes(self):
        b, r = self.blocks, self.rank
        return {"V": (b, self.in_features // b, r), "S": (b, b, r), "U": (b, self.out_features // b, r)}

    def _init_fans(self):
        return {"V": self.in_features // self.blocks, "S": self.blocks, "U": self.rank}

    def _blocks_of(self, weight: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        return weight.reshape(b, self.out_features // b, b, self.in_features // b).permute(0, 2, 1, 3)

    def to_dense(self) -> torch.Tensor:
        blocks = torch.einsum("ipk,ijk,jmk->ipjm", self.U, self.S, self.V)
        return blocks.reshape(self.out_features, self.in_features)

    def _project(self, weight: torch.Tensor, steps: int = 100) -> None:
        from memfit.compress.projection import blast_project, check_steps  # compress builds on layers: at use

        check_steps(steps)
        u, v, s = blast_project(weight, self.rank, self.blocks, steps=steps)
        self.U.copy_(u)
        self.V.copy_(v)
        self.S.copy_(s)

    def flops(self, n_tokens: int) -> int:
        b, r = self.blocks, self.rank
        return 2 * n_tokens * r * (self.in_features + self.out_features + b * b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blast_linear(x, self.U, self.V, self.S, self.bias)

    def _structure_repr(self) -> str:
        return f"blocks={self.blocks}"
