"""Roofline model of the structured linear layers: FLOPs and bytes moved, and the plot.

``layer_cost(kind, variant, n, in, out, rank, blocks)`` gives (FLOPs, bytes) of
``y = x W^T`` for N tokens with W dense, low-rank, Monarch or BLAST, by kernel variant:

* ``ideal``: every intermediate on chip; bytes = x + weights + y (read/written once).
  This is the floor a kernel is held against (``Ceilings.floor_ms``).
* ``fused``: the least a multi-token pipeline of memfit's moves. Monarch's two GEMMs write
  z once, already in P^T order, and read it once (+2 N b r; the single fused kernel is
  offered only at N <= 128); BLAST's fused kernel (``xvmix_bmm``) writes and reads T once
  (+2 N b r), but its timed pick is one of the three-kernel pipelines at nearly every
  shape (memfit/kernels/blast.py), which move ``unfused``'s Z and T; low-rank's is two
  cuBLAS GEMMs (+2 N r for z).
* ``unfused``: one GEMM per stage, each intermediate written and read once
  (low-rank +2 N r; Monarch +2 N b r, as ``fused``; BLAST +4 N b r: Z and T, what its
  default pipelines from N > 16 move).
* ``reference``: the plain PyTorch reference, which also copies for the transposes
  (Monarch: z permute + output permute, +2 N b r + 2 N out; BLAST: output transpose +2 N out).

FLOPs count multiply-adds as 2 and include BLAST's diagonal mixing (2 N b^2 r), which
runs on CUDA cores, not tensor cores; the floor nonetheless divides all FLOPs by the
matmul rate, which makes it (slightly) optimistic, never pessimistic.
"""
from __future__ import annotations

from memfit.errors import MemfitError

KINDS = ("dense", "lowrank", "monarch", "blast")
VARIANTS = ("ideal", "fused", "unfused", "reference")


def weight_params(kind: str, d_in: int, d_out: int, rank: int = 0, blocks: int = 1) -> int:
    if kind == "dense":
        return d_in * d_out
    if kind in ("lowrank", "monarch"):
        return rank * (d_in + d_out)
    if kind == "blast":
        return rank * (d_in + d_out + blocks * blocks)
    raise MemfitError(f"unknown structure {kind!r}; known: {', '.join(KINDS)}")


def layer_flops(kind: str, n: int, d_in: int, d_out: int, rank: int = 0, blocks: int = 1) -> int:
    return 2 * n * weight_params(kind, d_in, d_out, rank, blocks)


def intermediate_elems(kind: str, variant: str, n: int, d_out: int, rank: int, blocks: int) -> int:
    """Elements written plus read between stages (beyond x, weights, y)."""
    if variant not in VARIANTS:
        raise MemfitError(f"unknown kernel variant {variant!r}; known: {', '.join(VARIANTS)}")
    if kind == "dense" or variant == "ideal":
        return 0
    per_stage = {"lowrank": n * rank, "monarch": n * blocks * rank, "blast": n * blocks * rank}[kind]
    if variant == "fused":
        return 2 * per_stage
    stages = 2 if kind == "blast" else 1
    traffic = 2 * per_stage * stages
    if variant == "reference" and kind == "monarch":
        traffic += 2 * per_stage + 2 * n * d_out
    if variant == "reference" and kind == "blast":
        traffic += 2 * n * d_out
    return traffic


def layer_cost(kind: str, variant: str, n: int, d_in: int, d_out: int, rank: int = 0, blocks: int = 1,
               elem_bytes: int = 2) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one forward of the layer on ``n`` tokens."""
    flops = layer_flops(kind, n, d_in, d_out, rank, blocks)
    elems = n * d_in + weight_params(kind, d_in, d_out, rank, blocks) + n * d_out
    elems += intermediate_elems(kind, variant, n, d_out, rank, blocks)
    return flops, elems * elem_bytes


def plot_roofline(points: list[dict], matmul_flops: float, bandwidth: float, path, title: str = "") -> None:
    """Roofline PNG: attained TFLOP/s against arithmetic intensity (FLOP/byte).

    Each point is a dict with ``label``, ``flops``, ``bytes`` (of the ideal variant, so
    points of one case share an x) and ``ms``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    intensities = [p["flops"] / p["bytes"] for p in points] or [1.0]
    lo, hi = min(intensities) / 2, max(intensities) * 2
    ridge = matmul_flops / bandwidth
    xs = [lo, min(max(ridge, lo), hi), hi]
    ax.plot(xs, [min(matmul_flops, bandwidth * x) / 1e12 for x in xs], "k-", lw=2, label="roofline (measured ceilings)")
    labels = sorted({p["label"] for p in points})
    cmap = plt.get_cmap("tab10")
    for k, label in enumerate(labels):
        mine = [p for p in points if p["label"] == label]
        ax.scatter([p["flops"] / p["bytes"] for p in mine], [p["flops"] / (p["ms"] * 1e-3) / 1e12 for p in mine],
                   s=18, color=cmap(k % 10), label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte, ideal traffic)")
    ax.set_ylabel("attained TFLOP/s")
    ax.set_title(title or "structured linear layers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
