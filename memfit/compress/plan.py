"""Which linear layers to compress, and at what rank, for a target parameter ratio.

The plan is per projection kind (q_proj ... down_proj): every decoder layer of a
Llama-family model has the same shapes, so one rank per kind serves all layers, and the
same function answers both "what to do to this model" and the ledger's "how many bytes
would it hold" (``compressed_param_count``) from a ModelSpec alone.

``ratio`` is the fraction of the decoder's dense linear parameters that remain. Kinds
left dense count in full. Left dense by default: the k/v projections of a GQA model
(small -- a quarter of q's parameters in Llama-3.2-1B -- and sensitive, so compressing
them saves little), and any kind whose structure at the needed rank would not be
smaller than the dense weight (break-even). The compressed kinds share one parameter
fraction, found by bisection so that the total stays at or under the target.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from memfit.errors import MemfitError, is_count
from memfit.models import ModelSpec, dtype_bytes
from memfit.models.spec import PROJECTIONS

METHODS = ("blast", "monarch", "lowrank")
KINDS = PROJECTIONS

# The ranks the BLR paper (arXiv 2512.20861) uses for Llama-3.2-1B; k/v stay dense.
PAPER_RANKS_LLAMA_1B = {"q_proj": 256, "o_proj": 256, "gate_proj": 512, "up_proj": 768, "down_proj": 768}


def structure_class(method: str):
    """The memfit.layers class of ``method``."""
    from memfit.layers import BlastLinear, LowRankLinear, MonarchLinear

    classes = {"blast": BlastLinear, "monarch": MonarchLinear, "lowrank": LowRankLinear}
    if method not in classes:
        raise MemfitError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    return classes[method]


@dataclass(frozen=True)
class KindPlan:
    """One projection kind: its shape, and its rank (None: kept dense, with the reason)."""

    kind: str
    in_features: int
    out_features: int
    rank: int | None
    params: int          # weight parameters per layer after compression (dense if kept)
    dense_params: int
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def default_skip(shapes: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    """k/v projections when they are narrower than q (GQA)."""
    if "q_proj" in shapes and "k_proj" in shapes and shapes["k_proj"][1] < shapes["q_proj"][1]:
        return ("k_proj", "v_proj")
    return ()


def _check_ranks(ranks: dict[str, int] | None, skip: tuple[str, ...], skip_defaulted: bool) -> None:
    """Explicit ranks: positive integers, for kinds not kept dense (a skipped kind's rank had been ignored, unsaid)."""
    if ranks is None:
        return
    if bad := {k: r for k, r in ranks.items() if not is_count(r)}:
        raise MemfitError(f"ranks must be positive integers, got {bad}")
    if skipped := [k for k in ranks if k in skip]:
        them = "it" if len(skipped) == 1 else "them"
        why = "the default skip keeps the small GQA k/v projections dense" if skip_defaulted else f"skip={skip}"
        raise MemfitError(f"ranks gives {', '.join(skipped)} a rank, and {why}; pass a skip without {them} (e.g. "
                          "skip=() to compress every kind)")


def _check_args(method, ratio, blocks, ranks):
    """The structure class of ``method``, after checking ``blocks`` and (without explicit ``ranks``) ``ratio``."""
    cls = structure_class(method)
    if ranks is None and (not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < 1):
        raise MemfitError(f"ratio must be a fraction of the linear parameters in (0, 1), got {ratio!r}")
    if not is_count(blocks):
        raise MemfitError(f"blocks must be a positive integer, got {blocks!r}")
    return cls


def plan_kinds(shapes: dict[str, tuple[int, int]], method: str, ratio: float | None = 0.5, blocks: int = 16,
               ranks: dict[str, int] | None = None, skip: tuple[str, ...] | None = None,
               skip_option: str | None = "--skip") -> dict[str, KindPlan]:
    """Rank per kind (``shapes``: kind -> (in, out)) for ``ratio``, or the explicit ``ranks``. ``skip_option``: how
    the caller's user names the kinds to keep dense, which the errors suggest (None: they cannot, as in `memfit plan
    --blr`, which plans the default kinds)."""
    cls = _check_args(method, ratio, blocks, ranks)  # before the divisibility test divides by blocks
    blocks = 1 if method == "lowrank" else blocks
    skip_defaulted = skip is None
    skip = default_skip(shapes) if skip_defaulted else tuple(skip)
    unknown = [k for k in (*skip, *(ranks or {})) if k not in shapes]
    if unknown:
        raise MemfitError(f"unknown projection kind(s) {unknown}; the model has {', '.join(shapes)}")
    _check_ranks(ranks, skip, skip_defaulted)
    candidates = [k for k in shapes if k not in skip]
    if not candidates:
        raise MemfitError(f"nothing to compress: every projection kind ({', '.join(shapes)}) is skipped"
                          + (f" ({skip_option})" if skip_option else ""))
    if method != "lowrank":
        for kind in candidates:
            fin, fout = shapes[kind]
            for name, size in (("in_features", fin), ("out_features", fout)):
                if size % blocks:
                    skip_it = f", or skip {kind} ({skip_option} {kind})" if skip_option else ""
                    raise MemfitError(f"{method}: {kind} {name}={size} is not divisible by blocks={blocks}; "
                                      f"pick blocks dividing {fin} and {fout}{skip_it}")

    def plan_at(fraction: float | None) -> dict[str, KindPlan]:
        out = {}
        for kind, (fin, fout) in shapes.items():
            dense = fin * fout
            if kind not in candidates:
                out[kind] = KindPlan(kind, fin, fout, None, dense, dense, "skipped")
                continue
            if ranks is not None:
                if kind not in ranks:
                    out[kind] = KindPlan(kind, fin, fout, None, dense, dense, "no rank given")
                    continue
                rank = ranks[kind]
                if method == "monarch" and rank % blocks:
                    raise MemfitError(f"monarch: rank {rank} for {kind} must be a multiple of blocks={blocks}")
            else:
                rank = _rank_at(cls, fin, fout, fraction, blocks)
            params = cls.params_for_rank(fin, fout, rank, blocks)
            if params >= dense:
                out[kind] = KindPlan(kind, fin, fout, None, dense, dense, f"rank {rank} is past break-even")
            else:
                out[kind] = KindPlan(kind, fin, fout, rank, params, dense)
        return out

    if ranks is not None:
        plan = plan_at(None)
        if all(p.rank is None for p in plan.values()):     # it had returned, and compress replaced no layer, unsaid
            why = "; ".join(f"{k}: {p.reason}" for k, p in plan.items() if k in ranks) or "ranks is empty"
            raise MemfitError(f"nothing to compress: no kind ranks leaves below its dense size ({why})")
        return plan
    total = sum(fin * fout for fin, fout in shapes.values())
    lo, hi, best = 0.0, 1.0, None
    for _ in range(40):  # largest shared fraction whose plan fits ratio * total (its size grows with the fraction)
        mid = (lo + hi) / 2
        plan = plan_at(mid)
        if sum(p.params for p in plan.values()) <= ratio * total:
            lo, best = mid, plan
        else:
            hi = mid
    if best is None or all(p.rank is None for p in best.values()):
        smallest = sum(p.params for p in plan_at(0.0).values()) / total
        kept = sum(shapes[k][0] * shapes[k][1] for k in shapes if k not in candidates) / total
        hint = (f", or compress more kinds (the ones kept dense hold {kept:.1%}: {skip_option} none)"
                if kept and skip_option else "")
        blocked = method != "lowrank"                  # low-rank has no blocks to lower
        raise MemfitError(f"ratio={ratio} is out of reach for {method}{f' with blocks={blocks}' if blocked else ''}: at "
                          f"the smallest ranks the linear layers keep {smallest:.1%} of their parameters; raise the "
                          f"ratio to at least that{', or lower blocks' if blocked else ''}{hint}")
    return best


def _rank_at(cls, fin: int, fout: int, fraction: float, blocks: int) -> int:
    """The largest rank whose factors hold at most ``fraction`` of the dense weight, or the smallest rank where even
    that holds more (so a plan's size only grows with the fraction, which the bisection needs)."""
    step = cls.rank_multiple_for(blocks)
    if cls.params_for_rank(fin, fout, step, blocks) > fraction * fin * fout:
        return step
    return cls.rank_for_ratio(fin, fout, fraction, blocks)


def compressed_param_count(spec: ModelSpec, method: str, ratio: float | None = 0.5, blocks: int = 16,
                           ranks: dict[str, int] | None = None, skip: tuple[str, ...] | None = None) -> dict:
    """Parameter counts of ``spec`` after compression (the ledger's entry point).

    Returns ``{"linear_dense", "linear_compressed", "model_dense", "model_compressed",
    "bytes_dense", "bytes_compressed", "kinds": {kind: KindPlan dict}}``; bytes use the
    spec's dtype. Biases, norms and embeddings are unchanged.
    """
    plan = plan_kinds(spec.linear_shapes(), method, ratio, blocks, ranks, skip)
    linear_dense = spec.num_layers * sum(p.dense_params for p in plan.values())
    linear_new = spec.num_layers * sum(p.params for p in plan.values())
    model_dense = spec.num_params()
    model_new = model_dense - linear_dense + linear_new
    size = dtype_bytes(spec.dtype)
    return {"linear_dense": linear_dense, "linear_compressed": linear_new, "model_dense": model_dense,
            "model_compressed": model_new, "bytes_dense": model_dense * size, "bytes_compressed": model_new * size,
            "kinds": {k: p.to_dict() for k, p in plan.items()}}
