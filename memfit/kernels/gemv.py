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

Monarch's factors are stored K-major, w1 (b, m, r) and w2 (b, r, p): at one token its stages run
:func:`block_row_gemv`, the transpose of the above (a program streams a BC-column strip of W's rows and sums over
them once at the end), reading each block's x vector through a two-part index so that stage 2 gathers z in w2's
row order.

Which path is fastest depends on the shape, so ``pick_path`` times cuBLAS (``F.linear``)
against every tile variant over a whole group of same-shaped weights (all layers' q/k/v,
say: more than L2 holds, as in a real decode step) with ``autotune.pick_variant``,
which caches the winner on disk. Results differ from cuBLAS only in summation order.
:func:`decode_linear` is ``F.linear`` with that choice made per weight shape on its first call, one opaque op to
torch.compile (memfit.infer.decode_gemv puts it behind a model's linear layers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels.autotune import pick_variant, tuned
from memfit.kernels.blr_common import (
    chain_options,
    contiguous_bias,
    line_elements,
    prefetch_l2,
)
from memfit.log import warn_once

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
    """Whether the GEMV kernel can run this product: few rows of w's width, unit inner strides, one float dtype, one
    device."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    return (0 < rows <= MAX_ROWS and w.dim() == 2 and x.shape[-1] == w.shape[1] and w.stride(1) == 1
            and x.stride(-1) == 1 and x.dtype == w.dtype and x.device == w.device
            and w.dtype in (torch.float16, torch.bfloat16, torch.float32))


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, variant: str = "gemv_n8_k512_w4") -> torch.Tensor:
    """``F.linear(x, w, bias)`` by the Triton GEMV ``variant``; x (..., in) with at most ``MAX_ROWS`` rows."""
    if variant not in VARIANTS:
        raise MemfitError(f"gemv variant {variant!r} is not one of {', '.join(VARIANTS)}")
    if not takes(x, w):
        raise MemfitError(f"gemv takes at most {MAX_ROWS} rows of w's width with unit inner strides, one float dtype "
                          f"and one device; got x {tuple(x.shape)} {x.dtype} {x.device}, w {tuple(w.shape)} stride "
                          f"{w.stride()} {w.dtype} {w.device}")
    x2 = x.reshape(-1, x.shape[-1])
    return _gemv_op(x2, w, contiguous_bias(bias), variant).view(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    """``F.linear`` through ``path``: ``"cublas"`` or a GEMV variant."""
    return F.linear(x, w, bias) if path == CUBLAS else gemv(x, w, bias, path)


_DECODE_PATHS: dict[tuple, str] = {}       # (device, shape_key) -> the path decode_linear's pick took


@torch.library.custom_op("memfit::decode_linear", mutates_args=())
def _decode_linear_op(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    key = (x2.device, shape_key(x2.shape[0], w, bias))
    path = _DECODE_PATHS.get(key)
    if path is None:
        path = pick_path(x2, [(w, bias)])
        if not (x2.is_cuda and torch.cuda.is_current_stream_capturing()):    # untimed there: time a later call
            _DECODE_PATHS[key] = path
    return linear(x2, w, bias, path)


@_decode_linear_op.register_fake
def _(x2, w, bias):
    return x2.new_empty(x2.shape[0], w.shape[0])


def _decode_linear_setup(ctx, inputs, output):
    x2, w, bias = inputs
    ctx.save_for_backward(x2, w)
    ctx.has_bias = bias is not None


def _decode_linear_backward(ctx, grad):
    """F.linear's gradients (PyTorch matmuls: the op is for decode, a backward through it is rare)."""
    x2, w = ctx.saved_tensors
    return (grad @ w if ctx.needs_input_grad[0] else None, grad.t() @ x2 if ctx.needs_input_grad[1] else None,
            grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None)


_decode_linear_op.register_autograd(_decode_linear_backward, setup_context=_decode_linear_setup)


def decode_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``; where the GEMV kernel takes the product (:func:`takes`: up to ``MAX_ROWS`` rows,
    a bias of w's dtype and rows), by the path :func:`pick_path` times fastest for its shape on its first call
    outside a CUDA graph capture (cuBLAS or a GEMV variant, timed for this one weight and cached on disk; cuBLAS off
    the GPU). One opaque op to torch.compile, so a compiled decode step can run it in a CUDA graph; a first call
    inside a capture cannot be timed, so that graph keeps cuBLAS (the pick says so once). Under autocast it is
    ``F.linear``, whose output dtype autocast decides (said once). Anything the kernel does not take goes to
    ``F.linear``, which raises where the shapes or devices do not match."""
    if not takes(x, w) or (bias is not None and (bias.shape != w.shape[:1] or bias.dtype != w.dtype
                                                 or bias.device != w.device)):
        return F.linear(x, w, bias)
    if torch.is_autocast_enabled(x.device.type):
        warn_once("decode-linear-autocast", "decode_linear under autocast runs F.linear (cuBLAS), so that autocast "
                  "picks the output dtype; the GEMV path needs x and the weight in one dtype")
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    return _decode_linear_op(x2, w, contiguous_bias(bias)).view(*x.shape[:-1], w.shape[0])


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
    width, (n, k) = x2.shape[1], w.shape
    if problem := _operands_problem(x2, w):
        return problem
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


# ---- x times W with W's rows along K: Monarch's decode stages ----------------------------------------------------

# The tiles of the row-streaming GEMV (BC columns a program, BK rows a step, warps, stages): 8K-16K elements a step
# (16-32 KB in bf16), eight 16-byte loads a thread. Triton software-pipelines only loads that feed a dot, so a program
# has one step's loads in flight, and the step's size is what keeps HBM busy: by Little's law, at about one program an
# SM and a microsecond of latency, 4 KB steps would stream at most about 0.5 TB/s. tile_picks records the pick.
ROW_TILES = [(32, 256, 4, 1), (64, 128, 4, 1), (16, 512, 4, 1), (128, 64, 4, 1), (64, 256, 8, 1), (32, 512, 8, 1),
             (128, 128, 8, 1)]


def _prune_row_tiles(configs, named_args, **kwargs):
    """Tiles no wider along C, and no deeper along K, than the product needs; where none is (K under 64), the
    shallowest at the fewest warps."""
    c, k = named_args["C"], named_args["K"]
    keep = [cfg for cfg in configs if cfg.kwargs["BC"] <= max(32, triton.next_power_of_2(c))
            and cfg.kwargs["BK"] <= triton.next_power_of_2(k)]
    return keep or [min(configs, key=lambda cfg: (cfg.kwargs["BK"], cfg.num_warps))]


@triton.jit
def _row_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, K, C, D, sxm, sxi, sxh, sxl, swi, swk, sym, syi, syc,
                     HAS_BIAS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, WAIT_FOR_PREVIOUS: tl.constexpr,
                     LINE: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """y[m, i syi + c syc] = sum_k x[m, i sxi + (k // D) sxh + (k % D) sxl] w[i, k, c] for BC columns c of block i:
    W's rows (K, C) streamed a BK-row step at a time along their unit-stride columns, an fp32 partial per element of
    the tile, summed over the rows once at the end. The x index's two parts let a stage read its vector gathered
    (Monarch's stage 2: w2's rows in (s, j) order from z in (j, s) order). Programs: row m fastest, then the column
    tiles, then the blocks."""
    c_tiles = tl.cdiv(C, BC)
    pid = tl.program_id(0)
    m = pid % M
    tile = pid // M
    i = tile // c_tiles
    rc = (tile % c_tiles) * BC + tl.arange(0, BC)
    rk = tl.arange(0, BK)
    cols_ok = rc < C
    w_block = w_ptr + i.to(tl.int64) * swi
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT_FOR_PREVIOUS:                            # this program's slice of W into L2, then x from the kernel before
        prefetch_l2(w_block + (tile % c_tiles) * BC, K, swk, tl.minimum(BC, C - (tile % c_tiles) * BC), LINE)
        tl.extra.cuda.gdc_wait()
    x_row = x_ptr + m.to(tl.int64) * sxm + i * sxi
    acc = tl.zeros((BK, BC), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        rows_ok = k < K
        w = tl.load(w_block + k[:, None].to(tl.int64) * swk + rc[None, :], mask=rows_ok[:, None] & cols_ok[None, :],
                    other=0.0)
        x = tl.load(x_row + (k // D) * sxh + (k % D) * sxl, mask=rows_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[:, None]
    y = tl.sum(acc, axis=0)
    col = i * syi + rc * syc
    if HAS_BIAS:
        y += tl.load(b_ptr + col, mask=cols_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * sym + col, y.to(y_ptr.dtype.element_ty), mask=cols_ok)


_row_gemv_tuned = tuned(ROW_TILES, ("BC", "BK"), (32, 16, 4, 1),
                        key=["M", "K", "C", "D", "syc", "LAUNCH_DEPENDENTS", "WAIT_FOR_PREVIOUS"],
                        prune=_prune_row_tiles)(_row_gemv_kernel)


def block_row_gemv(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None,
                   x_index: tuple[int, int, int, int], y_index: tuple[int, int],
                   launch_dependents: bool = False, wait_for_previous: bool = False) -> torch.Tensor:
    """y[m, i syi + c syc] = sum_k x2[m, i sxi + (k // D) sxh + (k % D) sxl] w[i, k, c] (+ bias at the same index), for
    w (B, K, C) with unit-stride columns and x2's M <= MAX_ROWS rows: a block-diagonal product at decode whose weights
    are stored K-major (Monarch's w1 (b, m, r) and w2 (b, r, p)), streamed row by row where a tensor-core tile would
    pad the one token to 16 rows. ``x_index`` is (sxi, D, sxh, sxl), ``y_index`` (syi, syc);
    ``launch_dependents``/``wait_for_previous``: a stage of a chain (:func:`blr_common.chain_options`; the waiting
    stage pulls its slice of W into L2 first). Writes ``y`` (M rows, row stride y.stride(0)) and returns it."""
    if problem := _row_problem(x2, w, y, bias, x_index, y_index):
        raise MemfitError(f"block_row_gemv: {problem}; got x {tuple(x2.shape)} {x2.dtype} stride {tuple(x2.stride())}, "
                          f"W {tuple(w.shape)} {w.dtype} stride {tuple(w.stride())}, y {tuple(y.shape)} {y.dtype}, "
                          f"x index {x_index}, y index {y_index}")
    blocks, k, c = w.shape
    m = x2.shape[0]
    sxi, d, sxh, sxl = x_index
    grid = lambda meta: (m * blocks * triton.cdiv(c, meta["BC"]),)  # noqa: E731
    _row_gemv_tuned[grid](x2, w, bias if bias is not None else w, y, m, k, c, d, x2.stride(0), sxi, sxh, sxl,
                          w.stride(0), w.stride(1), y.stride(0), *y_index, HAS_BIAS=bias is not None,
                          LINE=line_elements(w),
                          **chain_options(launch_dependents=launch_dependents, wait_for_previous=wait_for_previous))
    return y


def _operands_problem(x2, *others) -> str | None:
    """What the decode GEMVs need of x (its rows) and of W and y (x's dtype and device), or None."""
    if any(t.dtype != x2.dtype or t.device != x2.device for t in others) or \
            x2.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        names = "x, W and y" if len(others) > 1 else "x and W"
        return f"{names} need one float dtype (float16, bfloat16 or float32) and one device"
    if not 0 < x2.shape[0] <= MAX_ROWS:
        return f"x needs 1 to {MAX_ROWS} rows"
    return None


def _row_problem(x2, w, y, bias, x_index, y_index) -> str | None:
    """Why :func:`block_row_gemv` cannot take these arguments, or None: every index it forms must land inside x's
    and y's rows (the kernel does not check), no two programs may write one element of y, and y may not share memory
    with what the kernel reads."""
    if x2.dim() != 2 or w.dim() != 3 or y.dim() != 2:
        return "x and y must be 2-D, W 3-D"
    if problem := _operands_problem(x2, w, y):
        return problem
    (blocks, k, c), m = w.shape, x2.shape[0]
    if y.shape[0] != m:
        return "y needs as many rows as x"
    if min(w.shape) < 1 or w.stride(2) != 1 or x2.stride(1) != 1 or y.stride(1) != 1:
        return "W must not be empty, and W's columns, x and y need unit inner strides"
    sxi, d, sxh, sxl = x_index
    syi, syc = y_index
    if d < 1 or min(sxi, sxh, sxl, syi, syc) < 0:
        return "the index's divisor must be positive and its strides not negative"
    if (blocks - 1) * sxi + _largest_split_index(k, d, sxh, sxl) >= x2.shape[1]:
        return "the x index passes the end of x's rows"
    if (blocks - 1) * syi + (c - 1) * syc >= y.shape[1]:
        return "the y index passes the end of y's rows"
    if not _one_element_each(blocks, c, syi, syc) or (m > 1 and y.stride(0) < y.shape[1]):
        return "the y index must put the blocks side by side or interleave them, on rows that do not overlap"
    if y.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in (x2, w, bias) if t is not None}:
        return "y shares memory with x, W or the bias"
    if bias is not None and (bias.shape != (y.shape[1],) or bias.stride(0) != 1 or bias.dtype != w.dtype
                             or bias.device != w.device):
        return f"the bias must be ({y.shape[1]},), as y's rows, contiguous, in W's dtype and on its device"
    return None


def _largest_split_index(k: int, d: int, high: int, low: int) -> int:
    """max over 0 <= i < k of (i // d) high + (i % d) low, for strides >= 0: at i = k - 1, or at the end of the last
    whole run of d before it (the largest remainder with one less quotient)."""
    last = (k - 1) // d * high + (k - 1) % d * low
    return max(last, ((k - 1) // d - 1) * high + (d - 1) * low) if k > d else last


def _one_element_each(blocks: int, c: int, syi: int, syc: int) -> bool:
    """Whether y's index i syi + j syc (i < blocks, j < c) gives every output its own element, by the two layouts that
    do (checked in O(1), every call): each block's c columns in a run before the next block's (Monarch's block-major
    y), or the blocks interleaved within each column step (its permuted y)."""
    side_by_side = (syc >= 1 or c == 1) and (blocks == 1 or syi >= (c - 1) * syc + 1)
    interleaved = (syi >= 1 or blocks == 1) and (c == 1 or syc >= (blocks - 1) * syi + 1)
    return side_by_side or interleaved
