"""A gated MLP's ``silu(gate(x)) * up(x)`` where gate and up are Monarch layers (memfit.kernels.monarch), in fewer
launches at decode.

Why: at one token a Monarch layer is two dependent kernels of a few microseconds each, bound by their launches and
first reads, not by their bytes (README's end-to-end decode: a Llama-1B Monarch layer's five projections take 3.6x
their roofline floor, the dense model's 1.8x). Unfused, the MLP's gate and up are four such kernels and the SiLU
product a fifth. Here gate's and up's second stages and the product are one kernel (``_swiglu_stage2_kernel``):
output block i's column tile computes both products, z_g,i @ w2_g[i] and z_u,i @ w2_u[i], in fp32 and stores
``silu(g) * u`` rounded once; three launches where there were five, and the gate and up outputs never reach memory.

Pipelines; ``pick_variant`` times the ones offered (cached on disk):

* ``separate``: the two Monarch ops (each its own pick) and the product in one kernel (memfit.kernels.swiglu): the
  unfused MLP's launches, the baseline the fused pipeline must beat. Where ``fused_pdl`` is not offered the wrapper
  does not enter the op at all and computes ``silu(gate(x)) * up(x)`` as the unpatched MLP does (torch.compile then
  fuses the product as it did).
* ``fused_pdl`` (N <= 16, Hopper+; ranks multiples of STEP): gate's and up's first stages by the Monarch
  stage-1 kernel, the second launched to let the fused second stage start while it runs (programmatic dependent
  launch: that kernel pulls its w2 slices into L2, then waits). On the H200 at the Llama-1B MLP the pick timed it
  at 18.6 us against ``separate``'s 19.6 (49a4423) and 20.07 against 19.78 (26d0282); forced in the Monarch model,
  beside the unfused model with the same picks elsewhere, the decode step took 1.208 ms against 1.221 (9a78771,
  README, ``results/blr_e2e_memfit_attention_fused_mlp.json``): about 1%.

The fused stage reads w2's rows interleaved as Monarch's chained stage 2 does (w2[i]'s rows in (s, j) order, z_i in
(j, s) order): rank k of block i's operand is row (k mod t) b + k div t, t a constexpr (a multiply, not a division).
Numerics: gate and up are summed in fp32 and rounded once after the product, where the separate pipeline rounds
each projection's output to x's dtype first, so the two differ by rounding only.
Backward: PyTorch ops (recompute-and-differentiate of the reference, blr_common); saves only x, frozen weights or not
(the op is not linear in x). The ledger does not model the fused op.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels.blr_common import (
    bind_shapes,
    blr_precision,
    chain_options,
    interleaved_b_rows,
    line_elements,
    mma,
    n_bucket,
    pdl_offered,
    pick_bucket,
    pick_variant,
    pow2_at_least,
    prefetch_l2,
    recompute_backward,
    recomputing,
    require_offered,
    runs_triton,
    save_for_recompute,
    tuned,
)
from memfit.kernels.monarch import monarch_linear, monarch_linear_reference, stage1
from memfit.kernels.swiglu import swiglu

STEP = 16                 # the fused stage's smallest K step (tl.dot's smallest K): must divide each rank
FUSED_MAX_N = 16          # decode: where launches, not bytes, are the time


def monarch_swiglu_reference(x, gate_w1, gate_w2, up_w1, up_w2):
    """The definition: ``silu(gate(x)) * up(x)`` with each projection the Monarch reference, rounded to x's dtype."""
    return F.silu(monarch_linear_reference(x, gate_w1, gate_w2)) * monarch_linear_reference(x, up_w1, up_w2)


def _separate(x2, gate_w1, gate_w2, up_w1, up_w2):
    return swiglu(monarch_linear(x2, gate_w1, gate_w2), monarch_linear(x2, up_w1, up_w2))


@triton.jit
def _interleaved_block_dot(z_ptr, szn, w_ptr, swk, rn, rc, N, P, B, T: tl.constexpr, PRECISION: tl.constexpr,
                           BN: tl.constexpr, BC: tl.constexpr, STEP_K: tl.constexpr):
    """sum over k = j T + s of z[n, k] w[s B + j, c] for the tile's rows rn and columns rc: block i's Monarch stage 2
    with w's rows in (s, j) order; STEP_K divides B T (the pruning keeps such steps)."""
    rk = tl.arange(0, STEP_K)
    acc = tl.zeros((BN, BC), dtype=tl.float32)
    for k0 in range(0, B * T, STEP_K):
        a = tl.load(z_ptr + rn[:, None] * szn + (k0 + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        rows = interleaved_b_rows(k0, rk, T, swk, B * swk, STEP_K)          # run j's rows: j swk + s B swk
        w = tl.load(w_ptr + rows[:, None] + rc[None, :], mask=rc[None, :] < P, other=0.0)
        acc = mma(a, w, acc, PRECISION)
    return acc


# (BN, BC, STEP_K, warps, stages): decode tiles, one 16-row token tile by a column slice of the output block, K steps
# of 16-128 ranks (the last a fallback for ranks that are only multiples of 16)
STAGE2_TILES = [(16, 32, 64, 4, 3), (16, 64, 64, 4, 3), (16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (16, 32, 128, 4, 4),
                (16, 64, 32, 4, 4), (16, 64, 16, 4, 4)]   # (16, 128, 128, 8, 3) spilled 16 bytes (test_blr_kernels.py)


def _prune_stage2(configs, named_args, **kwargs):
    """Tiles whose K step divides both ranks (16 always does: fused_ranks_fit) and no wider than the block's columns."""
    ranks = [named_args["B"] * kwargs[t] for t in ("TG", "TU")]
    keep = [c for c in configs if all(r % c.kwargs["STEP_K"] == 0 for r in ranks)
            and c.kwargs["BC"] <= max(32, pow2_at_least(named_args["P"]))]
    return keep or [c for c in configs if c.kwargs["STEP_K"] == STEP]


@tuned(STAGE2_TILES, ("BN", "BC", "STEP_K"), (16, 16, STEP, 4, 1),
       key=["N_BUCKET", "P", "B", "TG", "TU", "WAIT_FOR_PREVIOUS"], prune=_prune_stage2)
@triton.jit
def _swiglu_stage2_kernel(zg_ptr, zu_ptr, wg_ptr, wu_ptr, y_ptr, N, P, B, N_BUCKET, szg_n, szg_i, szu_n, szu_i,
                          swg_i, swg_k, swu_i, swu_k, syn, TG: tl.constexpr, TU: tl.constexpr,
                          PRECISION: tl.constexpr, WAIT_FOR_PREVIOUS: tl.constexpr, LINE: tl.constexpr,
                          BN: tl.constexpr, BC: tl.constexpr, STEP_K: tl.constexpr):
    """y[n, i P + c] = silu(g) u for a (BN, BC) tile of output block i, g and u block i's Monarch stage 2 of gate and
    up (fp32), stored once in y's dtype. Programs: block fastest (the b programs of one column tile side by side)."""
    c_tiles = tl.cdiv(P, BC)
    i = tl.program_id(0) % B
    pid_c = (tl.program_id(0) // B) % c_tiles
    pid_n = tl.program_id(0) // (B * c_tiles)
    if WAIT_FOR_PREVIOUS:                              # this tile's rows of both w2 blocks into L2, then z
        cols = tl.minimum(BC, P - pid_c * BC)
        prefetch_l2(wg_ptr + i * swg_i + pid_c * BC, B * TG, swg_k, cols, LINE)
        prefetch_l2(wu_ptr + i * swu_i + pid_c * BC, B * TU, swu_k, cols, LINE)
        tl.extra.cuda.gdc_wait()
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rc = pid_c * BC + tl.arange(0, BC)
    g = _interleaved_block_dot(zg_ptr + i * szg_i, szg_n, wg_ptr + i * swg_i, swg_k, rn, rc, N, P, B, TG, PRECISION,
                               BN, BC, STEP_K)
    u = _interleaved_block_dot(zu_ptr + i * szu_i, szu_n, wu_ptr + i * swu_i, swu_k, rn, rc, N, P, B, TU, PRECISION,
                               BN, BC, STEP_K)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + rn[:, None] * syn + (i * P + rc)[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rn[:, None] < N) & (rc[None, :] < P))


def _fused_stage2(zg, zu, gate_w2, up_w2, wait_for_previous: bool):
    n, b, _ = zg.shape
    p = gate_w2.shape[2]
    if gate_w2.shape[1] % STEP or up_w2.shape[1] % STEP:                 # the K loop has no mask
        raise MemfitError(f"monarch_swiglu: the fused stage needs ranks that are multiples of {STEP}, got "
                          f"{gate_w2.shape[1]} and {up_w2.shape[1]}")
    y = torch.empty(n, b * p, device=zg.device, dtype=zg.dtype)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]) * b * triton.cdiv(p, meta["BC"]),)  # noqa: E731
    _swiglu_stage2_kernel[grid](zg, zu, gate_w2, up_w2, y, n, p, b, n_bucket(n), zg.stride(0), zg.stride(1),
                                zu.stride(0), zu.stride(1), gate_w2.stride(0), gate_w2.stride(1), up_w2.stride(0),
                                up_w2.stride(1), y.stride(0), TG=gate_w2.shape[1] // b, TU=up_w2.shape[1] // b,
                                PRECISION=blr_precision(zg.dtype), LINE=line_elements(gate_w2),
                                **chain_options(wait_for_previous=wait_for_previous))
    return y


def _fused_pdl(x2, gate_w1, gate_w2, up_w1, up_w2):
    """Gate's stage 1, up's (letting the fused stage start), the fused stage: up's stage 1 is launched plainly, so it
    starts once gate's has ended, and the fused stage's wait on it covers both z's."""
    zg = stage1(x2, gate_w1)
    zu = stage1(x2, up_w1, launch_dependents=True)
    return _fused_stage2(zg, zu, gate_w2, up_w2, wait_for_previous=True)


VARIANTS = {"separate": _separate, "fused_pdl": _fused_pdl}


def fused_ranks_fit(gate_w1, up_w1) -> bool:
    """Whether the fused stage takes these layers' ranks: each a multiple of its smallest K step."""
    return all(w.shape[2] % STEP == 0 for w in (gate_w1, up_w1))


def variants_for(n: int, gate_w1, up_w1) -> dict:
    """The pipelines offered for ``n`` tokens (the same for every N of one pick bucket)."""
    names = ["separate"]
    if pick_bucket(n) <= FUSED_MAX_N and pdl_offered() and fused_ranks_fit(gate_w1, up_w1):
        names.append("fused_pdl")
    return {name: VARIANTS[name] for name in names}


@torch.library.custom_op("memfit::monarch_swiglu", mutates_args=())
def _monarch_swiglu_op(x: torch.Tensor, gate_w1: torch.Tensor, gate_w2: torch.Tensor, up_w1: torch.Tensor,
                       up_w2: torch.Tensor, variant: str) -> torch.Tensor:
    b, m, _ = gate_w1.shape
    x2 = x.reshape(-1, b * m).contiguous()
    args = (x2, gate_w1.contiguous(), gate_w2.contiguous(), up_w1.contiguous(), up_w2.contiguous())
    if variant == "auto":
        n = x2.shape[0]
        offered = variants_for(n, gate_w1, up_w1)
        variant = pick_variant("monarch_swiglu", (pick_bucket(n), *gate_w1.shape, gate_w2.shape[2], up_w1.shape[2],
                                                  str(x.dtype)), offered, "fused_pdl" if "fused_pdl" in offered
                               else "separate", args)
    return VARIANTS[variant](*args).reshape(*x.shape[:-1], -1)


@_monarch_swiglu_op.register_fake
def _(x, gate_w1, gate_w2, up_w1, up_w2, variant):
    return x.new_empty(*x.shape[:-1], gate_w1.shape[0] * gate_w2.shape[2])


_monarch_swiglu_op.register_autograd(
    recompute_backward(monarch_swiglu_reference, 5),
    setup_context=lambda ctx, inputs, output: save_for_recompute(ctx, inputs, output, 5, linear_in_x=False))

_recomputing = recomputing(monarch_swiglu_reference, 5, linear_in_x=False)


def monarch_swiglu(x, gate_w1, gate_w2, up_w1, up_w2, path=None, variant="auto"):
    """``silu(gate(x)) * up(x)`` for Monarch gate and up (block-major outputs, no bias) of the same input and output
    blocks, by the Triton op where ``use_triton`` allows and the fused pipeline is offered (``variant``: auto or one of
    VARIANTS); where it is not, as the unfused MLP computes it (the two Monarch ops, then the product); off Triton,
    the reference with the op's memory behaviour (only x kept, the backward recomputes)."""
    size = bind_shapes("monarch_swiglu", x, None, {"gate_w1": (gate_w1, "b m r"), "gate_w2": (gate_w2, "b r p"),
                                                    "up_w1": (up_w1, "b m q"), "up_w2": (up_w2, "b q p")}, "b m", "b p")
    b = size["b"]
    for name, rank in (("gate", size["r"]), ("up", size["q"])):
        if rank % b:
            raise MemfitError(f"monarch_swiglu: {name}'s rank {rank} (its w1's last dimension) is not a multiple of "
                              f"blocks b = {b}")
    cast = [w.to(x.dtype) for w in (gate_w1, gate_w2, up_w1, up_w2)]
    if not runs_triton("monarch_swiglu", x, (gate_w1, gate_w2, up_w1, up_w2), path, variant):
        return _recomputing(x, *cast)
    offered = variants_for(x.numel() // (b * size["m"]), gate_w1, up_w1)  # static per compiled graph: no break
    if variant == "auto" and "fused_pdl" not in offered:
        return F.silu(monarch_linear(x, cast[0], cast[1], path=path)) * monarch_linear(x, cast[2], cast[3], path=path)
    require_offered("monarch_swiglu", variant, lambda: offered, "for this token count and these ranks")
    return _monarch_swiglu_op(x, *cast, variant)
