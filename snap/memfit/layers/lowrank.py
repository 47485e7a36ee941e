"""LowRankLinear: W = U V^T, the plainest structured linear layer.

Parameters U (out, r) and V (in, r): r (in + out) of them; the forward is
``y = (x V) U^T + bias`` (2 N r (in + out) FLOPs) through
:func:`memfit.kernels.lowrank.lowrank_linear`. ``from_dense`` is the truncated SVD,
the best rank-r approximation in Frobenius norm (Eckart-Young).
"""
from __future__ import annotations

import torch

from memfit.kernels.lowrank import lowrank_linear
from memfit.layers.structured import StructuredLinear, truncated_svd


class LowRankLinear(StructuredLinear):
    """``nn.Linear`` replacement with W = U V^T (U: out x r, V: in x r)."""

    def _factor_shapes(self):
        return {"V": (self.in_features, self.rank), "U": (self.out_features, self.rank)}

    def _init_fans(self):
        return {"V": self.in_features, "U": self.rank}

    def _project(self, weight: torch.Tensor) -> None:
        a, b = truncated_svd(weight, self.rank)
        self.U.copy_(a)
        self.V.copy_(b)

    def to_dense(self) -> torch.Tensor:
        return self.U @ self.V.T

    def flops(self, n_tokens: int) -> int:
        return 2 * n_tokens * self.rank * (self.in_features + self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lowrank_linear(x, self.U, self.V, self.bias)
