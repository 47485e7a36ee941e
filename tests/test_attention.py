"""memfit.kernels.attention against a float64 reference (Triton kernels run in the interpreter)."""
import math

import pytest
import torch

from memfit.errors import MemfitError
from memfit.kernels.attention import VARIANTS, attention, attention_recompute_backward, attention_reference
from memfit.models.hf_calls import cache_keyword

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _model(spec, implementation: str = "sdpa"):
    """A float32 random-init model of ``spec`` with that attention, on torch's default device (CUDA under
    MEMFIT_TEST_DEVICE=cuda)."""
    from memfit.models import build_model

    return build_model(spec, dtype="float32", device=torch.get_default_device(), attn_implementation=implementation)


def _rel(a, b):
    """Relative L2 error; the floor keeps exactly-zero references (dq of a 1-token row) meaningful."""
    floor = 0.1 * math.sqrt(b.numel())
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor)).item()


def _inputs(shape_q, shape_kv, dtype, packed_lens=None):
    q = torch.randn(shape_q, dtype=dtype)
    k = torch.randn(shape_kv, dtype=dtype)
    v = torch.randn(shape_kv, dtype=dtype)
    do = torch.randn(shape_q, dtype=dtype)
    cu = None
    if packed_lens is not None:
        cu = torch.tensor([0, *torch.tensor(packed_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, do, cu


def _reference_grads(q, k, v, do, causal, cu):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*leaves, causal=causal, cu_seqlens=cu)
    return (out, *torch.autograd.grad(out, leaves, do.double()))


def _ours(q, k, v, do, causal, cu, backward):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, causal=causal, cu_seqlens=cu, backward=backward, path="triton")
    return (out, *torch.autograd.grad(out, leaves, do))


def _assert_close(got, want, tol, what, names=("out", "dq", "dk", "dv")):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, (what, name)
        assert torch.isfinite(g).all(), (what, name, "non-finite")
        err = _rel(g, w)
        assert err < tol, f"{what} {name}: relative error {err:.2e} >= {tol:.0e}"


# (B, Hq, Hkv, N, D): lengths off the block sizes (16, 32), one token, GQA 1/4/8, odd D.
DENSE = [
    (2, 1, 1, 19, 16),
    (1, 4, 1, 33, 32),
    (1, 8, 1, 17, 16),
    (1, 2, 2, 1, 16),
    (1, 2, 1, 21, 24),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", DENSE, ids=lambda s: "x".join(map(str, s)))
def test_dense_matches_float64(shape, causal):
    b, hq, hk, n, d = shape
    q, k, v, do, _ = _inputs((b, hq, n, d), (b, hk, n, d), torch.float32)
    _assert_close(_ours(q, k, v, do, causal, None, "two_pass"), _reference_grads(q, k, v, do, causal, None),
                  TOL[torch.float32], f"dense {shape} causal={causal}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens,hq,hk", [((5, 23, 1), 4, 2), ((17, 2), 4, 1)])
def test_packed_matches_float64(lens, hq, hk, causal):
    t = sum(lens)
    q, k, v, do, cu = _inputs((t, hq, 16), (t, hk, 16), torch.float32, lens)
    _assert_close(_ours(q, k, v, do, causal, cu, "two_pass"), _reference_grads(q, k, v, do, causal, cu),
                  TOL[torch.float32], f"packed {lens} causal={causal}")


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_recompute"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_backward_variant_agrees(variant, fused, monkeypatch):
    """Each variant, separate and fused recompute, on a causal GQA packed batch, with poisoned buffers."""
    poison_all_allocations(monkeypatch)
    lens, hq, hk, d = (9, 3, 36), 4, 2, 16
    q, k, v, do, cu = _inputs((sum(lens), hq, d), (sum(lens), hk, d), torch.float32, lens)
    want = _reference_grads(q, k, v, do, True, cu)
    if fused:
        got = (want[0], *attention_recompute_backward(q, k, v, do, causal=True, cu_seqlens=cu, backward=variant,
                                                      path="triton"))
    else:
        got = _ours(q, k, v, do, True, cu, variant)
    # all variants within 1e-5 of the float64 reference, hence within 2e-5 of each other
    _assert_close(got, want, TOL[torch.float32], f"{variant} fused={fused}")


@pytest.mark.parametrize("variant", ["atomic", "partial_buffers"])
def test_fused_recompute_equals_separate_dense_noncausal(variant):
    q, k, v, do, _ = _inputs((1, 4, 37, 16), (1, 1, 37, 16), torch.float32)
    separate = _ours(q, k, v, do, False, None, variant)[1:]
    fused = attention_recompute_backward(q, k, v, do, causal=False, backward=variant, path="triton")
    for s, f in zip(separate, fused):
        assert _rel(f, s) < 1e-5


@pytest.mark.parametrize("dtype,causal,packed", [(torch.bfloat16, True, False), (torch.float16, False, True),
                                                 (torch.bfloat16, True, True)])
def test_half_precision(dtype, causal, packed):
    if packed:
        lens = (9, 30)
        q, k, v, do, cu = _inputs((39, 4, 32), (39, 1, 32), dtype, lens)
    else:
        q, k, v, do, cu = _inputs((2, 4, 29, 32), (2, 2, 29, 32), dtype)
    want = _reference_grads(q, k, v, do, causal, cu)
    _assert_close(_ours(q, k, v, do, causal, cu, "two_pass"), want, TOL[dtype], f"{dtype}")
    fused = attention_recompute_backward(q, k, v, do, causal=causal, cu_seqlens=cu, backward="atomic_remap",
                                         path="triton")
    _assert_close((want[0], *fused), want, TOL[dtype], f"{dtype} fused")


def poison_all_allocations(monkeypatch):
    """Every float tensor from torch.empty/empty_like starts as NaN, so unwritten elements show."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(fn):
        def make(*args, **kwargs):
            t = fn(*args, **kwargs)
            return t.fill_(math.nan) if t.is_floating_point() else t
        return make

    monkeypatch.setattr(torch, "empty", poisoned(empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(empty_like))


def test_poisoned_forward_outputs_all_written(monkeypatch):
    poison_all_allocations(monkeypatch)
    q, k, v, do, _ = _inputs((2, 2, 35, 16), (2, 1, 35, 16), torch.float32)
    _assert_close(_ours(q, k, v, do, False, None, "two_pass"), _reference_grads(q, k, v, do, False, None),
                  TOL[torch.float32], "poisoned")


def test_transposed_inputs_and_reference_path():
    """HF hands (B, N, H, D) tensors transposed to (B, H, N, D): strides must be honoured."""
    q, k, v, _, _ = _inputs((2, 21, 4, 16), (2, 21, 2, 16), torch.float32)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    ours = attention(q, k, v, causal=True, path="triton")
    ref = attention(q, k, v, causal=True, path="reference")
    assert _rel(ours, ref) < 1e-5


def _through_views(leaves, views, do, causal, cu, backward, fused):
    """Output and the leaves' gradients of attention on ``views(*leaves)``: q, k, v that are views with gaps (split
    from a fused QKV tensor) or that repeat (k and v expanded over heads), with poisoned buffers. ``fused``: the
    gradients of attention_recompute_backward, carried back to the leaves through the views."""
    kwargs = {"causal": causal, "cu_seqlens": cu, "backward": backward, "path": "triton"}
    grad_leaves = [t.clone().requires_grad_() for t in leaves]
    out = attention(*views(*grad_leaves), **kwargs)
    if fused:
        grads = attention_recompute_backward(*views(*leaves), do, **kwargs)
        return (out, *torch.autograd.grad(views(*grad_leaves), grad_leaves, grads))
    return (out, *torch.autograd.grad(out, grad_leaves, do))


def _reference_through_views(leaves, views, do, causal, cu):
    """:func:`_through_views` by the float64 reference."""
    leaves = [t.double().requires_grad_() for t in leaves]
    out = attention_reference(*views(*leaves), causal=causal, cu_seqlens=cu)
    return (out, *torch.autograd.grad(out, leaves, do.double()))


def _split_batched(qkv):
    """(B, N, 3 * 2 * D) -> q, k, v (B, 2, N, D), as a fused QKV projection's output is split: views with gaps."""
    b, n, _ = qkv.shape
    return qkv.view(b, n, 3, 2, -1).permute(2, 0, 3, 1, 4).unbind(0)


def _split_packed(qkv):
    """(T, 3, H, D) -> q, k, v (T, H, D): views with gaps."""
    return qkv.unbind(1)


@pytest.mark.parametrize("dtype,backward,fused", [
    (torch.float32, "two_pass", False), (torch.float32, "atomic", False), (torch.float32, "partial_buffers", False),
    (torch.float32, "two_pass", True), (torch.bfloat16, "two_pass", False)],
    ids=["fp32-two_pass", "fp32-atomic", "fp32-partial_buffers", "fp32-two_pass-fused_recompute", "bf16-two_pass"])
@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_fused_qkv_split_matches_float64(layout, dtype, backward, fused, monkeypatch):
    """q, k, v split from one fused QKV tensor have gaps between their rows. Until the fix the kernels stored O, dQ,
    dK and dV by the inputs' strides into buffers that empty_like had laid out densely: a wrong forward (rows left
    unwritten) and writes out of bounds in the backward."""
    poison_all_allocations(monkeypatch)
    if layout == "batched":
        qkv, views, cu = torch.randn(2, 19, 3 * 2 * 16, dtype=dtype), _split_batched, None
    else:
        qkv, views, cu = torch.randn(23, 3, 2, 16, dtype=dtype), _split_packed, torch.tensor([0, 5, 23], dtype=torch.int32)
    do = torch.randn_like(views(qkv)[0])
    _assert_close(_through_views([qkv], views, do, True, cu, backward, fused),
                  _reference_through_views([qkv], views, do, True, cu), TOL[dtype],
                  f"{layout} {dtype} {backward} fused={fused}", names=("out", "dqkv"))


# Rows 2**30 + 64 elements apart, so that row 2's offset, 2**31 + 128, passes int32 while every stride still fits
# it (Triton passes a stride below 2**31 as int32). The storage is 3 x (2**30 + 64) float16 elements (6 GiB of address
# space, of which the run touches a few rows); in a child process, since an offset that overflows reads outside the
# tensor: a crash.
WIDE_ROWS_SCRIPT = """
import sys, torch
from memfit.kernels.attention import VARIANTS, attention, attention_recompute_backward, attention_reference
stride, rows, dim = 2**30 + 64, 3, 16
base = torch.empty(rows * stride, dtype=torch.float16, device=sys.argv[1])
torch.manual_seed(0)
q, k, v, do = (torch.as_strided(base, (1, 1, rows, dim), (rows * stride, rows * stride, stride, 1), i * dim)
               .copy_(torch.randn(1, 1, rows, dim)) for i in range(4))
leaves = [t.double().requires_grad_() for t in (q, k, v)]
out = attention_reference(*leaves, causal=True)
want = (out, *torch.autograd.grad(out, leaves, do.double()))
def worst(got):
    return max(((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want))
for variant in VARIANTS:
    qkv = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention(*qkv, causal=True, backward=variant, path="triton")
    got = (out, *torch.autograd.grad(out, qkv, do))
    recomputed = attention_recompute_backward(q, k, v, do, causal=True, backward=variant, path="triton")
    print(variant, worst(got), worst((want[0], *recomputed)))
"""


def test_row_offsets_past_int32_are_computed_in_int64():
    """A sequence whose row offsets pass 2**31 elements (about 175K tokens with a fused QKV projection's 12288-element
    rows) had its offsets wrap around in int32: the kernels read and wrote outside their tensors. Such a launch now
    computes them in int64 (WIDE); an ordinary one keeps int32."""
    import subprocess
    import sys

    from memfit.kernels.attention import _geom, _wide_rows

    small = torch.empty(1, 2, 4096, 64)
    assert not _wide_rows(_geom(small, small, None, None), small)
    device = str(torch.get_default_device())
    done = subprocess.run([sys.executable, "-c", WIDE_ROWS_SCRIPT, device], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in done.stdout.splitlines()}
    assert sorted(errors) == sorted(VARIANTS), done.stdout
    for variant, (separate, recomputed) in errors.items():
        assert separate < TOL[torch.float16] and recomputed < TOL[torch.float16], (variant, separate, recomputed)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_recompute"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_keys_expanded_over_heads_match_float64(variant, fused, monkeypatch):
    """MQA by ``expand``: k and v of one head repeated over 3 query heads (stride 0). Until the fix dK and dV came back
    as garbage from every separate variant and the fused two-pass (stored by k's stride-0 strides into a dense
    buffer); autograd sums the heads' gradients back through the expand."""
    poison_all_allocations(monkeypatch)
    q, k, v, do, _ = _inputs((2, 3, 21, 16), (2, 1, 21, 16), torch.float32)

    def views(q, k, v):
        return q, k.expand(2, 3, 21, 16), v.expand(2, 3, 21, 16)

    _assert_close(_through_views([q, k, v], views, do, False, None, variant, fused),
                  _reference_through_views([q, k, v], views, do, False, None), TOL[torch.float32],
                  f"expanded {variant} fused={fused}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["fused QKV split", "packed split", "expanded"])
def test_fakes_promise_the_outputs_strides(layout, variant):
    """Each op's outputs have the strides its fake promises (what torch.compile plans with) where the inputs are not
    dense: the outputs are laid out densely, not with the inputs' gaps or stride-0 heads."""
    cu, max_seqlen = None, 0
    if layout == "fused QKV split":
        q, k, v = _split_batched(torch.randn(2, 19, 3 * 2 * 16))
    elif layout == "packed split":
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in _split_packed(torch.randn(23, 3, 2, 16)))
        cu, max_seqlen = torch.tensor([0, 5, 23], dtype=torch.int32), 18
    else:
        q, k = torch.randn(2, 2, 19, 16), torch.randn(2, 1, 19, 16).expand(2, 2, 19, 16)
        v = k
    meta = (cu, max_seqlen, True, 0.25, variant)
    o, lse = torch.ops.memfit.attention_fwd(q, k, v, *meta)
    do = torch.randn_like(o)
    for op, args in ((torch.ops.memfit.attention_fwd, (q, k, v)), (torch.ops.memfit.attention_bwd, (do, q, k, v, o, lse)),
                     (torch.ops.memfit.attention_recompute_bwd, (do, q, k, v))):
        torch.library.opcheck(op, (*args, *meta), test_utils=("test_faketensor",))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 64, 32)
        k = torch.empty(2, 2, 64, 32)
        out = attention(q, k, k, causal=True, path="triton")
        assert out.shape == q.shape
        cu = torch.tensor([0, 20, 64], dtype=torch.int32)        # fake: no values to check, nothing read back
        out = attention(q[0].transpose(0, 1), k[0].transpose(0, 1), k[0].transpose(0, 1), cu_seqlens=cu,
                        max_seqlen=44, path="triton")
        assert out.shape == (64, 8, 32)


@pytest.mark.parametrize("bad", ["heads", "variant", "cu_dtype", "head_dim", "seq"])
def test_bad_input_is_a_clear_error(bad):
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16)
    kwargs = {}
    if bad == "variant":
        k, v, kwargs = k[:, :2], v[:, :2], {"backward": "fast"}
    elif bad == "cu_dtype":
        q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
        kwargs = {"cu_seqlens": torch.tensor([0, 8])}
    elif bad == "head_dim":
        q, k, v = torch.randn(1, 2, 8, 160), torch.randn(1, 2, 8, 160), torch.randn(1, 2, 8, 160)
    elif bad == "seq":
        k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    with pytest.raises(MemfitError):
        attention(q, k, v, path="triton", **kwargs)


BAD_OFFSETS = {   # T = 12 packed tokens: cu_seqlens, max_seqlen, what the error says
    "max_seqlen below the longest": ([0, 3, 12], 4, "max_seqlen=4 is shorter than the longest sequence"),
    "ends before T": ([0, 3, 10], None, "end at the number of packed tokens, 12"),
    "ends after T": ([0, 3, 14], None, "end at the number of packed tokens, 12"),
    "decreasing": ([0, 8, 5, 12], None, "non-decreasing"),
    "starts after 0": ([2, 5, 12], None, "start at 0"),
    "two-dimensional": ([[0, 5, 12]], None, "1-D int32"),
    "on another device": ([0, 5, 12], None, "cu_seqlens is on meta"),
}


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("bad", [pytest.param(bad, marks=pytest.mark.cpu_only(
    reason="a max_seqlen given on CUDA is checked by a device-side assert, which leaves the CUDA context unusable"))
    if BAD_OFFSETS[bad][1] is not None else bad for bad in BAD_OFFSETS])
def test_bad_packed_offsets_are_a_clear_error(bad, path):
    """Until the fix the offsets went to the kernels unchecked: a max_seqlen below the longest sequence dropped rows
    of it, offsets ending before T left rows unwritten, and decreasing offsets were taken."""
    offsets, max_seqlen, says = BAD_OFFSETS[bad]
    q, k, v = torch.randn(12, 2, 16), torch.randn(12, 1, 16), torch.randn(12, 1, 16)
    with pytest.raises(MemfitError, match=says):
        attention(q, k, v, cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device="meta" if "device" in bad else None),
                  max_seqlen=max_seqlen, path=path)


@pytest.mark.cpu_only(reason="on CUDA the check is a device-side assert, which leaves the CUDA context unusable")
def test_packed_offsets_are_checked_on_the_device_under_torch_compile():
    """Under torch.compile the offsets are not read back (a graph break at every layer): they are checked by an
    assert in the graph, each clause of it (offsets of another device or shape are refused before it)."""
    q, k, v = torch.randn(12, 2, 16), torch.randn(12, 1, 16), torch.randn(12, 1, 16)
    compiled = torch.compile(lambda cu, n: attention(q, k, v, cu_seqlens=cu, max_seqlen=n, path="triton"),
                             fullgraph=True, backend="eager")
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    assert _rel(compiled(cu, 9), attention_reference(q, k, v, cu_seqlens=cu)) < 1e-5
    for bad, (offsets, max_seqlen, _) in BAD_OFFSETS.items():
        if bad in ("two-dimensional", "on another device"):
            continue
        with pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):
            compiled(torch.tensor(offsets, dtype=torch.int32), max_seqlen or 12)


def test_offsets_are_checked_once_while_unchanged(monkeypatch):
    """Every layer gets the same CUDA offsets tensor: it is checked at the first, and again only once it changes (on
    the CPU, where a write through numpy escapes the version counter, every call checks)."""
    from memfit.kernels import attention as module

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))     # stands for CUDA offsets here
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    checks = []
    real = module._offsets_checked
    monkeypatch.setattr(module, "_offsets_checked", lambda *args: checks.append(args) or real(*args))
    q, k, v = torch.randn(12, 2, 16), torch.randn(12, 1, 16), torch.randn(12, 1, 16)
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    for _ in range(3):
        attention(q, k, v, cu_seqlens=cu, path="triton")
    assert len(checks) == 1
    cu[1] = 13                                                  # changed in place: checked again, and refused
    with pytest.raises(MemfitError, match="non-decreasing"):
        attention(q, k, v, cu_seqlens=cu, path="triton")
    assert len(checks) == 2


def test_hugging_face_model_matches_sdpa():
    """A tiny random Llama with attn_implementation="memfit" gives SDPA's logits and gradients."""
    from memfit.models.presets import PRESETS
    from memfit.train.attention_hf import register

    register()
    spec = PRESETS["tiny"]
    ref = _model(spec, "sdpa").train()
    ours = _model(spec, "memfit").train()
    ids = torch.randint(0, spec.vocab, (2, 13))
    ref(ids, labels=ids).loss.backward()
    loss = ours(ids, labels=ids).loss
    loss.backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert _rel(b.grad, a.grad) < 1e-4, name
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0  # left padding: the kernel runs the valid tokens packed
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert _rel(got[mask.bool()], want[mask.bool()]) < 1e-5


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_hugging_face_model_decodes_from_a_kv_cache_as_a_full_forward_does(cache_kind, monkeypatch):
    """With attn_implementation="memfit", a token decoded against a KV cache (the decode kernel, in every layer) gets
    the logits of a full forward over the same tokens (the attention kernel). A static cache holds unfilled positions
    past the prompt: the FlashAttention-style mask had left them unmasked, and the decode logits were 0.1 off."""
    from transformers import DynamicCache, StaticCache

    from memfit.models.presets import PRESETS
    from memfit.train import attention_hf

    decoded = []
    run = attention_hf.cache_attention
    monkeypatch.setattr(attention_hf, "cache_attention", lambda *args: decoded.append(args[3]) or run(*args))
    attention_hf.register()
    spec = PRESETS["tiny"]
    model = _model(spec, "memfit").eval()
    ids, token = torch.randint(0, spec.vocab, (1, 10)), torch.tensor([[7]])

    def decode(grad: bool):
        """The token's logits decoded against a new cache of the prompt, with gradients enabled or not."""
        if cache_kind == "static":
            try:
                cache = StaticCache(config=model.config, max_cache_len=16)
            except TypeError:                                        # transformers 4.x
                cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=16, dtype=torch.float32)
        else:
            cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, cache_position=torch.arange(10), use_cache=True, **{cache_keyword(model): cache})
        with torch.set_grad_enabled(grad):
            return model(input_ids=token, cache_position=torch.tensor([10]), use_cache=True,
                         **{cache_keyword(model): cache}).logits

    with torch.no_grad():
        want = model(input_ids=torch.cat([ids, token], 1), use_cache=False).logits[:, -1:]
    assert _rel(decode(grad=False), want) < 1e-5
    assert len(decoded) == spec.num_layers and all((mask is None) == (cache_kind == "dynamic") for mask in decoded)
    assert _rel(decode(grad=True), want) < 1e-5                   # no backward in the decode kernel: SDPA takes it
    assert len(decoded) == spec.num_layers


def test_hugging_face_padded_batch_without_a_cache_runs_memfits_kernel(monkeypatch):
    """No cache: the FlashAttention-style mask (a 2-D padding mask), which memfit's kernel takes (packed), not
    SDPA's N x N one."""
    from memfit.models.presets import PRESETS
    from memfit.train import attention_hf

    calls = []
    run = attention_hf.attention
    monkeypatch.setattr(attention_hf, "attention", lambda *a, **k: calls.append(k.get("cu_seqlens")) or run(*a, **k))
    attention_hf.register()
    spec = PRESETS["tiny"]
    model = _model(spec, "memfit").eval()
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        model(torch.randint(0, spec.vocab, (2, 9)), attention_mask=mask)
    assert len(calls) == spec.num_layers and all(cu is not None for cu in calls)


def _padding_mask(padding):
    mask = torch.ones(2, 9, dtype=torch.long)
    if padding == "left":
        mask[1, :3] = 0
    elif padding == "right":
        mask[0, 6:] = 0
    elif padding == "both rows, one empty":
        mask[0, 7:], mask[1] = 0, 0
    return mask


@pytest.mark.parametrize("padding", ["left", "right", "none", "both rows, one empty"])
def test_padding_in_place_equals_packing(padding):
    """The compiled path's padding (every token in place, each row as leading padding | valid | trailing padding)
    gives what packing the valid tokens gives, zeros at padded positions included, forward and backward."""
    from memfit.train.attention_hf import _padded_in_place, _unpadded

    mask = _padding_mask(padding)
    q, k, v = (torch.randn(2, 4, 9, 16, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 9, 4, 16)
    results = []
    for run in (_unpadded, _padded_in_place):
        out = run(q, k, v, mask, True, None, "two_pass")
        results.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for got, want in zip(results[1], results[0]):
        assert _rel(got, want) < 1e-5


@pytest.mark.cpu_only(reason="on CUDA the check is a device-side assert, which leaves the CUDA context unusable")
def test_padding_in_place_refuses_a_mask_with_a_hole():
    from memfit.train.attention_hf import _padded_in_place

    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 4] = 0
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    with pytest.raises(RuntimeError, match="contiguous"):
        _padded_in_place(q, k, v, mask, True, None, "two_pass")


def _compiled_padded_forward(layers):
    """(graph breaks, compiled logits, eager logits) of a tiny Llama of ``layers`` layers on a left-padded batch."""
    from memfit.models.presets import PRESETS
    from memfit.train import attention_hf

    attention_hf.register()
    spec = PRESETS["tiny"].with_(num_layers=layers)
    model = _model(spec, "memfit").eval()
    ids, mask = torch.randint(0, spec.vocab, (2, 9)), _padding_mask("left")
    forward = lambda ids: model(input_ids=ids, attention_mask=mask).logits * mask[..., None]   # noqa: E731
    torch._dynamo.reset()
    with torch.no_grad():
        want = forward(ids)
        explained = torch._dynamo.explain(forward)(ids)
        got = torch.compile(forward, backend="eager")(ids)
    return explained.graph_break_count, got, want


def test_hugging_face_padded_batch_compiles_without_a_break_per_layer():
    """Under torch.compile a padding mask runs in place (:func:`_padded_in_place`), not packed through a
    data-dependent shape, which broke the graph in every layer (at 841ae30: 14 breaks with 2 layers, 16 with 4).
    What breaks are left come from the mask builder, once per forward (5 with 2 layers and with 4). The valid
    positions' logits match the eager (packed) run's."""
    (two, got, want), (four, _, _) = _compiled_padded_forward(2), _compiled_padded_forward(4)
    assert two == four
    assert _rel(got, want) < 1e-5


def test_hugging_face_attention_refuses_a_sliding_window_shorter_than_its_keys():
    """Neither kernel has a sliding window: a layer that has one shorter than its keys is refused, not attended
    over every key (as it was until 9230a88: a tiny Mistral with a short window read far off SDPA)."""
    from memfit.errors import MemfitError
    from memfit.train.attention_hf import memfit_attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 10, 16) for _ in range(3))
    with pytest.raises(MemfitError, match="sliding window"):
        memfit_attention_forward(module, q, k, v, None, sliding_window=4)
    got, _ = memfit_attention_forward(module, q, k, v, None, sliding_window=10)
    assert _rel(got, memfit_attention_forward(module, q, k, v, None)[0]) == 0


def test_hugging_face_attention_runs_restarting_position_ids_as_separate_sequences():
    """Eager: position_ids that restart (a packed batch of 5 and 4 tokens) attend within each sequence only."""
    from memfit.train.attention_hf import memfit_attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    got, _ = memfit_attention_forward(module, q, k, v, None, position_ids=positions)
    parts = [memfit_attention_forward(module, *(t[:, :, s].contiguous() for t in (q, k, v)), None)[0]
             for s in (slice(0, 5), slice(5, 9))]
    assert _rel(got, torch.cat(parts, dim=1)) < 1e-5


def test_hugging_face_attention_compiles_to_one_graph_and_says_position_ids_are_not_inspected(caplog):
    """Under torch.compile the packed-sequence check on position_ids would read a GPU tensor back at
    every layer (a graph break: the benchmarks' prefill lost its CUDA graphs); it is skipped, said once."""
    from memfit import log
    from memfit.train.attention_hf import memfit_attention_forward

    log._said.discard("attention_hf:compiled-position-ids")
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    positions = torch.arange(9)[None]
    want, _ = memfit_attention_forward(module, q, k, v, None, position_ids=positions)
    compiled = torch.compile(memfit_attention_forward, fullgraph=True, backend="eager")
    got, _ = compiled(module, q, k, v, None, position_ids=positions)
    assert _rel(got, want) < 1e-6
    assert "cu_seq_lens_q" in caplog.text


def _patched_lora_step(attention, ids):
    from memfit.models.presets import PRESETS
    from memfit.train.patch import patch

    model = patch(_model(PRESETS["tiny"]), checkpoint="layer", fused_ce=False,
                  lora={"r": 4, "init_lora_weights": False}, attention=attention).train()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_patch_attention_memfit_matches_sdpa(monkeypatch):
    """patch(attention="memfit") trains (checkpointed LoRA) with SDPA's loss and adapter gradients."""
    from memfit.models.presets import PRESETS
    from memfit.train import attention_hf

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return attention(*args, **kwargs)

    monkeypatch.setattr(attention_hf, "attention", counted)
    ids = torch.randint(0, PRESETS["tiny"].vocab, (2, 19))
    want_loss, want = _patched_lora_step("sdpa", ids)
    assert not calls
    got_loss, got = _patched_lora_step("memfit", ids)
    assert calls, "attention='memfit' did not route the layers through memfit's kernel"
    assert abs(got_loss.item() - want_loss.item()) < 1e-5 * abs(want_loss.item())
    assert got.keys() == want.keys() and got
    for name in want:
        assert want[name].norm() > 0, name
        assert _rel(got[name], want[name]) < 1e-4, name


def test_patch_attention_bad_value():
    from memfit.models.presets import PRESETS
    from memfit.train.patch import patch

    with pytest.raises(MemfitError, match="flash"):
        patch(_model(PRESETS["tiny"]), attention="flash")


def test_fp32_dots_follow_torch_matmul_precision():
    """IEEE fp32 by default; TF32 only once the user allows it for matmuls (it is then used, and said once)."""
    from memfit.kernels.dispatch import dot_precision

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert dot_precision(torch.float32, "op") == "ieee"
        torch.set_float32_matmul_precision("high")
        assert dot_precision(torch.float32, "op") == "tf32"
        assert dot_precision(torch.bfloat16, "op") == "tf32"
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):    # torch >= 2.9's per-backend setting
            torch.set_float32_matmul_precision("highest")
            torch.backends.cuda.matmul.fp32_precision = "tf32"        # torch's legacy getter raises after this
            assert dot_precision(torch.float32, "op") == "tf32"
            torch.set_float32_matmul_precision("high")
            torch.backends.cuda.matmul.fp32_precision = "ieee"        # the legacy getter still says "high"
            assert dot_precision(torch.float32, "op") == "ieee"
    finally:
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
            torch.backends.cuda.matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not causal"])
@pytest.mark.parametrize("layout", ["one sequence", "left padding", "right padding", "packed by cu_seq_lens_q",
                                    "packed by position_ids"])
def test_hugging_face_attention_with_dropout_keeps_the_padding_and_the_sequences(layout, causal):
    """Training with attention dropout goes to SDPA, which takes neither a 2-D padding mask nor packed offsets: until
    the fix a padded batch of two rows raised, one padded row lost its causal mask, and packed sequences were
    attended as one. With the dropout all but off, the fallback equals memfit's own kernel (GQA: 4 query heads on
    2 key heads); with it at 0.5, a token's output does not change when keys and values it must not see change (the
    padding's, or the other packed sequence's), and padded positions are zeros."""
    from memfit.train.attention_hf import memfit_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = causal, 2
    rows = 1 if layout.startswith(("packed", "one")) else 2
    q = torch.randn(rows, 4, 9, 16)
    k, v = (torch.randn(rows, 2, 9, 16) for _ in range(2))
    mask, kwargs, valid = None, {}, torch.ones(rows, 9, dtype=torch.bool)
    if layout.endswith("padding"):
        mask = _padding_mask(layout.split()[0]).bool()             # transformers' builder hands a bool mask
        valid = mask
    elif layout.endswith("cu_seq_lens_q"):
        kwargs = {"cu_seq_lens_q": torch.tensor([0, 5, 9], dtype=torch.int32), "max_length_q": 5}
    elif layout.endswith("position_ids"):
        kwargs = {"position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])}
    own, _ = memfit_attention_forward(module, q, k, v, mask, **kwargs)
    module.training = True
    almost_none, _ = memfit_attention_forward(module, q, k, v, mask, dropout=1e-30, **kwargs)
    assert _rel(almost_none, own) < 1e-5
    unseen, checked = ~valid, valid.clone()                        # keys changed; outputs that must not change
    if layout.startswith("packed"):
        unseen[0, :5], checked[0, :5] = True, False                # the first sequence's keys, the second's outputs
    k2, v2 = (torch.where(unseen[:, None, :, None], torch.randn_like(t), t) for t in (k, v))
    torch.manual_seed(0)
    first, _ = memfit_attention_forward(module, q, k, v, mask, dropout=0.5, **kwargs)
    torch.manual_seed(0)
    second, _ = memfit_attention_forward(module, q, k2, v2, mask, dropout=0.5, **kwargs)
    assert (first[checked] != 0).any() and torch.equal(first[checked], second[checked])
    assert (first[~valid] == 0).all()
