"""MonarchLinear: W = L P^T R (default) or P L P^T R, L and R block-diagonal (Dao et al. 2022).

Definition (b blocks, in = b m, out = b p, rank r = b t, so t = r/b per block):

* ``w1`` (b, m, r) is R: input block j (features j m ... j m + m - 1) is mapped to
  z_j = x_j w1[j], r values viewed as b groups of t: z_j = (z_j0, ..., z_j,b-1).
* P^T regroups: u_i = (z_0i, z_1i, ..., z_b-1,i), r values.
* ``w2`` (b, r, p) is L: v_i = u_i w2[i], p values, with w2[i]'s rows stored in (s, j) order: row s b + j
  multiplies z_ji[s]. (Any fixed order of the rows is the same family; this one lets cuBLAS run both stages
  of a pipeline with no copy, memfit.kernels.monarch's ``tbmm_tbmm``. Models saved before it are
  converted on load: memfit.compress.io.)
* The output layout. ``permute_output=False`` (the default): output feature i p + s is
  v_i[s] (blocks contiguous, "P-free": W = L P^T R). ``permute_output=True``: the
  paper's P interleaves the blocks, output feature s b + i is v_i[s] (W = P L P^T R).

Why P-free is the default: P is a fixed relabelling of the output features, so the two
forms are the same family up to that relabelling: the best Monarch approximation of W
is P times the best P-free approximation of P^T W, with the same error (``from_dense``
projects P^T W for the permuted form, W itself for the P-free one). Output features of
a projection carry no order of their own, so the P-free form is as good a model (the
errors of the two on one random matrix have the same distribution), and its kernel
stores every output row contiguously, where P's store has a column stride of b
elements (one 2-byte store per sector). :func:`fold_output_permutation` turns a
SwiGLU's permuted gate/up into the P-free form exactly, moving P into the down
projection's weights.

So the (i, j) block of the P-free W (rows i p.., columns j m..) is
``(w1[j][:, i t:(i+1) t] @ w2[i][j::b, :])^T``, of rank t; ``to_dense`` builds
exactly that. Parameters r (in + out); FLOPs 2 N r (in + out). ``from_dense`` is closed
form: the truncated rank-t SVD of each of the b^2 blocks (optimal in Frobenius norm,
since the blocks' factors are disjoint parameters).
"""
from __future__ import annotations

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.kernels.monarch import monarch_linear
from memfit.layers.structured import (
    StructuredLinear,
    check_divisible,
    check_positive,
    truncated_svd,
)


class MonarchLinear(StructuredLinear):
    """``nn.Linear`` replacement with a Monarch weight (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, rank: int, blocks: int, bias: bool = False,
                 permute_output: bool = False, device=None, dtype=None) -> None:
        self.blocks = check_positive("blocks", blocks)
        check_divisible("in_features", in_features, blocks)
        check_divisible("out_features", out_features, blocks)
        if not isinstance(rank, int) or rank < 1 or rank % blocks:
            raise MemfitError(f"Monarch rank={rank!r} must be a positive multiple of blocks={blocks} "
                              f"(per-block rank r/b), e.g. {max(1, rank // blocks if isinstance(rank, int) else 1) * blocks}")
        self.permute_output = bool(permute_output)
        super().__init__(in_features, out_features, rank, bias, device, dtype)

    @classmethod
    def _ctor_options(cls):
        return ("blocks", "permute_output")

    @classmethod
    def rank_multiple_for(cls, blocks: int) -> int:
        return blocks

    def _factor_shapes(self):
        b = self.blocks
        return {"w1": (b, self.in_features // b, self.rank), "w2": (b, self.rank, self.out_features // b)}

    def _init_fans(self):
        return {"w1": self.in_features // self.blocks, "w2": self.rank}

    def _unpermute_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """P^T W: rows from the layer's output order to blocks-contiguous order."""
        if not self.permute_output:
            return weight
        b, p = self.blocks, self.out_features // self.blocks
        return weight.reshape(p, b, -1).transpose(0, 1).reshape(self.out_features, -1)

    def to_dense(self) -> torch.Tensor:
        b, r = self.blocks, self.rank
        m, p, t = self.in_features // b, self.out_features // b, r // b
        w1 = self.w1.reshape(b, m, b, t)                        # [j, a, i, s]
        w2 = self.w2.reshape(b, t, b, p)                        # [i, s, j, c]
        blocks = torch.einsum("jais,isjc->icja", w1, w2)        # block (i, j) is (p x m)
        dense = blocks.reshape(self.out_features, self.in_features)
        if self.permute_output:                                 # row i p + c -> c b + i
            dense = dense.reshape(b, p, -1).transpose(0, 1).reshape(self.out_features, -1)
        return dense

    def _project(self, weight: torch.Tensor) -> None:
        b, r = self.blocks, self.rank
        m, p, t = self.in_features // b, self.out_features // b, r // b
        blocks = self._unpermute_rows(weight).reshape(b, p, b, m).permute(0, 2, 1, 3)  # (i, j, p, m)
        self.set_factors(*truncated_svd(blocks, t))            # block ~= left @ right^T

    @torch.no_grad()
    def set_factors(self, left: torch.Tensor, right: torch.Tensor) -> None:
        """Set w1 and w2 from each block's factors: block (i, j) of the P-free W = left[i, j] @ right[i, j]^T, left
        (b, b, p, t) and right (b, b, m, t) indexed [i, j]."""
        b, r = self.blocks, self.rank
        m, p = self.in_features // b, self.out_features // b
        want = {"left": (b, b, p, r // b), "right": (b, b, m, r // b)}
        if (got := {"left": tuple(left.shape), "right": tuple(right.shape)}) != want:
            raise MemfitError(f"MonarchLinear.set_factors: factors of shapes {got}; this layer takes {want}")
        self.w1.copy_(right.permute(1, 2, 0, 3).reshape(b, m, r))        # w1[j][:, i t + s] = right[i, j][:, s]
        self.w2.copy_(left.permute(0, 3, 1, 2).reshape(b, r, p))         # w2[i][s b + j, :] = left[i, j][:, s]

    def flops(self, n_tokens: int) -> int:
        return 2 * n_tokens * self.rank * (self.in_features + self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return monarch_linear(x, self.w1, self.w2, self.bias, self.permute_output)

    def _structure_repr(self) -> str:
        return f"blocks={self.blocks}, permute_output={self.permute_output}"


def output_permutation(layer: MonarchLinear) -> torch.Tensor:
    """perm with y_paper[..., k] == y_contiguous[..., perm[k]] (the P of the definition)."""
    b, p = layer.blocks, layer.out_features // layer.blocks
    return torch.arange(layer.out_features).reshape(b, p).T.reshape(-1)


@torch.no_grad()
def fold_output_permutation(producers: list[MonarchLinear], consumer: nn.Module) -> None:
    """Drop P from ``producers`` (e.g. gate and up) and fold it into ``consumer`` (down).

    Valid when the producers' outputs meet only through element-wise ops (SwiGLU:
    act(gate) * up) before ``consumer``: every producer then writes its blocks
    contiguously (no interleaved store) and the consumer reads the same values through
    permuted input columns. The consumer must take arbitrary input permutations in its
    weights: ``nn.Linear`` or LowRankLinear (block structures would break). In place.
    """
    from memfit.layers.lowrank import LowRankLinear

    if not producers or not all(isinstance(p, MonarchLinear) for p in producers):
        raise MemfitError("fold_output_permutation needs a non-empty list of MonarchLinear producers")
    if len({(p.out_features, p.blocks, p.permute_output) for p in producers}) != 1:
        raise MemfitError("producers must share out_features, blocks and permute_output to be folded together")
    if not producers[0].permute_output:
        raise MemfitError("the producers' output permutation is already folded (permute_output=False)")
    if isinstance(consumer, nn.Linear):
        columns = consumer.weight
    elif isinstance(consumer, LowRankLinear):
        columns = consumer.V.T
    else:
        raise MemfitError(f"cannot fold a permutation into {type(consumer).__name__}'s input; "
                          "use nn.Linear or LowRankLinear as the consumer")
    if columns.shape[1] != producers[0].out_features:
        raise MemfitError(f"consumer takes {columns.shape[1]} inputs, producers give {producers[0].out_features}")
    perm = output_permutation(producers[0]).to(columns.device)
    # consumer(y_paper) = W y_paper = W[:, k] y_contig[perm[k]]: column perm[k] of the new W is W[:, k]
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    columns.copy_(columns[:, inverse].clone())
    for layer in producers:
        if layer.bias is not None:
            layer.bias.copy_(layer.bias[inverse].clone())
        layer.permute_output = False
