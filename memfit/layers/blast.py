"""BlastLinear: block (i, j) of W is U_i diag(s_ij) V_j^T (Lee et al. 2024, "BLAST").

b blocks, in = b m, out = b p, rank r. Parameters U (b, p, r) (U_i shared along block
row i), V (b, m, r) (V_j shared along block column j) and S (b, b, r): r (in + out + b^2)
in all. Forward: Z_j = x_j V_j, T_i = sum_j Z_j diag(s_ij), y_i = T_i U_i^T, so
2 N r (in + out) + 2 N b^2 r FLOPs. Unlike Monarch, the rank r is shared by all blocks
(each block has rank <= r) and r need not divide by b.

``from_dense`` here is a simple projection: an SVD initialisation (U_i from the block
row's left singular vectors, V_j from the block column's right ones, s_ij the
least-squares diagonal) followed by ``steps`` sweeps of alternating least squares over
U, V and S (each sweep solves its factor exactly with the others fixed, so the error
never rises). memfit.compress offers the paper's preconditioned gradient descent and an
activation-aware projection on top.
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

    def _project(self, weight: torch.Tensor, steps: int = 20) -> None:
        blocks = self._blocks_of(weight)                                   # (i, j, p, m)
        u, v = self._svd_init(weight)
        s = _fit_diagonals(blocks, u, v)
        for _ in range(steps):
            u = _fit_side(blocks, v, s)
            v = _fit_side(blocks.transpose(0, 1).transpose(-1, -2), u, s.transpose(0, 1))
            s = _fit_diagonals(blocks, u, v)
        self.U.copy_(u)
        self.V.copy_(v)
        self.S.copy_(s)

    def _svd_init(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Orthonormal bases of the block rows (for U) and block columns (for V), padded randomly."""
        b, r = self.blocks, self.rank
        rows = weight.reshape(b, self.out_features // b, self.in_features)              # (i, p, in)
        cols = weight.reshape(self.out_features, b, self.in_features // b).transpose(0, 1)  # (j, out, m)
        u = torch.linalg.svd(rows, full_matrices=False)[0]                               # (i, p, k)
        v = torch.linalg.svd(cols, full_matrices=False)[2].transpose(-1, -2)             # (j, m, k)
        return _pad_rank(u, r), _pad_rank(v, r)

    def flops(self, n_tokens: int) -> int:
        b, r = self.blocks, self.rank
        return 2 * n_tokens * r * (self.in_features + self.out_features + b * b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blast_linear(x, self.U, self.V, self.S, self.bias)

    def _structure_repr(self) -> str:
        return f"blocks={self.blocks}"


def _pad_rank(basis: torch.Tensor, rank: int) -> torch.Tensor:
    """First ``rank`` columns of ``basis``, small random columns beyond its width."""
    k = basis.shape[-1]
    if k >= rank:
        return basis[..., :rank].contiguous()
    extra = torch.randn(*basis.shape[:-1], rank - k, dtype=basis.dtype, device=basis.device)
    return torch.cat([basis, 1e-3 * extra / basis.shape[-2] ** 0.5], dim=-1)


def _solve_spd(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """rhs @ gram^-1 for batched symmetric PSD grams, with a small relative ridge."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    ridge = 1e-7 * gram.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).unsqueeze(-1) + 1e-30
    return torch.linalg.solve(gram + ridge * eye, rhs.transpose(-1, -2)).transpose(-1, -2)


def _fit_side(blocks: torch.Tensor, other: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Least-squares U (b, p, r) for blocks[i, j] ~= U_i diag(s_ij) other_j^T."""
    gram = torch.einsum("jmk,jml,ijk,ijl->ikl", other, other, s, s)
    rhs = torch.einsum("ijpm,jmk,ijk->ipk", blocks, other, s)
    return _solve_spd(gram, rhs)


def _fit_diagonals(blocks: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Least-squares s_ij (b, b, r): (U_i^T U_i * V_j^T V_j) s_ij = diag(U_i^T B_ij V_j)."""
    gram = torch.einsum("ipk,ipl->ikl", u, u).unsqueeze(1) * torch.einsum("jmk,jml->jkl", v, v).unsqueeze(0)
    rhs = torch.einsum("ipk,ijpm,jmk->ijk", u, blocks, v)
    return _solve_spd(gram, rhs.unsqueeze(-2)).squeeze(-2)
