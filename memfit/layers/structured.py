"""What every structured (block-low-rank) linear layer shares.

A structured layer replaces ``nn.Linear``'s dense weight W (out x in) by factors with
fewer parameters; ``y = x W^T + bias`` is unchanged as a contract. Subclasses give the
factor shapes (``_factor_shapes``), the projection of a dense weight onto the structure
(``_project``), the dense matrix the factors define (``to_dense``), the forward, and the
parameter and FLOP counts. This base holds the rest: shape checks, rank-by-ratio,
``from_dense``, bias, initialisation and ``extra_repr``.
"""
from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from memfit.errors import MemfitError, is_count


def check_positive(name: str, value) -> int:
    if not is_count(value):
        raise MemfitError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_divisible(what: str, value: int, blocks: int) -> None:
    if value % blocks:
        raise MemfitError(
            f"{what}={value} is not divisible by blocks={blocks}; choose blocks that divide it "
            f"(divisors up to 64: {[d for d in range(1, 65) if value % d == 0]})"
        )


def _check_from_dense_options(cls, options: dict) -> None:
    """``from_dense``'s options: the structure's constructor options (``blocks``, required where the constructor has
    no default for it) and its projection's (BLAST's ``steps``); a missing or unknown one had ended in a TypeError
    from a constructor or ``_project`` the caller never called."""
    ctor = inspect.signature(cls).parameters
    projection = [name for name in inspect.signature(cls._project).parameters if name not in ("self", "weight")]
    if missing := [k for k in cls._ctor_options() if ctor[k].default is inspect.Parameter.empty and k not in options]:
        raise MemfitError(f"{cls.__name__}.from_dense needs {', '.join(f'{k}=' for k in missing)} (e.g. blocks=16: "
                          "blocks per side, dividing in_features and out_features)")
    if unknown := sorted(set(options) - set(cls._ctor_options()) - set(projection)):
        takes = ", ".join(f"{k}=" for k in ("rank", "ratio", *cls._ctor_options(), *projection))
        raise MemfitError(f"{cls.__name__}.from_dense takes no {', '.join(unknown)}; it takes {takes}")


class StructuredLinear(nn.Module):
    """Base of LowRankLinear, MonarchLinear and BlastLinear (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.in_features = check_positive("in_features", in_features)
        self.out_features = check_positive("out_features", out_features)
        self.rank = check_positive("rank", rank)
        factory = {"device": device, "dtype": dtype}
        for name, shape in self._factor_shapes().items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, **factory)))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    # ---- what a structure defines -------------------------------------------------
    def _factor_shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def _project(self, weight: torch.Tensor, **options) -> None:
        """Set the factors to (an approximation of) ``weight`` (out x in, float32)."""
        raise NotImplementedError

    def to_dense(self) -> torch.Tensor:
        raise NotImplementedError

    def flops(self, n_tokens: int) -> int:
        raise NotImplementedError

    @classmethod
    def params_for_rank(cls, in_features: int, out_features: int, rank: int, blocks: int = 1) -> int:
        """Factor parameters (no bias) at ``rank``."""
        return rank * (in_features + out_features)

    # ---- shared ---------------------------------------------------------------------
    def num_params(self) -> int:
        """Parameters of this layer, bias included."""
        return sum(p.numel() for p in self.parameters())

    def dense_params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias is not None else 0)

    def reset_parameters(self) -> None:
        """Random factors whose product has nn.Linear's output scale (variance 1/(3 in)).

        Each factor is drawn N(0, 1/fan) with ``fan`` the dimension it sums over, so every
        stage keeps the activation variance; the last (output) factor adds the 1/3.
        """
        fans = self._init_fans()
        for k, (name, fan) in enumerate(fans.items()):
            last = k == len(fans) - 1
            nn.init.normal_(getattr(self, name), std=(1.0 / (fan * (3 if last else 1))) ** 0.5)
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def _init_fans(self) -> dict[str, int]:
        """Factor name -> summed dimension, input side first, output factor last."""
        raise NotImplementedError

    @classmethod
    def rank_for_ratio(cls, in_features: int, out_features: int, ratio: float, blocks: int = 1) -> int:
        """Largest rank (a multiple of ``rank_multiple``) whose factors hold <= ratio * in * out params."""
        if not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise MemfitError(f"ratio must be a fraction of the dense parameters in (0, 1], got {ratio!r}")
        step = cls.rank_multiple_for(blocks)
        budget = ratio * in_features * out_features
        per_step = cls.params_for_rank(in_features, out_features, step, blocks)
        rank = int(budget // per_step) * step
        if rank < step:
            raise MemfitError(
                f"ratio={ratio} leaves no rank for a {out_features}x{in_features} {cls.__name__} with blocks={blocks}: "
                f"the smallest rank ({step}) needs ratio >= {per_step / (in_features * out_features):.4f}"
            )
        return rank

    @classmethod
    def rank_multiple_for(cls, blocks: int) -> int:
        return 1

    @classmethod
    def from_dense(cls, linear: nn.Linear, rank: int | None = None, ratio: float | None = None, **options):
        """A layer of this structure approximating ``linear`` (an ``nn.Linear``).

        Give exactly one of ``rank`` and ``ratio`` (target fraction of the dense weight's
        parameters). Other options (``blocks``, projection settings) go to the structure.
        The result has ``linear``'s dtype, device and bias.
        """
        if not isinstance(linear, nn.Linear):
            raise MemfitError(f"from_dense needs an nn.Linear, got {type(linear).__name__}")
        if (rank is None) == (ratio is None):
            raise MemfitError(f"give exactly one of rank= and ratio= (got rank={rank!r}, ratio={ratio!r})")
        _check_from_dense_options(cls, options)
        ctor = {k: options.pop(k) for k in cls._ctor_options() if k in options}
        if rank is None:
            rank = cls.rank_for_ratio(linear.in_features, linear.out_features, ratio, ctor.get("blocks", 1))
        weight = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, rank, bias=linear.bias is not None,
                    device=weight.device, dtype=torch.float32, **ctor)
        with torch.no_grad():
            layer._project(weight.float(), **options)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach().float())
        return layer.to(weight.dtype)

    @classmethod
    def _ctor_options(cls) -> tuple[str, ...]:
        return ()

    def _structure_repr(self) -> str:
        return ""

    def extra_repr(self) -> str:
        extra = self._structure_repr()
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"
                f"{', ' + extra if extra else ''}, bias={self.bias is not None}, "
                f"params={self.num_params()} ({self.num_params() / self.dense_params():.1%} of dense)")


# truncated_svd's smallest singular value, relative to the largest, it resolves from the Gram matrix's spectrum: float64
# rounds an eigenvalue of M^T M at about 2e-16 of the largest (times a factor growing with the size), a singular
# value at about its square root, 1.5e-8.
GRAM_SVD_FLOOR = 1e-7


def truncated_svd(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors (A, B) with matrix ~= A @ B^T, singular values split evenly: the truncated SVD's, down to
    singular values of ``GRAM_SVD_FLOOR`` times the largest.

    Works batched over leading dims; rank beyond min(rows, cols) is padded with zeros. In float64, from the
    eigendecomposition of the smaller Gram matrix (``M^T M`` of a tall M), so the product is ``M V V^T`` for the
    Gram's top eigenvectors V. A pair below the floor, where the squared spectrum leaves no digits, comes out as zero
    columns: so a float64 input is fitted as the SVD would only to about 1e-7 of its largest singular value (its
    float32 rounding, for the float32 and bfloat16 weights memfit projects). A full SVD computes every pair of every
    matrix; this computes one symmetric eigendecomposition of the smaller side: on the CPU the Monarch refinement's
    SVDs took a fifth to a third of their time (``benchmarks/probes/monarch_refine_time.py``). On CUDA torch's
    batched eigendecomposition, like its SVD, goes matrix by matrix above 32 columns; on an H100 it still took a third
    of the host's time for the refinement's 128 x 128 Gram batch, copies to the host and back counted
    (``benchmarks/results/probes/monarch_refine_time_af4fc90.json``), so it stays on the device.
    """
    if not bool(matrix.isfinite().all()):             # eigh of NaN does not raise on every device: factors of 0
        raise MemfitError("cannot factor a matrix with non-finite values (inf or NaN)")
    m = matrix.double()
    wide = m.shape[-2] < m.shape[-1]
    tall = m.transpose(-1, -2) if wide else m
    k = min(rank, tall.shape[-1])
    values, vectors = torch.linalg.eigh(tall.transpose(-1, -2) @ tall)          # ascending
    values, vectors = values.flip(-1)[..., :k], vectors.flip(-1)[..., :k]
    root = values.clamp_min(0).sqrt().sqrt()                                     # sqrt of each singular value
    kept = (root.square() > GRAM_SVD_FLOOR * root[..., :1].square()).unsqueeze(-2)
    right = torch.where(kept, vectors * root.unsqueeze(-2), 0)                   # v_i sqrt(s_i)
    left = torch.where(kept, (tall @ vectors) / torch.where(kept, root.unsqueeze(-2), 1), 0)    # u_i sqrt(s_i)
    a, b = (right, left) if wide else (left, right)
    if k < rank:
        pad = [0, rank - k]
        a, b = torch.nn.functional.pad(a, pad), torch.nn.functional.pad(b, pad)
    return a.to(matrix.dtype), b.to(matrix.dtype)
