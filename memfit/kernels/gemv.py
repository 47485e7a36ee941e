"""Decode-sized matmul: y = x W^T (+ b) for a few rows of x (batch-1..4 decode), W read once.

At batch 1 a decode step's linear layers are matrix-vector products whose only cost is
reading W. cuBLAS picks GEMM tiles for them (64x8 with or without split-K) that reach
37-65% of the H200's bandwidth on the Llama-3.2-3B decode shapes; this kernel is the
plain streaming alternative: one program per ``BN`` output features reads those rows of W
in ``BK``-wide chunks (16-byte vector loads along ``in``), multiplies by the x row and
keeps one fp32 partial per lane, summed once at the end. Many programs along ``out``
(no split along ``in``, so no partial buffers, reduce kernel or memset). The grid is 1-D
with the x row fastest (program ``pid`` takes row ``pid % M`` of feature block ``pid // M``),
so the M programs sharing a W tile are neighbours, run together and re-read it from L2, not HBM.

W may be a row-strided view (``down[:, :a]`` of a partial FFN): the row stride is passed
divided by the vector width and multiplied back in the kernel, so Triton can prove every
row 16-byte aligned (the loader rounds neuron counts to 8) and still vectorise.

The same kernel runs the last stage of a block-low-rank layer at decode (:func:`block_gemv`): W's rows in
blocks of P, block i multiplied by its own slice of the x row (BLAST's Y_i = T_i U_i^T, U stored (b, p, r)
with the rank contiguous), optionally chained after the kernel that writes x (it pulls its rows of W into L2,
then waits). Its tile is autotuned there, as the BLR kernels' are.

Which path is fastest depends on the shape, so ``pick_path`` times cuBLAS (``F.linear``)
against every tile variant over a whole group of same-shaped weights (all layers' q/k/v,
say: more than L2 holds, as in a real decode step) with ``blr_common.pick_variant``,
which caches the winner on disk. Results differ from cuBLAS only in summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels.blr_common import chain_options, contiguous_bias, line_elements, pick_variant, prefetch_l2, tuned

MAX_ROWS = 4                     # x rows (batch x tokens) the GEMV path takes; more is a GEMM
CUBLAS = "cublas"
# name -> (BN output features per program, BK inputs per chunk, warps)
VARIANTS = {
    "gemv_n2_k1024_w4": (2, 1024, 4),
    "gemv_n4_k512_w4": (4, 512, 4),
    "gemv_n4_k1024_w4": (4, 1024, 4),
    "gemv_n8_k256_w4": (8, 256, 4),
    "gemv_n8_k512_w4": (8, 512, 4),
    "gemv_n8_k1024_w8": (8, 1024, 8),
    "gemv_n16_k256_w4": (16, 256, 4),
    "gemv_n16_k512_w8": (16, 512, 8),
}
PATHS = (CUBLAS, *VARIANTS)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: ``F.linear`` (cuBLAS on CUDA)."""
    return F.linear(x, w, bias)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, P, sx_vec, sx_block_vec, sw_vec,
                 HAS_BIAS: tl.constexpr, VEC: tl.constexpr, WAIT_FOR_PREVIOUS: tl.constexpr, LINE: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):
    """y[m, n] = sum_k x[m, (n // P) sx_block + k] w[n, k]: W's rows in blocks of P (P = N: one block), each block
    times its own slice of the x row; a program's BN rows lie in one block (BN divides P, or P = N)."""
    pid = tl.program_id(0)
    m = pid % M                                      # the M programs of one W tile are neighbours
    first = (pid // M) * BN
    rn = first + tl.arange(0, BN)
    rows = tl.minimum(rn, N - 1).to(tl.int64)        # clamp, not mask: loads stay unmasked (vectorised)
    rk = tl.arange(0, BK)
    w_ptrs = w_ptr + rows[:, None] * (sw_vec * VEC) + rk[None, :]
    if WAIT_FOR_PREVIOUS:                            # this program's rows of W into L2, then x from the kernel before
        prefetch_l2(w_ptr + first.to(tl.int64) * (sw_vec * VEC), tl.minimum(BN, N - first), sw_vec * VEC, K, LINE)
        tl.extra.cuda.gdc_wait()
    x_ptrs = x_ptr + m.to(tl.int64) * (sx_vec * VEC) + (first // P).to(tl.int64) * (sx_block_vec * VEC) + rk
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    k_full = K - K % BK
    for k0 in range(0, k_full, BK):
        w = tl.load(w_ptrs + k0)
        x = tl.load(x_ptrs + k0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if k_full < K:
        inside = (rk // VEC) * VEC + k_full < K      # K % VEC == 0: whole vectors in or out
        w = tl.load(w_ptrs + k_full, mask=inside[None, :], other=0.0)
        x = tl.load(x_ptrs + k_full, mask=inside, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * N + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


def _vector_width(x: torch.Tensor, w: torch.Tensor, x_block_stride: int = 0) -> int:
    """Elements per 16-byte load when every row of x and W (and every block's slice of x) starts 16-byte aligned,
    else 1."""
    vec = 16 // w.element_size()
    aligned = all(s % vec == 0 for s in (x.stride(0), x_block_stride, w.stride(0), w.shape[1])) and \
        all(t.data_ptr() % 16 == 0 for t in (x, w))
    return vec if aligned else 1


def _launch(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, variant: str) -> torch.Tensor:
    bn, bk, warps = VARIANTS[variant]
    return _run(_gemv_kernel, x2, w, bias, w.shape[0], 0, BN=bn, BK=bk, num_warps=warps)


def _run(kernel, x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, p: int, x_block_stride: int,
         wait_for_previous: bool = False, **tile) -> torch.Tensor:
    """y (M, N) by ``kernel`` (``_gemv_kernel`` or its autotuner): W's rows in blocks of ``p``, block i times x's
    slice ``x_block_stride`` i onwards; ``tile``: BN, BK, num_warps, num_stages where the autotuner does not pick."""
    m, (n, k) = x2.shape[0], w.shape
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    vec = _vector_width(x2, w, x_block_stride)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]) * m,)  # noqa: E731
    kernel[grid](x2, w, bias if bias is not None else w, y, m, n, k, p, x2.stride(0) // vec, x_block_stride // vec,
                 w.stride(0) // vec, HAS_BIAS=bias is not None, VEC=vec, LINE=line_elements(w),
                 **chain_options(wait_for_previous=wait_for_previous), **tile)
    return y


@torch.library.custom_op("memfit::gemv", mutates_args=())
def _gemv_op(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, variant: str) -> torch.Tensor:
    return _launch(x2, w, bias, variant)


@_gemv_op.register_fake
def _(x2, w, bias, variant):
    return x2.new_empty(x2.shape[0], w.shape[0])


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the GEMV kernel can run this product: few rows, unit inner strides, a float dtype."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    return (0 < rows <= MAX_ROWS and w.dim() == 2 and w.stride(1) == 1 and x.stride(-1) == 1 and x.dtype == w.dtype
            and w.dtype in (torch.float16, torch.bfloat16, torch.float32))


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, variant: str = "gemv_n8_k512_w4") -> torch.Tensor:
    """``F.linear(x, w, bias)`` by the Triton GEMV ``variant``; x (..., in) with at most ``MAX_ROWS`` rows."""
    if variant not in VARIANTS:
        raise MemfitError(f"gemv variant {variant!r} is not one of {', '.join(VARIANTS)}")
    if not takes(x, w):
        raise MemfitError(f"gemv takes at most {MAX_ROWS} rows with unit inner strides and one float dtype; got x "
                          f"{tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} stride {w.stride()} {w.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    return _gemv_op(x2, w, contiguous_bias(bias), variant).view(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    """``F.linear`` through ``path``: ``"cublas"`` or a GEMV variant."""
    return F.linear(x, w, bias) if path == CUBLAS else gemv(x, w, bias, path)


# The block GEMV's tiles for the autotuner (BN rows a program, BK inputs a chunk, warps, stages): one to eight rows by
# 256 to 1024 inputs (one row a program is the only tile for blocks of an odd number of rows). tile_picks records the
# pick.
BLOCK_TILES = [(8, 256, 4, 1), (4, 256, 2, 1), (4, 512, 4, 1), (2, 1024, 4, 1), (8, 512, 8, 1), (2, 512, 4, 1),
               (1, 512, 4, 1)]


def _prune_block_tiles(configs, named_args, **kwargs):
    """Tiles whose rows stay in one block (BN divides P) and whose chunk is no wider along K than K needs."""
    p, k = named_args["P"], named_args["K"]
    keep = [c for c in configs if p % c.kwargs["BN"] == 0 and c.kwargs["BK"] <= max(256, triton.next_power_of_2(k))]
    return keep or [c for c in configs if c.kwargs["BN"] == 1]


_block_gemv_kernel = tuned(BLOCK_TILES, ("BN", "BK"), (1, 32, 4, 1), key=["M", "N", "K", "P", "WAIT_FOR_PREVIOUS"],
                           prune=_prune_block_tiles)(_gemv_kernel)


def block_gemv(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, blocks: int, x_block_stride: int,
               wait_for_previous: bool = False, tile: tuple | None = None) -> torch.Tensor:
    """y (M, N): y[m, i P + o] = x2[m, i x_block_stride : i x_block_stride + K] . w[i P + o] (+ bias[i P + o]),
    P = N / blocks. A block-diagonal product at decode: block i of W's rows (N, K) times its own slice of each of
    x2's M <= MAX_ROWS rows. ``wait_for_previous``: chained after the kernel that writes x2 (each program pulls its
    rows of W into L2 first; :func:`blr_common.chain_options`). ``tile`` (BN, BK, warps, stages), the first three
    powers of two, BN dividing P: run that tile instead of the autotuner's pick."""
    if problem := _block_problem(x2, w, bias, blocks, x_block_stride, tile):
        raise MemfitError(f"block_gemv: {problem}; got x {tuple(x2.shape)} {x2.dtype} stride {tuple(x2.stride())}, "
                          f"W {tuple(w.shape)} {w.dtype} stride {tuple(w.stride())}, {blocks} blocks, x slices "
                          f"{x_block_stride} apart")
    kernel, tiles = _block_gemv_kernel, {}
    if tile is not None:
        kernel, tiles = _gemv_kernel, dict(zip(("BN", "BK", "num_warps", "num_stages"), tile))
    return _run(kernel, x2, w, contiguous_bias(bias), w.shape[0] // blocks, x_block_stride, wait_for_previous, **tiles)


def _block_problem(x2, w, bias, blocks: int, x_block_stride: int, tile: tuple | None) -> str | None:
    """Why :func:`block_gemv` cannot take these arguments, or None."""
    if x2.dim() != 2 or w.dim() != 2:
        return "x and W must be 2-D"
    (m, width), (n, k) = x2.shape, w.shape
    if x2.dtype != w.dtype or w.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x2.device != w.device:
        return "x and W need one float dtype (float16, bfloat16 or float32) and one device"
    if not (0 < m <= MAX_ROWS):
        return f"x needs 1 to {MAX_ROWS} rows"
    if not (n > 0 and k > 0 and blocks > 0 and n % blocks == 0):
        return "W's rows must split into equal blocks, and W must not be empty"
    if w.stride(1) != 1 or x2.stride(1) != 1:
        return "x and W need unit inner strides"
    if x_block_stride < 0 or width < (blocks - 1) * x_block_stride + k:
        return "each row of x must hold every block's slice of K"
    if bias is not None and (bias.shape != (n,) or bias.dtype != w.dtype or bias.device != w.device):
        return f"the bias must be ({n},), in W's dtype and on its device"
    if tile is not None and not (len(tile) == 4 and all(isinstance(v, int) for v in tile)
                                 and all(v > 0 and v & (v - 1) == 0 for v in tile[:3])
                                 and (n // blocks) % tile[0] == 0 and tile[3] > 0):
        return (f"tile {tile} must be (BN, BK, warps, stages), BN, BK and warps powers of two, BN dividing a block's "
                "rows")
    return None


def shape_key(rows: int, w: torch.Tensor, bias: torch.Tensor | None) -> str:
    """What decides the fastest path: rows, out, in, W's row stride, dtype, bias."""
    return f"M{rows} N{w.shape[0]} K{w.shape[1]} ld{w.stride(0)} {str(w.dtype).removeprefix('torch.')} bias{int(bias is not None)}"


def over_group(path: str):
    """fn(x, weights) running ``x`` times every (weight, bias) of ``weights`` by ``path`` (what is timed)."""
    def run(x, weights):
        for w, b in weights:
            linear(x, w, b, path)
    return run


def pick_path(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> str:
    """Fastest path for ``x`` times each of ``weights`` (same shape, stride, dtype), timed over the whole group.

    Off the GPU, or where the kernel cannot take the shape, this is cuBLAS.
    """
    w, b = weights[0]
    if not takes(x, w):
        return CUBLAS
    candidates = {name: over_group(name) for name in PATHS}
    key = (shape_key(x.numel() // x.shape[-1], w, b), f"x{len(weights)}")
    return pick_variant("gemv", key, candidates, CUBLAS, (x, weights))
