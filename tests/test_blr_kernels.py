"""BLR Triton ops (interpreter on CPU) against their float64 references, forward and backward.

Odd shapes (blocks 3, block sizes 7 and 11, per-block rank 5, N 1 and 2 x 19), every
variant, both Monarch output layouts, bias on and off, fp32 and bf16, outputs poisoned
with NaN before the run.
"""
import contextlib
import functools
import math
import re
import types

import pytest
import torch
import triton.language as tl
from conftest import rel, seeded

from memfit.errors import MemfitError
from memfit.kernels import autotune, batched_gemm, blast, blr_common, dispatch, lowrank, monarch
from memfit.kernels.blast import blast_linear, blast_linear_reference
from memfit.kernels.dispatch import interpreting
from memfit.kernels.lowrank import lowrank_linear, lowrank_linear_reference
from memfit.kernels.monarch import monarch_linear, monarch_linear_reference
from memfit.layers import BlastLinear, LowRankLinear, MonarchLinear
from memfit.ledger.predict import blr_transient_per_token

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
B, M, P, N = 3, 11, 7, 19


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Every torch.empty the ops allocate starts as NaN, so unwritten elements show."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)


def check(op, reference, tensors, dtype, **options):
    """Forward and backward of ``op`` (Triton path) against the float64 reference; a None bias stays None."""
    inputs = [t if t is None else t.to(dtype).requires_grad_() for t in tensors]
    y = op(*inputs, path="triton", **options)
    options.pop("variant")
    ref_inputs = [t if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref = reference(*ref_inputs, **options)
    assert torch.isfinite(y).all()
    assert rel(y, ref) < TOL[dtype]
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [t for t in inputs if t is not None], grad)
    want = torch.autograd.grad(ref, [t for t in ref_inputs if t is not None], grad.double())
    for g, w in zip(got, want):
        assert rel(g, w) < TOL[dtype]


def drop_bias(tensors, bias):
    return tensors if bias else [*tensors[:-1], None]


DTYPES = [torch.float32, torch.bfloat16]


MONARCH_CASES = [("two_stage", True), ("two_stage", False), ("two_stage_pdl", True), ("two_stage_pdl", False),
                 ("bmm", False), ("bmm_perm_bmm", False), ("bmm_gather", True), ("bmm_gather", False),
                 ("tbmm", False), ("tbmm_tbmm", False), ("fused", True),
                 ("fused", False), ("torch", True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,permute", MONARCH_CASES)
@pytest.mark.parametrize("lead,bias", [((1,), True), ((2, N), False), ((2, N), True)])
def test_monarch(dtype, variant, permute, lead, bias, monkeypatch):
    monkeypatch.setattr(monarch, "TOKEN_MAJOR_MIN_N", 1)  # the token-contiguous pipelines at the tests' N too
    t = 5
    tensors = [torch.randn(*lead, B * M), torch.randn(B, M, B * t) / M**0.5, torch.randn(B, B * t, P) / t**0.5,
               torch.randn(B * P)]
    check(monarch_linear, monarch_linear_reference, drop_bias(tensors, bias), dtype, permute_output=permute,
                  variant=variant)


@pytest.mark.parametrize("layer", [LowRankLinear(12, 8, rank=3, bias=True, dtype=torch.float64),
                                   MonarchLinear(12, 9, rank=6, blocks=3, bias=True, dtype=torch.float64),
                                   BlastLinear(12, 9, rank=4, blocks=3, bias=True, dtype=torch.float64)],
                         ids=["lowrank", "monarch", "blast"])
def test_float64_runs_the_reference_said_once_and_a_forced_triton_path_refuses_it(layer, monkeypatch):
    """The kernels' fp32 accumulators had returned garbage (or NaN) for float64, unsaid: gradcheck now passes on
    the reference, which auto mode runs, and says so once; the forced path names the dtype."""
    said = []
    monkeypatch.setattr(dispatch, "warn_once", lambda key, message: said.append(message))
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    assert rel(layer(x), x @ layer.to_dense().T + layer.bias) < 1e-12
    assert torch.autograd.gradcheck(layer, (x,))
    assert said and all("no Triton kernel for torch.float64" in message for message in said)
    monkeypatch.setenv("MEMFIT_KERNELS", "triton")
    with pytest.raises(MemfitError, match="forced.*not torch.float64"):
        layer(x)


def test_monarch_variants_offered():
    """bmm and bmm_perm_bmm only for the block-major layout and up to SCATTERED_Z_MAX_N; tbmm_tbmm for that layout
    at every N; bmm_gather for both from TOKEN_MAJOR_MIN_N; the fused kernel at every N where its tile fits; the
    chained two_stage up to PDL_MAX_N; the plain PyTorch pipeline always competes."""
    small = {"two_stage", "two_stage_pdl", "bmm", "bmm_perm_bmm", "tbmm_tbmm", "fused", "torch"}
    assert set(monarch.variants_for(16, 16, 128, 32, 128, False)) == small
    assert set(monarch.variants_for(16, 16, 128, 32, 128, True)) == {"two_stage", "two_stage_pdl", "fused", "torch"}
    last = monarch.SCATTERED_Z_MAX_N
    assert "bmm" in monarch.variants_for(last, 16, 128, 32, 128, False)
    assert not {"bmm", "bmm_perm_bmm"} & set(monarch.variants_for(last + 1, 16, 128, 32, 128, False))
    large = small - {"two_stage_pdl", "bmm", "bmm_perm_bmm"} | {"tbmm", "bmm_gather"}
    assert set(monarch.variants_for(8192, 16, 128, 32, 128, False)) == large
    assert set(monarch.variants_for(8192, 16, 128, 32, 128, True)) == {"two_stage", "fused", "torch", "bmm_gather"}
    assert "fused" not in monarch.variants_for(1, 16, 688, 93, 256, False)


def test_monarchs_chain_is_offered_further_than_the_others(monkeypatch):
    """Monarch's chained two_stage up to TWO_STAGE_PDL_MAX_N (256), BLAST's and low-rank's chains up to PDL_MAX_N
    (128): at N = 256 only Monarch's chain won anything (blr_layers_subset_256_chained.json)."""
    monkeypatch.setattr(blr_common, "pdl_offered", lambda: True)
    monkeypatch.setattr(monarch, "pdl_offered", lambda: True)
    monkeypatch.setattr(blast, "pdl_offered", lambda: True)
    monkeypatch.setattr(lowrank, "pdl_offered", lambda: True)
    assert monarch.TWO_STAGE_PDL_MAX_N == 256 and blr_common.PDL_MAX_N == 128
    chained = lambda n: ("two_stage_pdl" in monarch.variants_for(n, 16, 128, 32, 128, False),   # noqa: E731
                         "bgemm_mix_bgemm_pdl" in blast.variants_for(n), "bgemm_pdl" in lowrank.variants_for(n))
    assert chained(128) == (True, True, True)
    assert chained(129) == chained(256) == (True, False, False)
    assert chained(257) == (False, False, False)


def test_gemv_chains_are_offered_at_one_token(monkeypatch):
    """At N = 4 BLAST's GEMV chain was the fastest at no shape (blr_layers_subset_gemv_chain_n4.json), and the
    chains need PDL."""
    gemv_chains = lambda n: ("bgemm_mix_gemv_pdl" in blast.variants_for(n),  # noqa: E731
                             "gemv_gemv_pdl" in monarch.variants_for(n, 16, 128, 16, 128, False),
                             "gemv_gemv_pdl" in monarch.variants_for(n, 16, 128, 16, 128, True))
    for module in (blast, monarch):
        monkeypatch.setattr(module, "pdl_offered", lambda: True)
    assert gemv_chains(1) == (True, True, True)
    assert all(gemv_chains(n) == (False, False, False) for n in (2, 3, 4, 16))
    for module in (blast, monarch):
        monkeypatch.setattr(module, "pdl_offered", lambda: False)
    assert gemv_chains(1) == (False, False, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_monarchs_one_token_gemv_chain(dtype, permute, bias):
    """gemv_gemv_pdl, both stages streaming K-major weights row by row (gemv.block_row_gemv), stage 2's vector
    gathered from z in w2's row order, at odd sizes, forward and backward, both output layouts."""
    t = 5
    tensors = [torch.randn(1, B * M), torch.randn(B, M, B * t) / M**0.5, torch.randn(B, B * t, P) / t**0.5,
               torch.randn(B * P)]
    check(monarch_linear, monarch_linear_reference, drop_bias(tensors, bias), dtype, permute_output=permute,
          variant="gemv_gemv_pdl")


def test_fused_mixing_is_offered_up_to_its_max_n():
    last = blast.XVMIX_MAX_N
    assert "xvmix_bmm" in blast.variants_for(1) and "xvmix_bmm" in blast.variants_for(last)
    assert "xvmix_bmm" not in blast.variants_for(last + 1)


def test_token_major_pipelines_are_offered_from_their_min_n():
    """From the pick bucket of TOKEN_MAJOR_MIN_N (128: N = 65-128 share one pick), not in the bucket below; Monarch's
    all-cuBLAS tbmm_tbmm at every N, block-major only."""
    first, below = blr_common.TOKEN_MAJOR_MIN_N // 2 + 1, blr_common.TOKEN_MAJOR_MIN_N // 2
    assert "tbmm_mix_tbmm" in blast.variants_for(first) and "tbmm_mix_tbmm" not in blast.variants_for(below)
    assert blast._default(blr_common.TOKEN_MAJOR_MIN_N) == "tbmm_mix_tbmm"
    assert "tbmm" in monarch.variants_for(first, 16, 128, 32, 128, False)
    assert "tbmm" not in monarch.variants_for(below, 16, 128, 32, 128, False)
    assert "tbmm" not in monarch.variants_for(first, 16, 128, 32, 128, True)
    assert all("tbmm_tbmm" in monarch.variants_for(n, 16, 128, 32, 128, False) for n in (1, below, first, 8192))
    assert not any("tbmm_tbmm" in monarch.variants_for(n, 16, 128, 32, 128, True) for n in (1, first))
    assert "tbmm_tbmm" in monarch.variants_for(1, 16, 4096 // 16, 1488 // 16, 11008 // 16, False)  # Llama-7B gate/up
    assert monarch._default(128, False) == "tbmm" and monarch._default(128, True) == "two_stage"


@pytest.mark.parametrize("blocks,n", [(3, 130), (17, 70)])
def test_token_major_pipelines_at_several_token_tiles_and_many_blocks(monkeypatch, blocks, n):
    """N past one token tile of the interpreter's configs (64) and not a multiple of it, and b > 16
    (a 32-wide block tile with masked rows), for both token-contiguous pipelines."""
    monkeypatch.setattr(blast, "TOKEN_MAJOR_MIN_N", 1)
    monkeypatch.setattr(monarch, "TOKEN_MAJOR_MIN_N", 1)
    m, p, r, t = 3, 2, 5, 2
    tensors = [torch.randn(n, blocks * m), torch.randn(blocks, p, r) / r**0.5, torch.randn(blocks, m, r) / m**0.5,
               torch.randn(blocks, blocks, r) / blocks**0.5, torch.randn(blocks * p)]
    check(blast_linear, blast_linear_reference, tensors, torch.float32, variant="tbmm_mix_tbmm")
    tensors = [torch.randn(n, blocks * m), torch.randn(blocks, m, blocks * t) / m**0.5,
               torch.randn(blocks, blocks * t, p) / t**0.5, torch.randn(blocks * p)]
    for variant in ("tbmm", "tbmm_tbmm"):
        check(monarch_linear, monarch_linear_reference, tensors, torch.float32, permute_output=False,
              variant=variant)


@pytest.mark.parametrize("variant", ["bmm_perm_bmm", "bmm_gather", "tbmm_tbmm", "two_stage"])
@pytest.mark.parametrize("blocks,t,n", [(5, 7, 9), (3, 6, 1), (17, 1, 6), (2, 32, 5), (8, 5, 9), (8, 37, 3),
                                        (8, 31, 3)])
def test_p_transpose_with_odd_per_block_ranks(blocks, t, n, variant, monkeypatch):
    """bmm_perm_bmm's P^T copy and bmm_gather's P^T on load at odd per-block ranks t (Llama-7B's is 93,
    each run of t elements starting misaligned), token counts not a multiple of a token tile, many blocks
    of rank 1, runs of one whole K step (t = 32: the gathering loop without its K mask), and odd t in rows
    of a multiple of 16 B (bmm_gather's aligned windows: 8 x 5; 8 x 37 over two window steps; 8 x 31, where
    a run that fits one 32-wide step takes two once its window's lead is added, each reading w2's rows
    interleaved); tbmm_tbmm's z in w2's (s, j) order and two_stage's interleaved reads of w2 (a K step inside one
    run where t = 32, rows of several runs in one step elsewhere) at the same ranks."""
    monkeypatch.setattr(monarch, "TOKEN_MAJOR_MIN_N", 1)
    m, p = 3, 4
    tensors = [torch.randn(n, blocks * m), torch.randn(blocks, m, blocks * t) / m**0.5,
               torch.randn(blocks, blocks * t, p) / t**0.5, torch.randn(blocks * p)]
    for dtype in DTYPES:
        check(monarch_linear, monarch_linear_reference, tensors, dtype, permute_output=False, variant=variant)


@pytest.mark.cpu_only(reason="CpuAllocationTracker counts CPU allocations")
@pytest.mark.parametrize("d_in,d_out,b,r", [(96, 160, 4, 16), (160, 96, 4, 32), (128, 128, 8, 64), (256, 64, 4, 8)])
def test_tbmm_tbmm_holds_only_z(d_in, d_out, b, r):
    """What tbmm_tbmm allocates besides its output (CPU tracker): z alone, with w2 read as it is stored (it copied w2
    on every call until w2 was stored in (s, j) order), within the ledger's Monarch forward transient at every N."""
    from memfit.measure.memory import CpuAllocationTracker

    m, p = d_in // b, d_out // b
    forward_per_token, _ = blr_transient_per_token("monarch", r, b, d_in, d_out)
    for n in (1, min(r, p) - 1, 3 * min(r, p)):
        x, w1, w2 = torch.randn(n, d_in), torch.randn(b, m, r), torch.randn(b, r, p)
        with torch.no_grad(), CpuAllocationTracker([x, w1, w2]) as tracker:
            y = monarch.VARIANTS["tbmm_tbmm"](x, w1, w2, None, False)
        held = tracker.peak - tracker.baseline - y.nbytes
        assert held == n * b * r * x.element_size() <= n * forward_per_token * x.element_size()


@pytest.mark.parametrize("variant", ["tbmm", "tbmm_tbmm"])
def test_token_major_monarch_refuses_the_permuted_layout(variant):
    x, w1, w2 = torch.randn(N, B * M), torch.randn(B, M, B * 2), torch.randn(B, B * 2, P)
    with pytest.raises(MemfitError, match="block-major"):
        monarch.VARIANTS[variant](x, w1, w2, None, True)


def test_chained_pipelines_need_programmatic_dependent_launch(monkeypatch):
    """Off the interpreter the *_pdl pipelines are offered only on a GPU with compute capability >= 9."""
    monkeypatch.setattr(blr_common, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, offered in ((8, False), (9, True)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None, c=capability: types.SimpleNamespace(major=c))
        assert ("two_stage_pdl" in monarch.variants_for(16, 16, 128, 32, 128, False)) == offered
        assert ("z_mixgemm_pdl" in blast.variants_for(16)) == offered
        assert ("bgemm_mix_bgemm_pdl" in blast.variants_for(16)) == offered
        assert ("bgemm_pdl" in lowrank.variants_for(16)) == offered
    assert "z_mixgemm_pdl" not in blast.variants_for(blr_common.PDL_MAX_N + 1)
    assert blr_common.chain_options(True, True)["launch_pdl"] is True
    assert blr_common.chain_options(True, False) == {"LAUNCH_DEPENDENTS": True, "WAIT_FOR_PREVIOUS": False}
    assert blr_common.chain_options(launch_dependents=True) == {"LAUNCH_DEPENDENTS": True}


def test_the_pick_leaves_out_what_never_came_close_where_pdl_is_offered(monkeypatch):
    """Where PDL is offered the pick does not time the pipelines an op names in UNPICKED_WITH_PDL, and its decode
    default is a chained pipeline; without PDL it times them all and the default is an unchained one. Either way
    the default is among the candidates. The names stay available (the layer table times them, ``variant=``
    takes them)."""
    monkeypatch.setattr(blr_common, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, pdl in ((8, False), (9, True)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None, c=capability: types.SimpleNamespace(major=c))
        for module, available in ((monarch, monarch.variants_for(16, 16, 128, 32, 128, False)),
                                  (blast, blast.variants_for(16)), (lowrank, lowrank.variants_for(16))):
            assert set(module.UNPICKED_WITH_PDL) < set(available)
            timed = blr_common.pick_candidates(available, module.UNPICKED_WITH_PDL)
            assert set(timed) == set(available) - (set(module.UNPICKED_WITH_PDL) if pdl else set())
        for n in (1, 16):
            assert monarch._default(n, False) == ("two_stage_pdl" if pdl else "fused")
            assert blast._default(n) == ("bgemm_mix_bgemm_pdl" if pdl else "z_mixgemm")
            assert monarch._default(n, False) in blr_common.pick_candidates(monarch.variants_for(n, 16, 128, 32, 128, False),
                                                                              monarch.UNPICKED_WITH_PDL)
            assert blast._default(n) in blr_common.pick_candidates(blast.variants_for(n), blast.UNPICKED_WITH_PDL)


@pytest.mark.parametrize("op,module,shapes", [
    (monarch_linear, monarch, [(N, B * M), (B, M, B * 5), (B, B * 5, P)]),
    (blast_linear, blast, [(N, B * M), (B, P, 5), (B, M, 5), (B, B, 5)]),
    (lowrank_linear, lowrank, [(N, M), (P, 5), (M, 5)])])
def test_the_ops_hand_the_pick_its_candidates(op, module, shapes, monkeypatch):
    """Each op's auto path passes pick_candidates' set (not every available pipeline) to the pick, on a GPU that
    offers PDL (the interpreter runs the kernels)."""
    for where in (blr_common, module):
        monkeypatch.setattr(where, "pdl_offered", lambda: True)
    seen = {}

    def fake_pick(name, key, offer, args):
        seen["names"] = set(offer()[0])
        return "torch" if "torch" in seen["names"] else "cublas"

    monkeypatch.setattr(module, "auto_variant", fake_pick)
    op(*(torch.randn(*shape) for shape in shapes), path="triton")
    assert seen["names"] and not seen["names"] & set(module.UNPICKED_WITH_PDL)


def test_a_chained_stage_needs_weights_with_a_unit_stride():
    a, b, c = torch.randn(1, 4, 6), torch.randn(6, 10)[:, ::2], torch.empty(1, 4, 5)
    with pytest.raises(MemfitError, match="unit stride"):
        batched_gemm.bgemm(a, b, c, 4, 6, 5, 1, (0, 6, 1), (0, *b.stride()), (0, 5, 0, 1), wait_for_previous=True)


SM90_PTX_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from memfit.kernels import autotune, batched_gemm, blast, blr_common, gemv

kernels = {"bgemm": batched_gemm._bgemm_kernel, "mixgemm": blast._mixgemm_kernel, "zmix": blast._zmix_kernel,
           "tmix": blast._tmix_kernel, "xvmix": blast._xvmix_kernel, "row_gemv": gemv._row_gemv_kernel}
out = {}
for name, (kernel, constexprs, divisible, stages, warps) in json.loads(sys.argv[1]).items():
    fn = batched_gemm.jit_function(kernels[kernel])
    signature = {p.name: "constexpr" if p.is_constexpr else "*bf16" if p.name.endswith("_ptr") else "i32"
                 for p in fn.params}
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name in divisible}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=defaults | constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    out[name] = triton.compile(source, target=target, options={"num_warps": warps, "num_stages": stages}).asm["ptx"]
print(json.dumps(out))
"""
CHAIN_BASE = {"HAS_BIAS": True, "PRECISION": "tf32", "LINE": 64, "BN": 16, "BC": 64, "BK": 64}
WAITS = {"LAUNCH_DEPENDENTS": False, "WAIT_FOR_PREVIOUS": True}
ROW_GEMV_BASE = {"HAS_BIAS": True, "LINE": 64, "BC": 32, "BK": 256}
ROW_GEMV_ALIGNED = ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "C", "swi", "swk", "sxm", "sym", "syi"]  # as at the paper's shapes
CHAIN_CASES = {
    "bgemm waits, weights row-major": ("bgemm", {**CHAIN_BASE, **WAITS, "B_ROWS_CONTIGUOUS": True, "EVEN_K": False,
                                                 "BGRP": 0}),
    "bgemm waits, weights k-major": ("bgemm", {**CHAIN_BASE, **WAITS, "B_ROWS_CONTIGUOUS": False, "EVEN_K": True,
                                               "BGRP": 0}),
    "bgemm waits, weights interleaved": ("bgemm", {**CHAIN_BASE, **WAITS, "B_ROWS_CONTIGUOUS": True, "BGRP": 32,
                                                   "B_INTERLEAVED": True, "EVEN_K": False}),  # Monarch's stage 2
    "mixgemm waits": ("mixgemm", {**CHAIN_BASE, "WAIT_FOR_PREVIOUS": True, "BB": 16}),
    "zmix waits and launches": ("zmix", {"BB": 16, "PRECISION": "tf32", "LAUNCH_DEPENDENTS": True,
                                         "WAIT_FOR_PREVIOUS": True, "BN": 16, "BK": 32}),
    "bgemm launches": ("bgemm", {**CHAIN_BASE, "LAUNCH_DEPENDENTS": True, "WAIT_FOR_PREVIOUS": False,
                                 "B_ROWS_CONTIGUOUS": True, "EVEN_K": False, "BGRP": 0}),
    "row_gemv waits": ("row_gemv", {**ROW_GEMV_BASE, **WAITS}, ROW_GEMV_ALIGNED),           # Monarch's stage 2
    "row_gemv launches": ("row_gemv", {**ROW_GEMV_BASE, "LAUNCH_DEPENDENTS": True, "WAIT_FOR_PREVIOUS": False},
                          ROW_GEMV_ALIGNED),                                               # stage 1 at one token
}


def compile_sm90(cases: dict) -> dict:
    """PTX of each (kernel, constexprs[, names of arguments divisible by 16, as Triton specializes them at
    launch[, num_stages (3)[, num_warps (4)]]]) case compiled for sm_90 in a subprocess outside the interpreter."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert all(2 <= len(case) <= 5 for case in cases.values()), cases
    full = {name: (*case, *([], 3, 4)[len(case) - 2:]) for name, case in cases.items()}   # the defaults filled in
    done = subprocess.run([sys.executable, "-c", SM90_PTX_SCRIPT, json.dumps(full)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_fused_mixing_compiles_to_tensor_core_dots():
    """Both of _xvmix_kernel's batched 3-D dots (Z, then the mixing) lower to mma for sm_90 in bf16 (no
    fp32 FMA anywhere: the mixing is off the CUDA cores), at its listed 4-warp tile, with X's and V's
    rows loaded by cp.async from the second stage."""
    assert (16, 16, 16, 4, 2) in blast.XVMIX_CONFIGS
    aligned = ["x_ptr", "v_ptr", "s_ptr", "t_ptr", "M", "sxn", "svj", "sva", "stn", "sti"]
    ptx = compile_sm90({"xvmix": ("xvmix", {"BB": 16, "PRECISION": "tf32", "BN": 16, "BK": 16, "BM": 16}, aligned,
                                  2)})["xvmix"]
    assert "mma.sync" in ptx and "fma.rn.f32" not in ptx and "cp.async" in ptx


def ptxas_spills(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) of sm_90 PTX as Triton's bundled ptxas reports them (-v)."""
    import os
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", source, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, timeout=120, check=True)
    registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    return registers, int(re.search(r"(\d+) bytes spill stores", done.stderr).group(1))


def test_fused_mixing_tiles_compile_without_spills():
    """Every listed _xvmix_kernel tile, at b = 16 in bf16 with its warps and stages, compiles for sm_90
    with at most 8 bytes of register spills (what XVMIX_RESULT_REGISTERS stands for; one tile spills 8 B);
    a wider tile (32 tokens x 32 ranks, 32-wide K steps, 4 warps) spills kilobytes, so the check can tell."""
    aligned = ["x_ptr", "v_ptr", "s_ptr", "t_ptr", "M", "sxn", "svj", "sva", "stn", "sti"]
    base = {"BB": 16, "PRECISION": "tf32"}
    cases = {f"{bn}x{bk}x{bm} w{w} s{st}": ("xvmix", {**base, "BN": bn, "BK": bk, "BM": bm}, aligned, st, w)
             for bn, bk, bm, w, st in blast.XVMIX_CONFIGS}
    cases["too wide"] = ("xvmix", {**base, "BN": 32, "BK": 32, "BM": 32}, aligned, 2, 4)
    spills = {name: ptxas_spills(ptx)[1] for name, ptx in compile_sm90(cases).items()}
    assert spills.pop("too wide") > 1024
    assert max(spills.values()) <= 8, spills


def test_pipelined_token_major_mixing_prefetches_by_cp_async():
    """_tmix_kernel's configs with stages >= 2 load the next ranks' Z_k rows by cp.async while the current
    rank's dot runs; with one stage every load is a plain ld.global after the previous store."""
    base = {"BB": 16, "PRECISION": "tf32", "BN": 256, "BK": 8}                   # as the (256, 8, 4 warps) tiles
    assert {(256, 8, 4, 1), (256, 8, 4, 3)} <= set(blast.TMIX_CONFIGS)
    aligned = ["z_ptr", "s_ptr", "t_ptr", "szj", "szk", "stj", "stk", "N"]      # as Triton specializes N = 8192
    ptx = compile_sm90({"one stage": ("tmix", base, aligned, 1), "three stages": ("tmix", base, aligned, 3)})
    assert "cp.async" not in ptx["one stage"] and "cp.async" in ptx["three stages"]


def test_token_major_mixing_compiles_with_unit_strides():
    """At N = 1 Triton passes the rank strides (N) as the constant 1, a plain int in the kernel: the
    64-bit offset arithmetic must still compile (the interpreter never specialises, so only this sees it)."""
    ptx = compile_sm90({"unit strides": ("tmix", {"szk": 1, "stk": 1, "BB": 16, "PRECISION": "tf32", "BN": 64,
                                                   "BK": 8})})
    assert "mma.sync" in ptx["unit strides"]


@pytest.fixture(scope="module")
def sm90_ptx():
    """PTX of the chained kernels compiled ahead of time for sm_90, outside the interpreter (Triton's
    ptxas checks the inline PTX; no GPU needed): the GDC and prefetch code never runs in these tests."""
    return compile_sm90(CHAIN_CASES)


@pytest.mark.parametrize("case", [c for c in CHAIN_CASES if "waits" in c and "zmix" not in c])
def test_chained_stage_prefetches_its_weights_then_waits_then_loads(sm90_ptx, case):
    import re

    ptx = sm90_ptx[case]
    prefetch, wait = ptx.find("prefetch.global.L2"), ptx.find("griddepcontrol.wait")
    first_load = min(m.start() for m in re.finditer(r"cp\.async|ld\.global", ptx))
    assert 0 <= prefetch < wait < first_load
    assert "griddepcontrol.launch_dependents" not in ptx


def test_chained_mixing_lets_the_next_start_then_waits_for_z(sm90_ptx):
    """The middle of a three-kernel chain: lets the next start, reads S, waits, then reads Z."""
    ptx = sm90_ptx["zmix waits and launches"]
    assert 0 <= ptx.find("griddepcontrol.launch_dependents") < ptx.find("griddepcontrol.wait")
    assert ptx.rfind("ld.global") > ptx.find("griddepcontrol.wait")


@pytest.mark.parametrize("case", [c for c in CHAIN_CASES if "waits" not in c])
def test_first_stage_of_a_chain_lets_the_next_start_before_its_loads(sm90_ptx, case):
    ptx = sm90_ptx[case]
    assert "griddepcontrol.wait" not in ptx and "prefetch.global.L2" not in ptx
    launch = ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= launch < min(ptx.find(op) for op in ("ld.global", "cp.async") if op in ptx)


def test_row_gemv_tiles_stream_16_byte_rows_without_spills():
    """Every listed gemv.ROW_TILES tile, chained and in bf16 with W's rows 16-byte aligned (every shape of the paper's
    tables), compiles for sm_90 to 16-byte loads of W, eight a thread a step (a tile of 8K-16K elements: what keeps
    HBM busy, see ROW_TILES), with no register spills."""
    from memfit.kernels import gemv

    tiles = {str(tile): tile for tile in gemv.ROW_TILES}
    cases = {name: ("row_gemv", {**ROW_GEMV_BASE, **WAITS, "BC": bc, "BK": bk}, ROW_GEMV_ALIGNED, stages, warps)
             for name, (bc, bk, warps, stages) in tiles.items()}
    for name, ptx in compile_sm90(cases).items():
        bc, bk, warps, _ = tiles[name]
        assert bc * bk // (32 * warps) == 64, name                  # 8 vectors of 8 bf16 a thread a step
        assert len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)) == 8, name
        assert ptxas_spills(ptx)[1] == 0, name


def test_forcing_a_variant_not_offered_is_a_clear_error():
    x, w1, w2 = torch.randn(3, B * M), torch.randn(B, M, B * 5), torch.randn(B, B * 5, P)
    with pytest.raises(MemfitError, match="bmm"):
        monarch_linear(x, w1, w2, permute_output=True, path="triton", variant="bmm")
    u, v, s = torch.randn(B, P, 6), torch.randn(B, M, 6), torch.randn(B, B, 6)
    with pytest.raises(MemfitError, match="nope"):
        blast_linear(x, u, v, s, path="triton", variant="nope")
    with pytest.raises(MemfitError, match="available: cublas"):
        lowrank_linear(x, torch.randn(P, 6), torch.randn(B * M, 6), path="triton", variant="nope")


BLAST_VARIANTS = list(blast.VARIANTS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", BLAST_VARIANTS)
@pytest.mark.parametrize("n,bias", [(1, True), (N, False), (N, True)])
def test_blast(dtype, variant, n, bias, monkeypatch):
    monkeypatch.setattr(blast, "TOKEN_MAJOR_MIN_N", 1)   # the token-contiguous pipelines at the tests' N too
    if variant == "bgemm_mix_gemv_pdl":                   # offered at one token only: (1, bias) and (1, no bias)
        if n == N and bias:
            pytest.skip("one token with a bias is the first case")
        n = 1
    r = 19
    tensors = [torch.randn(n, B * M), torch.randn(B, P, r) / r**0.5, torch.randn(B, M, r) / M**0.5,
               torch.randn(B, B, r) / B**0.5, torch.randn(B * P)]
    check(blast_linear, blast_linear_reference, drop_bias(tensors, bias), dtype, variant=variant)


def test_blast_fused_mixing_loops_over_wide_blocks():
    """Input blocks wider than one K tile take the fused kernel's loop over m (3 steps of the interpreter's 16)."""
    m, r = 37, 9
    tensors = [torch.randn(N, 2 * m), torch.randn(2, P, r) / r**0.5, torch.randn(2, m, r) / m**0.5,
               torch.randn(2, 2, r), torch.randn(2 * P)]
    check(blast_linear, blast_linear_reference, tensors, torch.float32, variant="xvmix_bmm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(lowrank.VARIANTS))
@pytest.mark.parametrize("n,bias", [(1, True), (N, False)])
def test_lowrank(dtype, variant, n, bias):
    tensors = [torch.randn(n, 33), torch.randn(17, 20) / 20**0.5, torch.randn(33, 20) / 33**0.5, torch.randn(17)]
    check(lowrank_linear, lowrank_linear_reference, drop_bias(tensors, bias), dtype, variant=variant)


@pytest.mark.parametrize("structure", ["monarch", "blast", "lowrank"])
@pytest.mark.parametrize("n", [1, N])
def test_a_strided_bias_is_read_as_its_values(structure, n, monkeypatch):
    """A bias that is a strided view (every second element of a longer vector) gives every pipeline the reference's
    result: the kernels read the bias with a unit stride, so the op hands them a contiguous one."""
    for module in (monarch, blast):
        monkeypatch.setattr(module, "TOKEN_MAJOR_MIN_N", 1)
    gen = seeded(7)
    new = lambda *shape: torch.randn(*shape, generator=gen)   # noqa: E731
    x, bias = new(n, B * M), new(2 * B * P)[::2]
    if structure == "monarch":
        weights, op, ref = (new(B, M, B * 5), new(B, B * 5, P)), monarch_linear, monarch_linear_reference
        variants = monarch.variants_for(n, B, M, 5, P, False)
    elif structure == "blast":
        weights, op, ref = (new(B, P, 6), new(B, M, 6), new(B, B, 6)), blast_linear, blast_linear_reference
        variants = blast.variants_for(n)
    else:
        weights, op, ref = (new(B * P, 6), new(B * M, 6)), lowrank_linear, lowrank_linear_reference
        variants = lowrank.variants_for(n)
    want = ref(x.double(), *(w.double() for w in weights), bias.double())
    for variant in variants:
        assert rel(op(x, *weights, bias, path="triton", variant=variant), want) < 1e-5, variant


@pytest.mark.cpu_only(reason="its fake tensors stand on the CPU with the Triton path forced")
def test_fake_tensor_shapes():
    """register_fake: the ops trace under FakeTensorMode with the right output shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 6, 12)
        y = monarch_linear(x, torch.empty(3, 4, 6), torch.empty(3, 6, 5), path="triton")
        z = blast_linear(x, torch.empty(3, 5, 7), torch.empty(3, 4, 7), torch.empty(3, 3, 7), path="triton")
        w = lowrank_linear(x, torch.empty(9, 7), torch.empty(12, 7), path="triton")
    assert y.shape == z.shape == (4, 6, 15) and w.shape == (4, 6, 9)


def test_pick_variant_inside_graph_capture_uses_the_cached_winner(monkeypatch):
    """A shape timed before capture keeps its winner inside the capture (the bug: the default ran instead);
    a shape never timed gets the default, and a warning says so."""
    def slow():
        return None

    def fast():
        return None

    candidates = {"slow": slow, "fast": fast}
    monkeypatch.setattr(autotune, "_CACHE", {})
    monkeypatch.setattr(autotune, "PICK_TIMINGS", {})
    monkeypatch.setattr(autotune, "_save_cache", lambda cache: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(autotune, "_time_candidate",
                        lambda op, name, fn, args, rep_ms: {"slow": 2.0, "fast": 1.0}[name])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert autotune.pick_variant("op", (8,), candidates, "slow", ()) == "fast"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert autotune.pick_variant("op", (8,), candidates, "slow", ()) == "fast"
    warned = []
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: warned.append(message))
    assert autotune.pick_variant("op", (16,), candidates, "slow", ()) == "slow"
    assert warned and "capture" in warned[0]


def test_each_pick_is_a_debug_message_saying_where_it_came_from(monkeypatch, caplog):
    """-v had shown nothing (no debug message anywhere): a pick says whether it was timed, and against what, or read
    from the pick cache."""
    import logging

    caplog.set_level(logging.DEBUG, logger="memfit")
    candidates = {"slow": lambda: None, "fast": lambda: None}
    monkeypatch.setattr(autotune, "_CACHE", {})
    monkeypatch.setattr(autotune, "PICK_TIMINGS", {})
    monkeypatch.setattr(autotune, "_save_cache", lambda cache: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(autotune, "_time_candidate",
                        lambda op, name, fn, args, rep_ms: {"slow": 2.0, "fast": 1.0}[name])
    assert autotune.pick_variant("op", (8,), candidates, "slow", ()) == "fast"
    assert "op (8,): fast, the fastest finalist (fast 1 ms; first timings of all 2: fast 1, slow 2)" in caplog.text
    assert autotune.pick_variant("op", (8,), candidates, "slow", ()) == "fast"
    assert "op (8,): fast, from the pick cache" in caplog.text


def test_auto_variant_remembers_a_gpu_pick_but_not_an_untimed_default(monkeypatch, tmp_path):
    """An op's auto pick builds its offer and cache key once per shape key and device: later calls reuse the pick
    (each eager call paid for the offer and the key in host time). A default taken untimed inside a capture or on a
    CPU tensor is not remembered, so a later call still times the pick; one taken where nothing could be timed is
    (the pick is not tried again in the process). forget_picks drops it all."""
    offers = []

    def offer():
        offers.append(1)
        return {"slow": lambda *a: None, "fast": lambda *a: None}, "slow"

    monkeypatch.setenv("MEMFIT_AUTOTUNE_CACHE", str(tmp_path / "picks.json"))
    for name, value in (("_CACHE", {}), ("_VARIANT_MEMO", {}), ("PICK_TIMINGS", {}), ("_UNTIMED", set())):
        monkeypatch.setattr(autotune, name, value)
    monkeypatch.setattr(autotune, "_save_cache", lambda cache: None)
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(autotune, "_time_candidate",
                        lambda op, name, fn, args, rep_ms: {"slow": 2.0, "fast": 1.0}[name])
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    gpu0, gpu1 = (types.SimpleNamespace(device=torch.device("cuda", i)) for i in (0, 1))

    def pick_on(x):
        return autotune.auto_variant("op", (8,), offer, (x,))

    assert pick_on(gpu0) == "slow" and len(offers) == 1                  # in a capture, untimed
    capturing[0] = False
    assert pick_on(gpu0) == "fast" and len(offers) == 2
    assert pick_on(gpu0) == "fast" and len(offers) == 2                  # remembered
    assert pick_on(gpu1) == "fast" and len(offers) == 3                  # another device has its own
    off_gpu = torch.zeros(1, device="cpu")
    assert [pick_on(off_gpu) for _ in range(2)] == ["slow"] * 2 and len(offers) == 5         # off the GPU: never
    autotune.forget_picks()
    assert pick_on(gpu0) == "fast" and len(offers) == 6
    monkeypatch.setattr(autotune, "_time_candidate", lambda op, name, fn, args, rep_ms: math.inf)
    untimed = autotune.auto_variant("op", (16,), offer, (gpu0,))
    assert untimed == autotune.auto_variant("op", (16,), offer, (gpu0,)) == "slow" and len(offers) == 7


def test_a_pick_where_no_variant_could_be_timed_runs_the_default_and_says_so(monkeypatch):
    """E.g. every candidate out of memory while timed (each failure is said by _time_candidate): the layer still
    runs, on its default, which later calls in the process take without timing again; nothing goes to disk."""
    monkeypatch.setattr(autotune, "_CACHE", {})
    monkeypatch.setattr(autotune, "_UNTIMED", set())
    monkeypatch.setattr(autotune, "_save_cache", lambda cache: pytest.fail("nothing to cache"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    timed, warned = [], []
    monkeypatch.setattr(autotune, "_time_candidate", lambda op, name, fn, args, rep_ms: timed.append(name) or math.inf)
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: warned.append(message))
    candidates = {"a": lambda: None, "b": lambda: None}
    assert autotune.pick_variant("op", (8,), candidates, "b", ()) == "b"
    assert "untimed" in warned[0] and "'b'" in warned[0]
    assert autotune.pick_variant("op", (8,), candidates, "b", ()) == "b" and timed == ["a", "b"]


def test_a_pick_calls_each_candidate_once_before_copying_its_arguments(monkeypatch):
    """What a candidate sets up on its first call (a chain's tile pick, with rotating copies of its own) happens
    before the pick's own copies exist, so the two sets are not alive together; a candidate whose first call fails
    is said once and not timed."""
    events, warned = [], []
    monkeypatch.setattr(autotune, "rotation", lambda op, args: events.append("copies") or [args])
    monkeypatch.setattr(autotune, "_time_candidate",
                        lambda op, name, fn, args, rep_ms: events.append(f"time {name}") or {"ok": 1.0}[name])
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: warned.append(message))

    def broken(*args):
        raise RuntimeError("no kernel for this tile")

    timings = autotune._timed_fastest("op", {"ok": lambda *args: events.append("call ok"), "broken": broken}, (1,))
    assert events == ["call ok", "copies", "time ok"] and timings["pick"] == "ok"
    assert timings["first"] == {"ok": 1.0, "broken": math.inf} and "variant broken failed" in warned[0]
    events.clear()
    assert autotune._timed_fastest("op", {"broken": broken}, (1,)) == {"first": {"broken": math.inf}}
    assert events == []                                                   # none settled: nothing copied or timed


def test_pick_variant_times_the_finalists_again_interleaved(monkeypatch):
    """Variants within PICK_FINALIST_SLACK of the fastest first timing are timed again in PICK_FINAL_ROUNDS rounds,
    forward and reverse by turns, and the lowest median wins: here "b" trails "a" once but wins two of the three
    rounds; "c", 1.5x the fastest, is not timed again. A lone finalist is not re-timed."""
    first = {"a": 1.0, "b": 1.1, "c": 1.5}
    again = iter([{"a": 1.0, "b": 0.9}, {"b": 1.2, "a": 1.1}, {"a": 1.3, "b": 0.8}])
    orders, reps, rotations = [], [], []

    def timer(op, candidates, copies, rep_ms=autotune.PICK_REP_MS):
        rotations.append(copies)
        orders.append(list(candidates))
        reps.append(rep_ms)
        return first if len(orders) == 1 else next(again)

    monkeypatch.setattr(autotune, "_CACHE", {})
    monkeypatch.setattr(autotune, "_save_cache", lambda cache: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(autotune, "_rotated_times", timer)
    candidates = {"a": lambda: None, "b": lambda: None, "c": lambda: None}
    assert autotune.PICK_FINALIST_SLACK < 1.5 and autotune.PICK_FINAL_ROUNDS == 3
    monkeypatch.setattr(autotune, "PICK_TIMINGS", {})
    assert autotune.pick_variant("op", (8,), candidates, "c", ()) == "b"
    assert orders == [["a", "b", "c"], ["a", "b"], ["b", "a"], ["a", "b"]]
    assert len(rotations) == 4 and all(r is rotations[0] for r in rotations)          # one set of copies
    assert reps == [autotune.PICK_REP_MS] + [autotune.PICK_REP_MS / 3] * 3    # the rounds share one timing's replays
    assert autotune.PICK_TIMINGS == {"op (8,)": {"first": first, "finalists": {"a": 1.1, "b": 0.9}, "pick": "b"}}
    first, orders[:] = {"a": 1.0, "b": 2.0, "c": 3.0}, []
    assert autotune.pick_variant("op", (16,), candidates, "c", ()) == "a"
    assert orders == [["a", "b", "c"]]
    assert autotune.PICK_TIMINGS["op (16,)"] == {"first": first, "finalists": {"a": 1.0}, "pick": "a"}
    autotune.PICK_TIMINGS.clear()                  # a later process: the pick comes from the cache, and says so
    assert autotune.pick_variant("op", (16,), candidates, "c", ()) == "a" and len(orders) == 1
    assert autotune.PICK_TIMINGS == {"op (16,)": {"pick": "a", "cached": True}}


def test_the_host_side_powers_of_two_are_tritons():
    import triton

    for n in range(1, 5000):
        assert blr_common.pick_bucket(n) == triton.next_power_of_2(n)
        assert blr_common.pow2_at_least(n, 1) == triton.next_power_of_2(n)
    assert blr_common.pick_bucket(0) == 1 and blr_common.pow2_at_least(0) == 16


def test_pick_bucket_keeps_one_and_sixteen_tokens_apart():
    """The pick's N key is a power of two with no floor (n_bucket, the tile key, starts at 16): a pick timed at N = 1
    is not reused at N = 16."""
    assert [blr_common.pick_bucket(n) for n in (1, 2, 3, 16, 17, 1024)] == [1, 2, 4, 16, 32, 1024]
    assert blr_common.n_bucket(1) == blr_common.n_bucket(16) == 16


@pytest.mark.parametrize("op", ["monarch", "blast", "lowrank"])
def test_ops_pick_by_pick_bucket(monkeypatch, op):
    """Each op asks for its variant under pick_bucket(N) (different keys at N = 1, 3 and 16), and offers the same
    candidates at every N of a bucket (N = 100 and 128, across TOKEN_MAJOR_MIN_N's old edge)."""
    class Asked(Exception):
        pass

    keys, offered = [], []

    def ask(op_name, shape_key, offer, args):
        keys.append(shape_key[0])
        offered.append(set(offer()[0]))
        raise Asked

    module = {"monarch": monarch, "blast": blast, "lowrank": lowrank}[op]
    monkeypatch.setattr(module, "auto_variant", ask)
    for n in (1, 3, 16, 100, 128):
        x = torch.randn(n, 12)
        with pytest.raises(Asked):
            if op == "monarch":
                monarch_linear(x, torch.randn(3, 4, 6), torch.randn(3, 6, 5), path="triton")
            elif op == "blast":
                blast_linear(x, torch.randn(3, 5, 7), torch.randn(3, 4, 7), torch.randn(3, 3, 7), path="triton")
            else:
                lowrank_linear(x, torch.randn(9, 7), torch.randn(12, 7), path="triton")
    assert keys == [1, 4, 16, 128, 128] and offered[3] == offered[4]      # one bucket, one set of candidates


@pytest.mark.cpu_only(reason="the CPU stands for the GPU, and the L2 size is the stand-in's")
def test_pick_times_each_variant_over_rotating_copies_of_its_arguments(monkeypatch):
    """The pick calls each candidate on copies of its arguments in turn, enough to hold ROTATE_BYTES, and divides a
    replay's time by the copies (made once for the first timing and the finalists' rounds: the interleaving test)."""
    medians, calls, reps = [8.0, 4.0], [], []

    def bench(fn, rep_ms):
        fn()
        reps.append(rep_ms)
        return medians.pop(0)

    monkeypatch.setattr(autotune, "graph_ms", bench)
    monkeypatch.setattr(autotune, "cuda_device", lambda args: torch.device("cpu"))  # stands for the GPU here
    monkeypatch.setattr(autotune, "ROTATE_BYTES", 10)
    x = torch.ones(1)                                                  # 4 bytes: 3 copies hold 10
    copies = autotune.rotation("op", (x, "option"))
    assert len(copies) == 3 and copies[0][0] is x and all(c[1] == "option" for c in copies)
    assert len({c[0].data_ptr() for c in copies}) == 3 and all(torch.equal(c[0], x) for c in copies)
    candidates = {"a": lambda x, option: calls.append(("a", x.data_ptr())),
                  "b": lambda x, option: calls.append(("b", x.data_ptr()))}
    assert autotune._rotated_times("op", candidates, copies, rep_ms=2.5) == {"a": 8.0 / 3, "b": 4.0 / 3}
    assert calls == [(name, c[0].data_ptr()) for name in "ab" for c in copies] and reps == [2.5, 2.5]
    assert [autotune.rotation_copies(size) for size in (0, 1, 5, 11)] == [10, 10, 2, 1]
    monkeypatch.setattr(autotune, "_l2_bytes", lambda device=None: 10)   # three times the L2 when that is more
    assert autotune.rotation_copies(5) == 6
    monkeypatch.setattr(autotune, "ROTATE_BYTES", 10**6)
    assert autotune.rotation_copies(1) == autotune.ROTATE_MAX_COPIES


@pytest.mark.cpu_only(reason="its first call expects CPU arguments not to be copied")
def test_rotation_copies_nested_and_strided_arguments_as_they_are(monkeypatch):
    """Copies keep what the timed call sees: tensors inside lists and tuples are copied (a gemv pick's per-layer
    weights), a row-strided view keeps its strides (gemv keys its pick by them), a tensor passed twice stays one
    tensor, other values are shared; arguments on the CPU are not copied at all."""
    x = torch.ones(2, 3)
    assert autotune.rotation("op", (x,)) == [(x,)]                  # no GPU tensor: one copy, nothing cloned
    monkeypatch.setattr(autotune, "cuda_device", lambda args: torch.device("cpu"))  # stands for the GPU here
    monkeypatch.setattr(autotune, "ROTATE_BYTES", 10**6)
    down = torch.randn(4, 8)[:, :3]                                    # a partial FFN's down[:, :a]
    weights = [(down, None), (down, torch.ones(4))]
    copy = autotune.rotation("op", (x, weights))[1]
    assert isinstance(copy[1], list) and isinstance(copy[1][0], tuple) and copy[1][0][1] is None
    assert copy[1][0][0] is not down and copy[1][0][0].stride() == down.stride() == (8, 1)
    assert torch.equal(copy[1][0][0], down) and copy[1][1][0] is copy[1][0][0]     # passed twice, copied once
    assert autotune._nbytes((x, weights)) == x.nbytes + down.nbytes + 16
    row = torch.ones(3).expand(4, 3)                                   # overlapping: copied whole, values kept
    copied = autotune.rotation("op", (x, row))[1][1]
    assert copied is not row and torch.equal(copied, row)


def test_rotation_says_when_it_times_partly_from_l2(monkeypatch):
    """Copies that together stay under twice the L2 (the copy cap reached), or no memory for them, are said once."""
    warned = []
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: warned.append(message))
    stand_in, asked = torch.device("cpu"), []                          # stands for the arguments' GPU
    monkeypatch.setattr(autotune, "cuda_device", lambda args: stand_in)
    monkeypatch.setattr(autotune, "_l2_bytes", lambda device: asked.append(device) or 2**20)
    x = torch.ones(16)                                                 # 64 bytes: 64 copies hold 4 KiB
    assert len(autotune.rotation("op", (x,))) == autotune.ROTATE_MAX_COPIES
    assert "less than twice the L2" in warned[0] and asked and all(device is stand_in for device in asked)
    real_empty_strided = torch.empty_strided

    def no_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("no room")

    monkeypatch.setattr(torch, "empty_strided", no_memory)
    assert autotune.rotation("op", (x,)) == [(x,)] and "no memory" in warned[1] and "partly from L2" in warned[1]
    monkeypatch.setattr(torch, "empty_strided", real_empty_strided)


def record_bgemm_choices(monkeypatch, *names) -> dict:
    """name -> the values bgemm's heuristics chose for ``names`` in the launches that follow (which loop ran)."""
    heuristics, taken = batched_gemm._bgemm_kernel.fn, {name: [] for name in names}
    for name in names:
        decide = heuristics.values[name]
        monkeypatch.setitem(heuristics.values, name,
                            lambda meta, decide=decide, name=name: taken[name].append(decide(meta)) or taken[name][-1])
    return taken


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [64, 40])
def test_bgemm_with_and_without_the_k_mask(dtype, k, monkeypatch):
    """K a multiple of the tile's BK (32 under the interpreter) runs the loop without the K mask (EVEN_K);
    40 runs it with the mask. Both against torch, with a regrouped store and a bias."""
    batches, n, cols, grp = 2, 19, 37, 5
    a, b = torch.randn(batches, n, k, dtype=dtype), torch.randn(batches, k, cols, dtype=dtype)
    bias = torch.randn(batches * cols, dtype=dtype)
    c = torch.full((batches * cols * n,), math.nan, dtype=dtype)
    taken = record_bgemm_choices(monkeypatch, "EVEN_K")
    # column col of batch bt at bt * cols + (col // grp) * grp + col % grp, token stride batches * cols
    batched_gemm.bgemm(a, b, c, n, k, cols, batches, a.stride(), b.stride(), (cols, batches * cols, grp, 1), grp=grp,
                       bias=bias)
    if interpreting():                        # one launch of the interpreter's tile; a GPU autotunes over BKs
        assert taken["EVEN_K"] == [k == 64]
    want = (a.double() @ b.double()).transpose(0, 1).reshape(n, batches * cols) + bias.double()
    assert rel(c.view(n, batches * cols), want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("run,runs,stride,window", [(32, 3, 69, False), (6, 3, 17, False), (16, 2, 37, False),
                                                    (6, 3, 16, True), (31, 2, 64, True)])
def test_bgemm_gathers_runs_of_a(dtype, run, runs, stride, window, monkeypatch):
    """a_runs: batch bt's operand is ``runs`` runs of ``run`` columns, run g at g * stride. 32 (the
    interpreter's BK) runs the gathering loop without the K mask, 6 with it and a masked tail, 2 x 16 with
    it though K = 32 (the mask follows the run, not K); with runs starting misaligned (6, 31) in aligned
    rows and runs (strides 16, 64), the loop over aligned windows (31 plus a window's lead: two steps)."""
    batches, n, cols = 2, 9, 11
    size = n * runs * stride
    store = torch.randn(size + batched_gemm.A_WINDOW_SLACK, dtype=dtype)[:size].view(n, runs * stride)
    b = torch.randn(batches, runs * run, cols, dtype=dtype)
    c = torch.full((n, batches * cols), math.nan, dtype=dtype)
    taken = record_bgemm_choices(monkeypatch, "A_GROUPED", "A_WINDOW")
    batched_gemm.bgemm(store, b, c, n, runs * run, cols, batches, (run, store.stride(0), 1), b.stride(),
                       (cols, c.stride(0), 0, 1), a_runs=(run, stride))
    assert set(taken["A_GROUPED"]) == {True} and {bool(w) for w in taken["A_WINDOW"]} == {window}   # every tile
    a = torch.stack([torch.cat([store[:, g * stride + bt * run:][:, :run] for g in range(runs)], dim=1)
                     for bt in range(batches)]).double()
    want = (a @ b.double()).transpose(0, 1).reshape(n, batches * cols)
    assert rel(c, want) < TOL[dtype]


def test_misaligned_runs_load_by_cp_async_only_in_windows():
    """sm_90 PTX of the gathering loop at Llama-7B's shape (runs of t = 93 at a batch stride of 93, rows and
    runs 16-B aligned): reading the runs themselves loads a element by element (2-byte loads, no cp.async:
    nothing to pipeline); the aligned windows load both operands by 16-byte cp.async."""
    aligned = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "san", "sag", "sbb", "sbk", "sbg", "scb", "scn", "K", "C"]
    base = {"HAS_BIAS": False, "PRECISION": "tf32", "LINE": 64, "BN": 128, "BC": 128, "BK": 32, "EVEN_K": False,
            "LAUNCH_DEPENDENTS": False, "WAIT_FOR_PREVIOUS": False, "B_ROWS_CONTIGUOUS": False, "A_GROUPED": True,
            "sak": 1, "sbc": 1, "sci": 1, "BGRP": 93, "B_INTERLEAVED": True}   # bmm_gather's launch
    ptx = compile_sm90({"runs": ("bgemm", {**base, "A_WINDOW": 0}, aligned),
                        "windows": ("bgemm", {**base, "A_WINDOW": 8}, aligned)})
    two_byte_loads = {name: len(re.findall(r"ld\.global(?:\.[a-z0-9]+)*\.b16", text)) for name, text in ptx.items()}
    assert two_byte_loads["runs"] > 0 and two_byte_loads["windows"] == 0
    assert "cp.async.cg" in ptx["windows"]


@pytest.mark.cpu_only(reason="not traced on the GPU: Triton read one of its arguments as a CPU tensor there")
def test_bgemm_windows_need_slack_past_the_last_run():
    """Runs starting misaligned in aligned rows are read in aligned windows, past the last run: a without
    that slack is refused instead of read out of bounds."""
    b, c = torch.randn(2, 6, 5), torch.empty(4, 10)
    last_run_end, slack = 3 + 3 * 16 + 8 + 3, batched_gemm.A_WINDOW_SLACK
    with pytest.raises(MemfitError, match="slack"):
        batched_gemm.bgemm(torch.randn(4, 16), b, c, 4, 6, 5, 2, (3, 16, 1), b.stride(), (5, 10, 0, 1), a_runs=(3, 8))
    room = torch.randn(7 + last_run_end + slack)            # enough from its start, not from a view 8 in
    batched_gemm.bgemm(room, b, c, 4, 6, 5, 2, (3, 16, 1), b.stride(), (5, 10, 0, 1), a_runs=(3, 8))
    with pytest.raises(MemfitError, match="slack"):
        batched_gemm.bgemm(room[8:], b, c, 4, 6, 5, 2, (3, 16, 1), b.stride(), (5, 10, 0, 1), a_runs=(3, 8))


def test_bgemm_runs_must_divide_k():
    a, b, c = torch.randn(4, 6), torch.randn(1, 6, 5), torch.empty(4, 5)
    with pytest.raises(MemfitError, match="runs of 4 do not divide k = 6"):
        batched_gemm.bgemm(a, b, c, 4, 6, 5, 1, (0, 6, 1), (0, *b.stride()), (0, 5, 0, 1), a_runs=(4, 6))


def pruned_bgemm_tiles(n: int, k: int, run: int | None = None, batches: int = 16, cols: int = 512, b_run: int = 0,
                       **flags) -> list:
    """The configs bgemm's autotuner keeps (all of BGEMM_TUNED, pruned) for a launch of this shape, bf16, on a GPU
    of 132 SMs (``b_run``: b's interleaved run length, 0 for none)."""
    import triton

    class Tensor:
        device = "cuda"

        def element_size(self):
            return 2

    configs = [triton.Config({"BN": bn, "BC": bc, "BK": bk, "BATCH_GROUP": g}, num_warps=w, num_stages=st)
               for bn, bc, bk, g, w, st in batched_gemm.BGEMM_TUNED]
    shape = {"N": n, "N_BUCKET": blr_common.n_bucket(n), "C": cols, "K": k, "AGRP": run or k, "BGRP": b_run,
             "BATCHES": batches, "a_ptr": Tensor()}
    return batched_gemm._prune_bgemm(configs, shape, **({"LAUNCH_DEPENDENTS": False, "WAIT_FOR_PREVIOUS": False} | flags))


@pytest.mark.parametrize("chain", [{}, {"LAUNCH_DEPENDENTS": True}, {"WAIT_FOR_PREVIOUS": True}])
def test_decode_bgemm_tiles_depend_on_whether_the_launch_is_in_a_chain(chain):
    """A bgemm launch on its own tunes over the decode sweep's tiles, a stage in a chain over its own."""
    kept = pruned_bgemm_tiles(1, 512, **chain)
    want = batched_gemm.BGEMM_CHAINED_DECODE if chain else batched_gemm.BGEMM_PLAIN_DECODE
    assert [batched_gemm.bgemm_tile(c) for c in kept] == want
    assert {"LAUNCH_DEPENDENTS", "WAIT_FOR_PREVIOUS", "AGRP"} <= set(batched_gemm._bgemm_kernel.keys)
    assert not set(batched_gemm.BGEMM_PLAIN_DECODE) & set(batched_gemm.BGEMM_CHAINED_DECODE)   # else pruned from both


@pytest.mark.parametrize("n,cols,mid", [(16, 128, False), (17, 128, True), (128, 128, True), (128, 256, True),
                                        (128, 512, False), (256, 128, True), (256, 256, False), (257, 128, False),
                                        (8192, 128, False)])
def test_mid_tiles_only_where_the_large_tiles_leave_most_sms_idle(monkeypatch, n, cols, mid):
    """The 64-token tiles of few columns are tuned over in the N buckets above decode up to MID_MAX_N (256: N = 257
    shares 512's bucket, where the large tiles won) where 64 x 128 tiles give fewer programs than half the SMs (16
    batches on 132 SMs: at N = 128, 256 columns make 64 programs, 512 make 128), chained or not."""
    monkeypatch.setattr(batched_gemm, "sm_count", lambda device: 132)
    for chain in ({}, {"WAIT_FOR_PREVIOUS": True}):
        kept = {batched_gemm.bgemm_tile(c) for c in pruned_bgemm_tiles(n, 128, cols=cols, **chain)}
        assert (set(batched_gemm.BGEMM_MID) <= kept) == mid and bool(kept & set(batched_gemm.BGEMM_MID)) == mid


@pytest.mark.cpu_only(reason="on a GPU the process's other tests leave their chained tile pairs in the record")
def test_tile_picks_read_every_tuned_kernels_autotuning_cache(monkeypatch):
    """What each BLR kernel's autotuner took, by kernel and autotuning key, for the benchmarks to record; kernels that
    have not tuned are left out."""
    import triton

    from memfit.kernels import blast, monarch

    names = {kernel.base_fn.__name__ for kernel in autotune.TUNED_KERNELS}
    assert {"_bgemm_kernel", "_fused_kernel", "_permute_kernel", "_tmix_kernel", "_zmix_kernel"} <= names
    for kernel in autotune.TUNED_KERNELS:
        monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(batched_gemm._bgemm_kernel, "cache", {(128, "torch.bfloat16"): triton.Config({"BN": 64},
                                                                                                     num_warps=4)})
    monkeypatch.setattr(monarch._fused_kernel, "cache", {})
    picks = autotune.tile_picks()
    assert list(picks) == ["_bgemm_kernel"] and blast._tmix_kernel in autotune.TUNED_KERNELS
    assert picks["_bgemm_kernel"] == {"(128, 'torch.bfloat16')": str(triton.Config({"BN": 64}, num_warps=4))}
    assert "BN: 64" in picks["_bgemm_kernel"]["(128, 'torch.bfloat16')"]


def tuned_bgemm_configs():
    """Every bgemm config a GPU's autotuner holds (the interpreter's holds one)."""
    import triton

    return [triton.Config({"BN": bn, "BC": bc, "BK": bk, "BATCH_GROUP": g}, num_warps=w, num_stages=st)
            for bn, bc, bk, g, w, st in batched_gemm.BGEMM_TUNED]


def test_the_tiles_offered_a_chained_launch_are_the_autotuners_own(monkeypatch):
    """bgemm_tiles_offered lists what the autotuner would choose between (on a GPU of 132 SMs here): at N = 128 with
    128 columns the mid tiles, no 16-token decode tile and no batch-grouped one; at N = 16 only the chained decode
    tiles for a chained launch and only the plain ones for a plain launch (K = 512: none too deep for it)."""
    monkeypatch.setattr(batched_gemm._bgemm_kernel, "configs", tuned_bgemm_configs())
    monkeypatch.setattr(batched_gemm, "sm_count", lambda device: 132)
    a = torch.empty(1, dtype=torch.bfloat16)
    for flags in ({"launch_dependents": True}, {"wait_for_previous": True}):
        tiles = batched_gemm.bgemm_tiles_offered(a, 128, 128, 128, 16, **flags)
        assert set(batched_gemm.BGEMM_MID) <= set(tiles) and all(tile[0] > 16 for tile in tiles)
        assert len(tiles) == len(set(tiles)) and all(len(tile) == 5 for tile in tiles)
        assert set(batched_gemm.bgemm_tiles_offered(a, 16, 512, 128, 16, **flags)) == set(batched_gemm.BGEMM_CHAINED_DECODE)
    assert set(batched_gemm.bgemm_tiles_offered(a, 16, 512, 128, 16)) == set(batched_gemm.BGEMM_PLAIN_DECODE)


@pytest.fixture
def launched_tiles(monkeypatch):
    """The (BN, BC, BK, warps, stages) of every bgemm launch made with a fixed tile, in order (the autotuner's own
    launches go through it too, so they would show as extra entries)."""
    launched = []
    heuristics = batched_gemm._bgemm_kernel.fn
    run = heuristics.run

    def spy(*args, **kwargs):
        assert kwargs["BATCH_GROUP"] == 1
        launched.append(tuple(kwargs[name] for name in ("BN", "BC", "BK", "num_warps", "num_stages")))
        return run(*args, **kwargs)

    monkeypatch.setattr(heuristics, "run", spy)
    return launched


def test_bgemm_runs_the_tile_it_is_given(launched_tiles):
    """A tile given to bgemm is the one launched (not the autotuner's), with the heuristics still applied: K = 40 is
    no multiple of its BK = 64, so the masked K loop must run for the product to be right. A tile outside its list,
    or one given to cuBLAS, is refused."""
    gen = seeded(3)
    a, b = torch.randn(2, 24, 40, generator=gen), torch.randn(2, 40, 20, generator=gen)
    c = torch.empty(2, 24, 20)
    tile = batched_gemm.BGEMM_PLAIN_DECODE[1]
    assert tile[2] == 64
    launch = lambda tile: batched_gemm.bgemm(a, b, c, 24, 40, 20, 2, a.stride(), b.stride(),   # noqa: E731
                                             (c.stride(0), c.stride(1), 0, 1), tile=tile)
    launch(tile)
    assert rel(c, torch.bmm(a, b)) < 1e-5 and launched_tiles == [tile]
    for wrong in [(16, 32, 64, 2), (16, 32, 64, 1, 2, 8), (24, 32, 64, 2, 8)]:   # short, BGEMM_TUNED's order, not one
        with pytest.raises(MemfitError, match="none of its"):
            launch(wrong)
    with pytest.raises(MemfitError, match="cuBLAS takes no bgemm tile"):
        batched_gemm.per_block_gemm(torch.randn(24, 2, 8), torch.randn(2, 8, 5), None, cublas=True, tile=tile)


CHAINED_TILES = (batched_gemm.BGEMM_PLAIN_DECODE[1], batched_gemm.BGEMM_CHAINED_DECODE[1])   # K steps of 64 and 128


def chained_layer(structure: str, tiles=None):
    """(y by the structure's chained pipeline, with ``tiles`` or as the op picks them, y by the reference): a small
    layer of awkward sizes, 21 tokens."""
    gen = seeded(5)
    new = lambda *shape: torch.randn(*shape, generator=gen)   # noqa: E731
    x = new(21, 3 * 12)
    if structure == "monarch":
        w1, w2 = new(3, 12, 6), new(3, 6, 10)
        run = monarch._two_stage_pdl if tiles is None else functools.partial(monarch._chained_two_stage, tiles=tiles)
        return run(x, w1, w2, None, False), monarch_linear_reference(x, w1, w2)
    if structure == "blast":
        u, v, s = new(3, 10, 7), new(3, 12, 7), new(3, 3, 7)
        run = blast._bgemm_mix_bgemm_pdl if tiles is None else functools.partial(blast._chained_bgemm_mix_bgemm,
                                                                                   tiles=tiles)
        return run(x, u, v, s, None), blast_linear_reference(x, u, v, s)
    u, v, bias = new(30, 7), new(36, 7), new(30)
    run = lowrank._bgemm_pdl if tiles is None else functools.partial(lowrank._chained_bgemm, tiles=tiles)
    return run(x, u, v, bias), lowrank_linear_reference(x, u, v, bias)


@pytest.mark.parametrize("structure", ["monarch", "blast", "lowrank"])
def test_each_chained_pipeline_computes_its_layer_with_the_tiles_it_is_given(structure, launched_tiles):
    """The pipelines whose two GEMMs pick their tiles together, run with a pair of small tiles of uneven K steps: the
    first GEMM launched with the first tile, the last with the second."""
    got, want = chained_layer(structure, CHAINED_TILES)
    assert rel(got, want) < 1e-5 and launched_tiles == list(CHAINED_TILES)


@pytest.fixture
def fake_gpu_chain(monkeypatch):
    """pick_chain_tiles as on a GPU of 132 SMs with every bgemm config, the copies being the arguments themselves and
    each pair's time given by ``times`` (label -> ms; unlisted pairs read 10 ms); nothing written to disk."""
    monkeypatch.setattr(autotune, "_CACHE", {})
    monkeypatch.setattr(autotune, "CHAIN_TILE_MEMO", {})
    monkeypatch.setattr(autotune, "CHAIN_TILE_PICKS", {})
    monkeypatch.setattr(autotune, "_save_cache", lambda cache: None)
    monkeypatch.setattr(autotune, "cuda_device", lambda args: "cuda:0")
    monkeypatch.setattr(autotune, "rotation", lambda op, args: [args])
    monkeypatch.setattr(batched_gemm, "sm_count", lambda device: 132)
    monkeypatch.setattr(batched_gemm._bgemm_kernel, "configs", tuned_bgemm_configs())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    times, timed = {}, []

    def time_candidate(op, name, fn, args, rep_ms):
        timed.append(name)
        fn()
        return times.get(name, 10.0)

    monkeypatch.setattr(autotune, "_time_candidate", time_candidate)
    return times, timed


def test_a_chain_takes_the_pair_of_tiles_fastest_together_and_caches_it(fake_gpu_chain, monkeypatch):
    """Every pair of the two launches' offered tiles is timed as the whole pipeline (run_with given the pair), the
    fastest wins; the pick goes to the cache and into tile_picks, and a later process takes it without timing."""
    times, timed = fake_gpu_chain
    ran = []
    run_with = lambda x, tiles: ran.append(tiles)               # noqa: E731
    x = torch.empty(128, 256, dtype=torch.bfloat16)
    stages = ((128, 256, 16), (256, 128, 16))
    firsts = batched_gemm.bgemm_tiles_offered(x, 128, 128, 256, 16, launch_dependents=True)
    seconds = batched_gemm.bgemm_tiles_offered(x, 128, 256, 128, 16, wait_for_previous=True)
    best = (firsts[-1], seconds[0])
    times[f"{best[0]} + {best[1]}"] = 1.0
    assert batched_gemm.pick_chain_tiles("op", (128,), stages, run_with, (x,)) == best
    assert len(timed) == len(firsts) * len(seconds) and len(set(ran)) == len(timed)
    record = autotune.tile_picks()["chained bgemm pairs"]["op (128,)"]           # with every pair's timing
    assert record["pick"] == f"{best[0]} + {best[1]}" and set(record["first"]) == set(timed)
    timed.clear()
    monkeypatch.setattr(autotune, "CHAIN_TILE_MEMO", {})                   # a later process, the same disk cache
    assert batched_gemm.pick_chain_tiles("op", (128,), stages, run_with, (x,)) == best and timed == []


@pytest.mark.parametrize("structure", ["monarch", "blast", "lowrank"])
def test_each_chained_op_runs_the_pair_its_pick_took(structure, fake_gpu_chain, launched_tiles, monkeypatch):
    """Through its chained pipeline as the op calls it, each structure times its pairs, each run in full (its two
    GEMMs launched with the pair's tiles, once to settle it and once timed), then runs the pair the pick took."""
    import ast

    timed = []

    def time_candidate(op, name, fn, args, rep_ms):          # each timing reads faster than the one before
        timed.append(name)
        fn()
        return 1000.0 - len(timed)

    monkeypatch.setattr(autotune, "_time_candidate", time_candidate)
    got, want = chained_layer(structure)
    label = next(iter(autotune.CHAIN_TILE_PICKS.values()))["pick"]
    assert rel(got, want) < 1e-5 and label in timed
    pairs = len(next(iter(autotune.CHAIN_TILE_PICKS.values()))["first"])
    assert len(launched_tiles) == 2 * pairs + 2 * len(timed) + 2                  # settled, timed, then the run
    assert launched_tiles[-2:] == [ast.literal_eval(tile) for tile in label.split(" + ")]


def test_blasts_gemv_chain_runs_stage_one_with_the_gemm_chains_tile(fake_gpu_chain, launched_tiles):
    """At one token the GEMV chain's stage 1 (the GEMM chain's first launch) runs the tile the GEMM chain's pair gave
    it, timed in a chain, not its autotuner's pick of it alone."""
    times, _ = fake_gpu_chain
    gen = seeded(5)
    x, u, v, s = (torch.randn(*shape, generator=gen) / 8 for shape in [(1, 3 * 128), (3, 10, 128), (3, 128, 128),
                                                                       (3, 3, 128)])   # K = 128: two stage-1 tiles fit
    firsts = batched_gemm.bgemm_tiles_offered(x, 1, 128, 128, 3, launch_dependents=True)
    seconds = batched_gemm.bgemm_tiles_offered(x, 1, 128, 10, 3, wait_for_previous=True)
    times[f"{firsts[-1]} + {seconds[0]}"] = 1.0                   # not the first pair: the GEMM chain's pick
    y = blast._bgemm_mix_gemv_pdl(x, u, v, s, None)
    label = next(iter(autotune.CHAIN_TILE_PICKS.values()))["pick"]
    assert rel(y, blast_linear_reference(x, u, v, s)) < 1e-5 and len(firsts) > 1
    assert label == f"{firsts[-1]} + {seconds[0]}" and launched_tiles[-1] == firsts[-1]


def test_a_chain_first_called_inside_a_capture_leaves_its_tiles_to_the_autotuner_and_says_so(fake_gpu_chain,
                                                                                                 monkeypatch):
    _, timed = fake_gpu_chain
    warned = []
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: warned.append(message))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = torch.empty(16, 256, dtype=torch.bfloat16)
    run_with = lambda x, tiles: pytest.fail("nothing is timed inside a capture")   # noqa: E731
    assert batched_gemm.pick_chain_tiles("op", (16,), ((128, 256, 16), (256, 128, 16)), run_with, (x,)) == (None, None)
    assert timed == [] and "capture" in warned[0] and "autotuner picks alone" in warned[0]


def test_a_chain_whose_pairs_all_fail_leaves_its_tiles_to_the_autotuner_says_so_and_does_not_time_again(
        fake_gpu_chain, monkeypatch):
    """E.g. no memory to time in: each failure is said where it happens (_time_candidate), then once that the stages
    take their own tiles; later calls in the process neither time again nor write the cache."""
    times, timed = fake_gpu_chain
    warned = []
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: warned.append(message))
    monkeypatch.setattr(autotune, "_save_cache", lambda cache: pytest.fail("nothing to cache"))
    monkeypatch.setattr(autotune, "_time_candidate", lambda op, name, fn, args, rep_ms: timed.append(name) or math.inf)
    x = torch.empty(16, 256, dtype=torch.bfloat16)
    stages = ((128, 256, 16), (256, 128, 16))
    assert batched_gemm.pick_chain_tiles("op", (16,), stages, lambda x, tiles: None, (x,)) == (None, None)
    assert len(warned) == 1 and "nothing could be timed" in warned[0] and "autotuner picks alone" in warned[0] and timed
    timed.clear()
    assert batched_gemm.pick_chain_tiles("op", (16,), stages, lambda x, tiles: None, (x,)) == (None, None)
    assert timed == []


@pytest.mark.cpu_only(reason="it checks the pick off the GPU")
def test_off_the_gpu_a_chain_leaves_its_tiles_to_the_autotuner():
    x = torch.empty(16, 256)
    assert batched_gemm.pick_chain_tiles("op", (16,), ((128, 256, 16), (256, 128, 16)), None, (x,)) == (None, None)


@pytest.mark.parametrize("run,want_bk", [(768, {64}), (48, {64, 32, 16}), (16, {32, 16})])
def test_short_run_tiles_only_for_a_gathered_a(run, want_bk):
    """At N = 1024 a plain launch (one run: K = 768) tunes over the 64-wide K tiles; a gathered a in runs of
    48 adds the short-run tiles, and runs of 16 keep only those (a 64-wide step would mask 3/4 of it)."""
    kept = pruned_bgemm_tiles(1024, 768, run)
    assert {c.kwargs["BK"] for c in kept} == want_bk
    short = {batched_gemm.bgemm_tile(c) for c in kept} & set(batched_gemm.BGEMM_SHORT_RUNS)
    assert bool(short) == (run < 768)


@pytest.mark.parametrize("case,grouped", [({"n": 8192, "k": 128}, True), ({"n": 1024, "k": 256}, True),
                                          ({"n": 600, "k": 128}, True), ({"n": 512, "k": 128}, False),
                                          ({"n": 8192, "k": 320}, False), ({"n": 8192, "k": 512}, False),
                                          ({"n": 8192, "k": 128, "run": 32}, False),
                                          ({"n": 8192, "k": 128, "b_run": 32}, False),
                                          ({"n": 8192, "k": 128, "batches": 1}, False),
                                          ({"n": 8192, "k": 128, "WAIT_FOR_PREVIOUS": True}, False),
                                          ({"n": 8192, "k": 128, "LAUNCH_DEPENDENTS": True}, False)])
def test_batch_grouped_tiles_only_for_few_k_steps_at_large_n(case, grouped):
    """BGEMM_GROUPED's tiles are tuned over for a plain launch (one run of K in a and b, no chain, several batches) with
    K <= BATCH_GROUP_MAX_K (256) in an N bucket >= BATCH_GROUP_MIN_N (1024: N = 600 shares 1024's bucket, so its
    pick), beside the one-batch tiles."""
    groups = {c.kwargs["BATCH_GROUP"] for c in pruned_bgemm_tiles(**case)}
    assert groups == ({1, 4, 8} if grouped else {1})


@pytest.mark.parametrize("tile", [(128, 128, 16, 4, 5), (128, 128, 32, 4, 4), (64, 64, 64, 4, 4)])
@pytest.mark.parametrize("t,gathered", [(32, False), (64, False), (5, False), (64, True), (48, True)])
def test_interleaved_b_rows_at_every_step_width(tile, t, gathered):
    """bgemm reading b's rows interleaved (Monarch's w2 in (s, j) order, b = 3 runs of t) with K steps narrower than a
    run (t = 32 and 64 in 16- and 32-wide steps: k0 % t != 0), as wide as one (32 and 64), or spanning runs (t = 5),
    in the plain loop and, where a is gathered from runs of the same length, in the grouped loop, against torch
    reading the same rows in (j, s) order."""
    g, n, p = 3, 7, 24
    gen = seeded(3)
    w = torch.randn(1, t * g, p, generator=gen)                           # rows s g + j
    in_j_s_order = w.view(1, t, g, p).transpose(1, 2).reshape(1, g * t, p)
    c = torch.full((n, p), math.nan)
    if gathered:                                                         # a's run j: t columns, 2 t apart
        a = torch.randn(n, 2 * t * g, generator=gen)
        batched_gemm.bgemm(a, w, c, n, g * t, p, 1, (0, a.stride(0), 1), w.stride(), (0, p, 0, 1), a_runs=(t, 2 * t),
                           b_interleaved=g, tile=tile)
        a = a.view(n, g, 2 * t)[:, :, :t].reshape(n, g * t)
    else:
        a = torch.randn(n, g * t, generator=gen)
        batched_gemm.bgemm(a, w, c, n, g * t, p, 1, (0, a.stride(0), 1), w.stride(), (0, p, 0, 1), b_interleaved=g,
                           tile=tile)
    torch.testing.assert_close(c, a @ in_j_s_order[0], rtol=1e-4, atol=1e-4)


def test_bgemm_refuses_interleaved_rows_it_cannot_read():
    a, w, c = torch.randn(4, 12), torch.randn(1, 12, 8), torch.empty(4, 8)
    args = (a, w, c, 4, 12, 8, 1, (0, 12, 1), w.stride(), (0, 8, 0, 1))
    with pytest.raises(MemfitError, match="5 interleaved runs do not divide k = 12"):
        batched_gemm.bgemm(*args, b_interleaved=5)
    with pytest.raises(MemfitError, match="runs of 4 must be a's runs of 3"):
        batched_gemm.bgemm(*args, a_runs=(3, 3), b_interleaved=3)
    k_major = torch.randn(1, 8, 12).transpose(1, 2)                      # unit stride along k, not along col
    with pytest.raises(MemfitError, match="interleaved b rows only with a unit column stride"):
        batched_gemm.bgemm(a, k_major, c, 4, 12, 8, 1, (0, 12, 1), k_major.stride(), (0, 8, 0, 1), b_interleaved=3,
                           wait_for_previous=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batches,group,k,even_k", [(5, 2, 40, False), (5, 3, 32, True), (4, 4, 64, True),
                                                    (3, 8, 16, True)])
def test_bgemm_batch_groups(dtype, batches, group, k, even_k):
    """BATCH_GROUP batches per program in one flat loop of K steps, storing each batch's tile at its last step:
    every batch written (poisoned output), the last group partial (5 = 2 + 2 + 1, 3 of 8), K masked (40 in
    16-wide steps) or not, with the regrouping store and a bias, against torch."""

    n, cols, grp, bn, bc, bk = 37, 21, 7, 16, 16, 16
    a, b = torch.randn(batches, n, k, dtype=dtype), torch.randn(batches, k, cols, dtype=dtype)
    bias = torch.randn(batches * cols, dtype=dtype)
    c = torch.full((batches * cols * n,), math.nan, dtype=dtype)
    grid = batched_gemm.bgemm_grid(n, cols, batches, bn, bc, group)
    batched_gemm.jit_function(batched_gemm._bgemm_kernel)[grid](
        a, b, c, bias, n, k, cols, grp, k, batches, 0, *a.stride(), 0, *b.stride(), k * b.stride(1), cols,
        batches * cols, grp, 1, 0,
        HAS_BIAS=True, PRECISION=blr_common.blr_precision(dtype), LAUNCH_DEPENDENTS=False, WAIT_FOR_PREVIOUS=False,
        B_ROWS_CONTIGUOUS=False, LINE=32, BN=bn, BC=bc, BK=bk, EVEN_K=even_k, A_GROUPED=False, A_WINDOW=0,
        BATCH_GROUP=group)
    want = (a.double() @ b.double()).transpose(0, 1).reshape(n, batches * cols) + bias.double()
    assert rel(c.view(n, batches * cols), want) < TOL[dtype]


def test_batch_grouped_loop_pipelines_across_batches():
    """sm_90 PTX of a grouped tile as Monarch's stage 1 runs it (K = 128, token-major store): with the store inside
    the flat loop over the batches' K steps, both operands still load by cp.async into wgmma and the store stays
    16-byte vectors (what the plain loop compiles to; this checks the grouped loop keeps it, not that it is faster)."""
    aligned = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "sab", "san", "sbb", "sbk", "K", "C", "N", "AGRP", "scb",
               "scg", "sci"]
    tile = {"HAS_BIAS": False, "PRECISION": "tf32", "LINE": 64, "BN": 256, "BC": 128, "BK": 64, "EVEN_K": True,
            "LAUNCH_DEPENDENTS": False, "WAIT_FOR_PREVIOUS": False, "B_ROWS_CONTIGUOUS": False, "A_GROUPED": False,
            "A_WINDOW": 0, "sak": 1, "sbc": 1, "scn": 1, "BATCH_GROUP": 8, "BGRP": 0}
    assert (256, 128, 64, 8, 8, 3) in batched_gemm.BGEMM_GROUPED
    ptx = compile_sm90({"grouped": ("bgemm", tile, aligned, 3, 8)})["grouped"]
    assert "cp.async.cg" in ptx and "wgmma.mma_async" in ptx
    assert set(re.findall(r"st\.global[a-z0-9.]*", ptx)) == {"st.global.v4.b32"}


def test_tile_configs_are_tuned_by_autotune_bench(monkeypatch):
    """On the GPU every BLR kernel's autotune times its configs with autotune_bench: graph replays of each call
    after a flush of twice the L2 (for ranking only: the flush is not timed apart); it refuses to run inside a
    CUDA graph capture."""
    import triton

    monkeypatch.setattr(autotune, "interpreting", lambda: False)

    @triton.jit
    def plain(x_ptr, B: tl.constexpr):
        pass

    tuner = autotune.tuned([(16, 4, 2), (32, 4, 2)], ("B",), (16, 4, 1), key=[])(plain)
    assert tuner.do_bench is autotune.autotune_bench

    sizes, timed = stub_l2_flush(monkeypatch), []
    monkeypatch.setattr(autotune, "_graph_ms", lambda fn, args: fn() and timed.append("timed") or 1.5)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls = []
    assert autotune.autotune_bench(lambda: calls.append("call"), quantiles=(0.5, 0.2, 0.8)) == [1.5, 1.5, 1.5]
    assert sizes == [2 * 2**20] and calls == ["call"] and timed == ["timed"]     # flush and call in one timing
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(MemfitError, match="before capturing"):
        autotune.autotune_bench(lambda: None, quantiles=(0.5,))


def test_a_picks_source_digest_looks_each_code_object_up_once(monkeypatch):
    """The digest in every pick's cache key (built at each call of an op) looks up a candidate's source file once
    per code object, closures made anew at each call too (gemv's), and gives the same digest as before. The digest
    covers every kernel module, so that an edited kernel which no candidate defines (bgemm, gemv's block GEMV in
    BLAST's chain) invalidates the picks too."""
    import inspect

    from memfit.kernels import gemv, monarch

    looked_up, real = [], inspect.getsourcefile
    monkeypatch.setattr(inspect, "getsourcefile", lambda obj: looked_up.append(obj) or real(obj))
    monkeypatch.setattr(autotune, "_code_source_file", functools.cache(autotune._code_source_file.__wrapped__))
    fns = tuple(monarch.VARIANTS.values()) + (gemv.over_group("cublas"),)
    first = autotune.source_digest(fns)
    assert len(looked_up) == len({fn.__code__ for fn in fns})
    assert autotune.source_digest(tuple(monarch.VARIANTS.values()) + (gemv.over_group("gemv_n4_k1024_w4"),)) == first
    assert len(looked_up) == len({fn.__code__ for fn in fns})
    assert first == autotune._digest_files(tuple(sorted({real(fn) for fn in fns} | set(autotune.kernel_sources()))))
    assert batched_gemm.__file__ in autotune.kernel_sources()   # the GEMM the candidates run, in no candidate's file


def test_the_l2_flush_reads_its_buffer_without_a_copy_of_it():
    """The flush before each tile timing allocates nothing near its buffer's size: a sum of its uint8 buffer copied
    it to int64 first, 1 GB beside an H200's 126 MB flush (measured on the CPU here, where the op is the same)."""
    from torch.profiler import profile

    size = 32 * 2**20
    flush = autotune.l2_flush(size, torch.device("cpu"))
    with profile(profile_memory=True) as prof:
        flush()
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())
    assert allocated < 2**20


def stub_l2_flush(monkeypatch) -> list:
    """A GPU with a 1 MiB L2 whose flush buffer is allocated on the CPU; returns the sizes allocated."""
    class Properties:
        L2_cache_size = 2**20

    real_empty, sizes = torch.empty, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch, "empty", lambda size, dtype, device: sizes.append(size) or real_empty(size, dtype=dtype))
    return sizes


def test_autotuning_without_memory_for_the_flush_times_warm_and_says_so(monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("no room")

    stub_l2_flush(monkeypatch)
    monkeypatch.setattr(torch, "empty", no_memory)
    timed, warned = [], []
    monkeypatch.setattr(autotune, "_graph_ms", lambda fn, args: timed.append(fn) or 2.0)
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: warned.append(message))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def kernel_call():
        return None

    assert autotune.autotune_bench(kernel_call) == 2.0
    assert timed == [kernel_call] and "warm L2" in warned[0]


def test_autotuning_lets_failures_through(monkeypatch):
    """A config that fails goes to triton.autotune (which skips one that does not fit and raises anything else),
    where a pipeline variant that fails is skipped by the pick itself."""
    def bench(fn, rep_ms):
        raise RuntimeError("a broken config")

    stub_l2_flush(monkeypatch)
    monkeypatch.setattr(autotune, "graph_ms", bench)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(RuntimeError, match="broken config"):
        autotune.autotune_bench(lambda: None)
    assert autotune._rotated_times("op", {"variant": lambda: None}, [()]) == {"variant": float("inf")}


def test_graph_timings_reuse_one_side_stream_after_the_callers_work(monkeypatch):
    """Every timing runs on one side stream per device (each new stream cuBLAS runs on gets a workspace that torch
    keeps: about 1 GiB after one model's picks when each timing took a new one), which first waits for the work
    queued on the caller's stream."""
    from memfit.measure import timing

    events, made = [], []

    class Stream:
        def __init__(self):
            made.append(self)

        def wait_stream(self, other):
            events.append(("wait", other))

    class Event:
        def record(self):
            events.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 5.0

    class Graph:
        def replay(self):
            events.append("replay")

    class Caller:
        def wait_stream(self, other):
            events.append(("caller waits for", other))

    caller = Caller()
    monkeypatch.setattr(timing, "_TIMING_STREAMS", {})
    for name, value in {"Stream": Stream, "Event": lambda enable_timing: Event(), "CUDAGraph": Graph,
                        "current_device": lambda: 0, "current_stream": lambda: caller,
                        "stream": lambda stream: events.append(("on", stream)) or contextlib.nullcontext(),
                        "graph": lambda graph, stream: events.append(("capture on", stream)) or contextlib.nullcontext()
                        }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    calls = []
    assert timing.graph_ms(lambda: calls.append(1), rep_ms=10) == 0.5    # 1 ms a call estimated: 10 in the graph
    assert timing.graph_ms(lambda: None) == 0.25                             # 20 ms by default
    assert len(made) == 1 and events[0] == ("wait", caller) and events.count("replay") == 2 * timing.GRAPH_REPLAYS
    side = made[0]
    assert [e for e in events if isinstance(e, tuple) and e[0] != "wait"] == [
        ("on", side), ("capture on", side), ("caller waits for", side)] * 2
    events.clear()
    with pytest.raises(RuntimeError, match="broken"):
        timing.graph_ms(lambda: (_ for _ in ()).throw(RuntimeError("broken")))
    assert events[-1] == ("caller waits for", side)                          # also when the timed call fails
    assert len(calls) == 1 + 5 + 10                                            # warm-up, estimate, captured


def test_a_variant_that_fails_to_run_is_not_picked(monkeypatch):
    def bench(fn, rep_ms):
        return fn()

    def broken(x):
        raise RuntimeError("out of resources")

    warned = []
    monkeypatch.setattr(autotune, "graph_ms", bench)
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: warned.append(message))
    assert autotune._time_candidate("op", "broken", broken, (1,)) == float("inf")
    assert "broken" in warned[0] and "out of resources" in warned[0]


def test_fp32_blr_dots_follow_torch_matmul_precision(monkeypatch, caplog):
    """fp32 BLR kernels run IEEE dots by default and TF32 only when torch allows it, said once."""
    from memfit import log

    monkeypatch.setattr(log, "_said", set())
    x, w1, w2 = torch.randn(N, B * M), torch.randn(B, M, 6), torch.randn(B, 6, P)
    monarch_linear(x, w1, w2, path="triton", variant="two_stage")
    assert "TF32" not in caplog.text
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        monarch_linear(x, w1, w2, path="triton", variant="two_stage")
    finally:
        torch.set_float32_matmul_precision(previous)
    assert "block-low-rank kernels: fp32 inputs use TF32" in caplog.text


@pytest.mark.parametrize("blocks,rank,n,widest", [(16, 512, 8192, 128 * 16 * 16), (3, 19, 1, 16 * 32 * 16),
                                                   (32, 512, 8192, 16 * 32 * 32), (64, 512, 8192, 16 * 16 * 64)])
def test_zmix_tiles_fit_the_registers(blocks, rank, n, widest):
    """The mixing kernel's tiles hold a (BK, BN, BB) fp32 result: at most 128 registers a thread for b up
    to 64, and no wider in ranks or tokens than the shape needs."""
    import triton

    from memfit.kernels.blr_common import pow2_at_least

    configs = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in blast.ZMIX_CONFIGS]
    kept = blast._prune_zmix(configs, {"R": rank, "N": n}, BB=pow2_at_least(blocks))
    assert kept
    for c in kept:
        assert c.kwargs["BK"] * c.kwargs["BN"] * pow2_at_least(blocks) <= 128 * 32 * c.num_warps
        assert c.kwargs["BK"] <= pow2_at_least(rank) and c.kwargs["BN"] <= pow2_at_least(n)
    assert max(c.kwargs["BK"] * c.kwargs["BN"] * pow2_at_least(blocks) for c in kept) == widest


XV_ALL = [(16, 16, 32, 8, 2), (16, 16, 16, 4, 2), (16, 32, 16, 8, 3), (32, 16, 32, 8, 2), (64, 16, 16, 8, 3),
          (16, 64, 16, 8, 3), (32, 32, 16, 8, 3)]


@pytest.mark.parametrize("blocks,rank,n,m,dtype,kept", [
    (16, 512, 1024, 128, torch.bfloat16, XV_ALL),                                   # Llama-1B gate: every tile
    (16, 256, 1, 128, torch.bfloat16, [c for c in XV_ALL if c[0] == 16]),           # decode: 16-token tiles
    (3, 19, 19, 11, torch.bfloat16, [(16, 16, 16, 4, 2), (16, 32, 16, 8, 3), (32, 32, 16, 8, 3)]),  # narrow
    (16, 512, 1024, 128, torch.float32, [c for c in XV_ALL if c not in ((64, 16, 16, 8, 3), (16, 64, 16, 8, 3))]),
    (32, 1488, 128, 344, torch.bfloat16, XV_ALL[:4]),                               # b = 32: half the registers
    (64, 512, 128, 128, torch.bfloat16, [(16, 16, 16, 4, 2)]),                       # none fits: the smallest
])
def test_xvmix_tiles_fit_registers_and_shared_memory(blocks, rank, n, m, dtype, kept):
    """The fused stage-1-and-mixing kernel's tiles: a (BB, BN, BK) fp32 result of at most 64 registers a
    thread (all listed tiles: at most 8 B of spills at b = 16 in bf16), X and V slices within shared memory at their
    stage count (fp32 drops the two 3-stage 80-wide ones), no wider than tokens, ranks and input block
    need; where nothing fits, the tile with the smallest slices."""
    import triton

    from memfit.kernels.blr_common import pow2_at_least

    assert blast.XVMIX_CONFIGS == XV_ALL
    configs = [triton.Config({"BN": bn, "BK": bk, "BM": bm}, num_warps=w, num_stages=st)
               for bn, bk, bm, w, st in blast.XVMIX_CONFIGS]
    chosen = blast._prune_xvmix(configs, {"R": rank, "N": n, "M": m, "x_ptr": torch.empty(0, dtype=dtype)},
                                BB=pow2_at_least(blocks))
    assert [(c.kwargs["BN"], c.kwargs["BK"], c.kwargs["BM"], c.num_warps, c.num_stages) for c in chosen] == kept


@pytest.mark.parametrize("op,reference,shapes", [
    (lowrank_linear, lowrank_linear_reference, [(2, N, B * M), (P, 5), (B * M, 5), (P,)]),
    (monarch_linear, monarch_linear_reference, [(2, N, B * M), (B, M, B * 5), (B, B * 5, P), (B * P,)]),
    (blast_linear, blast_linear_reference, [(2, N, B * M), (B, P, 5), (B, M, 5), (B, B, 5), (B * P,)])])
def test_a_frozen_layer_keeps_no_input_for_its_backward(op, reference, shapes):
    """With no weight needing a gradient (LoRA elsewhere), the op saves only its weights, not x, and still gives
    x's gradient: every reference is linear in x, so the backward differentiates it at x = 0. With a weight that
    needs one, x is saved."""
    tensors = [torch.randn(*shape) for shape in shapes]
    for frozen in (True, False):
        x = tensors[0].clone().requires_grad_()
        weights = [t.clone().requires_grad_(not frozen) for t in tensors[1:]]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=saved: kept.append(t) or t, lambda t: t):
            y = op(x, *weights, path="triton")
        assert any(t.shape == x.shape for t in saved) != frozen
        grad = torch.randn_like(y)
        got, = torch.autograd.grad(y, x, grad)
        xr = x.detach().double().requires_grad_()
        want, = torch.autograd.grad(reference(xr, *(w.detach().double() for w in weights)), xr, grad.double())
        assert rel(got, want) < TOL[torch.float32]


def _monarch_factors(b=4, m=8, r=8, p=12):
    return torch.randn(b, m, r), torch.randn(b, r, p)


@pytest.mark.parametrize("call,message", [
    (lambda x: monarch_linear(x, torch.randn(4, 8, 8), torch.randn(3, 8, 12)), r"w2 has shape \(3, 8, 12\).*b = 4"),
    (lambda x: monarch_linear(x, *_monarch_factors(), torch.randn(7)), r"bias has shape \(7,\); expected \(48,\)"),
    (lambda x: monarch_linear(x, *_monarch_factors(r=7)), "not a multiple of blocks"),
    (lambda x: monarch_linear(x[:, :31], *_monarch_factors()), "last dimension must be b \\* m = 32"),
    (lambda x: monarch_linear(x, torch.randn(4, 8), torch.randn(4, 8, 12)), r"w1 has shape \(4, 8\); expected"),
    (lambda x: blast_linear(x, torch.randn(4, 3, 6), torch.randn(4, 8, 6), torch.randn(4, 3, 6)), "s has shape"),
    (lambda x: lowrank_linear(x, torch.randn(10, 4), torch.randn(32, 5)), r"v has shape \(32, 5\).*r = 4"),
    (lambda x: lowrank_linear(x.long(), torch.randn(10, 4), torch.randn(32, 4), path="triton"), "floating point"),
    (lambda x: monarch_linear(x.int(), *_monarch_factors(), path="reference"), "floating point"),
])
def test_blr_ops_refuse_factors_that_do_not_fit(call, message):
    """Shapes and x's dtype are checked before any kernel: unchecked, a w2 with fewer blocks was read out of bounds,
    a rank not a multiple of blocks corrupted the interpreter's memory, and integer x truncated the weights."""
    with pytest.raises(MemfitError, match=message):
        call(torch.randn(5, 32))


def test_blr_ops_refuse_a_variant_where_the_reference_runs_and_take_no_tokens():
    x, (w1, w2) = torch.randn(5, 32), _monarch_factors()
    with pytest.raises(MemfitError, match="names a Triton pipeline"):
        monarch_linear(x, w1, w2, path="reference", variant="tbmm")
    with pytest.raises(MemfitError, match="names a Triton pipeline"):
        lowrank_linear(x, torch.randn(10, 4), torch.randn(32, 4), path="reference", variant="cublas")
    assert monarch_linear(x[:0], w1, w2).shape == (0, 48)
    assert blast_linear(x[:0], torch.randn(4, 3, 6), torch.randn(4, 8, 6), torch.randn(4, 4, 6)).shape == (0, 12)
    assert lowrank_linear(x[:0], torch.randn(10, 4), torch.randn(32, 4)).shape == (0, 10)
