"""Fused linear cross-entropy against a float64 reference that materialises the logits.

Runs the Triton kernels through the interpreter (tests/conftest.py) at small, odd shapes,
with small vocabulary chunks (frozen and trained weight) so the backward walks several chunks,
the last one partial, a small side-buffer budget so the chunks live in the weight gradient's
unwritten rows and shrink near the end of the vocabulary, and a small COPY_MIN_WIDTH so a
trained weight's backward runs steps on the gathered copy (cuBLAS), then Triton steps in the
weight gradient, then side-buffer steps (test_trained_backward_walks_every_kind_of_step).
"""
import itertools
import math

import pytest
import torch
from conftest import rel, seeded
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.errors import MemfitError
from memfit.kernels import linear_ce
from memfit.kernels.linear_ce import (
    frequent_token_subset,
    linear_cross_entropy,
    subset_loss_deviation,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


@pytest.fixture(autouse=True)
def _small_chunks_and_poison(monkeypatch):
    monkeypatch.setattr(linear_ce, "VOCAB_CHUNK", 256)
    monkeypatch.setattr(linear_ce, "TRAINED_VOCAB_CHUNK", 192)
    monkeypatch.setattr(linear_ce, "FROZEN_STEP_ELEMENTS", 0)    # the frozen chunk widens only where a test says
    monkeypatch.setattr(linear_ce, "COPY_MIN_WIDTH", 96)
    monkeypatch.setattr(linear_ce, "TAIL_ELEMENTS", 512)
    monkeypatch.setattr(linear_ce, "STEP_ALIGN", 8)
    monkeypatch.setattr(linear_ce, "FINISH_ELEMENTS", 100)  # 2-6 rows: both kinds of slices of the in-place finish
    monkeypatch.setattr(linear_ce, "POISON", True)


def _inputs(shape, hdim, vocab, dtype, ignore_frac=0.5, bias=False):
    hidden = torch.randn(*shape, hdim, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, hdim) / hdim**0.25).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, shape)
    labels[torch.rand(shape) < ignore_frac] = -100
    b = torch.randn(vocab, dtype=dtype).requires_grad_() if bias else None
    return hidden, weight, labels, b


def _reference(hidden, weight, labels, bias=None, reduction="mean", softcap=None, z_loss=0.0):
    """float64, logits materialised: the definition the op must match."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    z = h @ w.T + (0 if b is None else b)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = labels != -100
    target = z.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    per_token = torch.where(valid, lse - target + z_loss * lse**2, 0.0)
    loss = {"none": per_token, "sum": per_token.sum(), "mean": per_token.sum() / valid.sum().clamp(min=1)}[reduction]
    return loss, (h, w, b)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _check_against_reference(hidden, weight, labels, bias=None, path="triton", vocab_chunk=None, tol=None, **kw):
    loss = linear_cross_entropy(hidden, weight, labels, bias=bias, path=path, vocab_chunk=vocab_chunk, **kw)
    ref, leaves = _reference(hidden, weight, labels, bias=bias, **kw)
    tol = tol or TOL[hidden.dtype]
    assert torch.isfinite(loss).all()
    assert _rel(loss.detach(), ref.detach()) < tol
    upstream = torch.randn_like(ref) if ref.dim() else torch.tensor(1.7, dtype=torch.float64)
    (loss.double() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    pairs = [(hidden, leaves[0]), (weight, leaves[1])] + ([(bias, leaves[2])] if bias is not None else [])
    for mine, theirs in pairs:
        assert mine.grad.dtype == mine.dtype and mine.grad.shape == mine.shape
        assert torch.isfinite(mine.grad).all()
        assert _rel(mine.grad, theirs.grad) < 2 * tol, (mine.shape, _rel(mine.grad, theirs.grad))


@pytest.mark.parametrize("dtype,reduction", [(torch.float32, "mean"), (torch.float32, "sum"), (torch.float32, "none"),
                                             (torch.bfloat16, "mean")])
def test_matches_reference(dtype, reduction):
    hidden, weight, labels, _ = _inputs((2, 11), 48, 1037, dtype)
    _check_against_reference(hidden, weight, labels, reduction=reduction)


def test_trained_backward_walks_every_kind_of_step(monkeypatch):
    """At the shape of test_matches_reference the trained-weight backward runs, in this order,
    steps whose weight gradient cuBLAS computes on the gathered copy in the weight gradient's
    last rows, Triton steps (reading hidden through the index) whose chunks overwrite that copy,
    and side-buffer steps; the gradients across those transitions match the reference."""
    plans, matmuls = [], []
    plan, step = linear_ce._backward_plan, linear_ce._weight_grad_step

    def spy_plan(*args, **kwargs):
        plans.append(plan(*args, **kwargs))
        return plans[-1]

    def spy_step(d, hidden, rows, hs, out, chunk, triton_path):
        matmuls.append("cublas" if hs is not None else "triton")
        return step(d, hidden, rows, hs, out, chunk, triton_path)

    monkeypatch.setattr(linear_ce, "_backward_plan", spy_plan)
    monkeypatch.setattr(linear_ce, "_weight_grad_step", spy_step)
    hidden, weight, labels, _ = _inputs((2, 11), 48, 1037, torch.float32)
    _check_against_reference(hidden, weight, labels, reduction="sum")
    ((steps, _),) = plans
    kinds = [(in_w, copied) for _, _, in_w, copied in steps]
    assert kinds == sorted(kinds, reverse=True), kinds  # copied, in the weight gradient, side buffer
    assert set(kinds) == {(True, True), (True, False), (False, False)}, kinds
    assert matmuls == ["cublas" if copied else "triton" for _, copied in kinds]


@pytest.mark.parametrize("pattern", ["every token", "one response"])
def test_loss_rows_in_one_range_use_cublas_on_a_slice(monkeypatch, pattern):
    """Where the loss rows are one range of hidden (every token has a loss, or a prompt is
    masked before one response), every weight-gradient step runs cuBLAS on that slice of hidden
    itself: no gathered copy, no step through the index; the gradients match the reference."""
    hs_seen = []
    step = linear_ce._weight_grad_step

    def spy_step(d, hidden, rows, hs, out, chunk, triton_path):
        hs_seen.append(None if hs is None else (hs.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()))
        return step(d, hidden, rows, hs, out, chunk, triton_path)

    monkeypatch.setattr(linear_ce, "_weight_grad_step", spy_step)
    hidden, weight, labels, _ = _inputs((2, 11), 48, 1037, torch.float32, ignore_frac=0.0)
    if pattern == "one response":
        labels.view(-1)[:7] = -100
    _check_against_reference(hidden, weight, labels, reduction="sum")
    assert len(hs_seen) > 1 and all(hs_seen), hs_seen  # several steps, each on a view of hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_zloss_bias_uneven_hidden(dtype):
    hidden, weight, labels, bias = _inputs((19,), 40, 1001, dtype, ignore_frac=0.3, bias=True)
    _check_against_reference(hidden, weight, labels, bias=bias, reduction="none", softcap=3.0, z_loss=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["head", "tail", "sparse", "dense"])
def test_hidden_gradient_finished_in_place(dtype, pattern):
    """Loss tokens first, last, few (the fp32 accumulator lives in the 16-bit gradient buffer)
    or many (it does not fit there): the in-place finish must never read a row it overwrote."""
    hidden, weight, labels, _ = _inputs((29,), 40, 600, dtype, ignore_frac=0.0)
    keep = {"head": torch.arange(29) < 9, "tail": torch.arange(29) >= 20,
            "sparse": torch.rand(29) < 0.3, "dense": torch.rand(29) < 0.8}[pattern]
    labels[~keep] = -100
    _check_against_reference(hidden, weight, labels, reduction="sum", vocab_chunk=200)


def test_accumulator_placement():
    grad = torch.empty(10, 8, dtype=torch.bfloat16)
    acc = linear_ce._accumulator_in(grad, 5)
    assert acc.dtype == torch.float32 and acc.shape == (5, 8) and acc.data_ptr() == grad.data_ptr()
    assert linear_ce._accumulator_in(grad, 6) is None
    # at the first loss row, pulled back as far as it must to fit in the buffer's 5 fp32 rows
    assert linear_ce._accumulator_in(grad, 3, first=1).data_ptr() == grad[2].data_ptr()
    assert linear_ce._accumulator_in(grad, 3, first=4).data_ptr() == grad[4].data_ptr()
    full = torch.empty(10, 8)  # fp32: the accumulator always fits, at the first loss row
    assert linear_ce._accumulator_in(full, 10).data_ptr() == full.data_ptr()
    assert linear_ce._accumulator_in(full, 7, first=3).data_ptr() == full[3].data_ptr()


class _FloatWrites(TorchDispatchMode):
    """Counts the ops that write a floating-point tensor (each a kernel launch on a GPU); views
    are free and index arithmetic is not counted."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not view and any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_flatten(out)[0]):
            self.count += 1
        return out


FINISH_TOKENS = 4096
IGNORED = {  # label patterns of fine-tuning: which tokens carry no loss
    "BOS": torch.arange(FINISH_TOKENS) == 0,
    "last of 8 sequences": torch.arange(FINISH_TOKENS) % (FINISH_TOKENS // 8) == FINISH_TOKENS // 8 - 1,
    "100-token prefix": torch.arange(FINISH_TOKENS) < 100,
    "long prompt": torch.arange(FINISH_TOKENS) < FINISH_TOKENS * 3 // 5,  # 16-bit: accumulator in dH, offset
    "random half": torch.rand(FINISH_TOKENS, generator=seeded(1)) < 0.5,
}


@pytest.mark.parametrize("pattern", list(IGNORED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_acc", ["in-buffer", "separate"])
def test_hidden_gradient_finish_is_few_launches(monkeypatch, pattern, dtype, hidden_acc):
    """The finish writes row i of the accumulator to row rows[i] (rounded), zeros the ignored
    rows, and takes O(log n) launches, not O(n / block), for the common label patterns. The one
    exception, kept bounded: in place (fp32) with loss rows a few rows from their destination,
    two launches per block of rows (here 16)."""
    hdim, block = 8, 16
    monkeypatch.setattr(linear_ce, "HIDDEN_ACC", hidden_acc)
    monkeypatch.setattr(linear_ce, "FINISH_ELEMENTS", block * hdim)
    ignored = IGNORED[pattern].nonzero().squeeze(1)
    rows = (~IGNORED[pattern]).nonzero().squeeze(1)
    values = torch.randn(rows.numel(), hdim)
    d_hidden, acc = linear_ce._hidden_grad_buffers(torch.empty(FINISH_TOKENS, hdim, dtype=dtype), rows)
    acc.copy_(values)
    if d_hidden is None:
        d_hidden = linear_ce._empty((FINISH_TOKENS, hdim), dtype, rows.device)
    with _FloatWrites() as writes:
        linear_ce._finish_hidden_grad(d_hidden, acc, rows, rows, ignored)
    expected = torch.zeros(FINISH_TOKENS, hdim, dtype=dtype)
    expected[rows] = values.to(dtype)
    assert torch.equal(d_hidden, expected)
    bound = 3 * math.log2(FINISH_TOKENS)
    if pattern == "last of 8 sequences" and dtype == torch.float32 and hidden_acc == "in-buffer":
        bound += 2 * rows.numel() / block
    assert writes.count <= bound, writes.count


@pytest.mark.parametrize("tokens,loss_tokens,dtype", [(10, 5, torch.bfloat16), (10, 6, torch.bfloat16),
                                                     (10, 10, torch.float32), (10, 3, torch.float16)])
def test_memory_model_places_accumulator_as_the_op_does(tokens, loss_tokens, dtype):
    model = linear_ce.backward_memory(tokens, loss_tokens, 8, 100, torch.empty(0, dtype=dtype).element_size())
    fits = linear_ce._accumulator_in(torch.empty(tokens, 8, dtype=dtype), loss_tokens) is not None
    assert model["accumulator"] == ("in hidden-gradient buffer" if fits else "separate")
    assert model["peak"] == model["saved"] + model["gradients"] + model["transient"]


@pytest.mark.cpu_only(reason="on a GPU each bucket autotunes for real: more than 100 s for the same keys")
def test_varying_token_counts_tune_once_per_bucket(monkeypatch):
    """Fine-tuning changes the loss-token count every step: every launch must reuse the
    autotuner entry and the compiled kernel of its power-of-two bucket (no re-tune, no
    recompile), so the autotune keys and the compile-time arguments may only differ by the
    token bucket and, for the step kernels, by the power-of-two bucket of the step width.
    (Every token has a loss here, so the default dW matmul would be cuBLAS on hidden itself:
    DW_MATMUL "triton" makes every step launch the Triton weight-gradient kernel.)"""
    monkeypatch.setattr(linear_ce, "DW_MATMUL", "triton")
    seen = {"lse": set(), "dlogits": set(), "dweight": set()}
    for name, kernel in (("lse", linear_ce._lse_kernel), ("dlogits", linear_ce._dlogits_kernel),
                         ("dweight", linear_ce._dweight_kernel)):
        original = kernel.run

        def spy(*args, _kernel=kernel, _run=original, _name=name, **kwargs):
            named = {**dict(zip(_kernel.arg_names, args)), **kwargs}
            key = {k: named[k] for k in _kernel.keys}  # every key names an argument (KeyError if not)
            buckets = (key.pop("N_BUCKET"), key.pop("WIDTH_KEY", 1))
            constexprs = tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("grid", "warmup")))
            seen[_name].add((tuple(key.items()), constexprs, buckets))
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", spy)
    weight = torch.randn(300, 16, requires_grad=True)
    counts = [3, 5, 6, 7, 9, 12, 13, 16]
    for n in counts:
        hidden = torch.randn(n, 16, requires_grad=True)
        linear_cross_entropy(hidden, weight, torch.randint(0, 300, (n,)), path="triton").backward()
    buckets = {linear_ce._bucket(n) for n in counts}
    for entries in seen.values():
        assert len({(key, constexprs) for key, constexprs, _ in entries}) == 1, entries
        assert {n_bucket for _, _, (n_bucket, _) in entries} == buckets
        assert all(width & (width - 1) == 0 for _, _, (_, width) in entries)


@pytest.mark.parametrize("vocab,hdim,n,chunk", [(1037, 48, 11, 256), (600, 8, 40, 128), (300, 64, 3, 512),
                                              (700, 32, 5, 4), (128256, 4096, 16384, 2048),
                                              (128256, 2048, 65536, 2048), (128256, 2048, 4096, 8192),
                                              (300, 16, 300, 64), (300, 16, 299, 64), (300, 16, 400, 64)])
@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("copy", [False, True])
def test_backward_plan_covers_the_vocabulary_and_fits(vocab, hdim, n, chunk, weight_grad, copy):
    """Steps tile [0, V) in order; a chunk kept in the weight gradient fits in its unwritten rows
    (never the rows a step writes), and below the gathered copy's last n rows while a step uses
    that copy; the copy's steps come first and never write its rows; the side-buffer steps are a
    suffix no wider than the buffer, which holds at most max(TAIL_ELEMENTS, n * STEP_ALIGN)
    elements; no step but the last of a kind is narrower than STEP_ALIGN (or the chunk), since
    narrow steps cost launches, not memory."""
    steps, side = linear_ce._backward_plan(vocab, hdim, n, chunk, weight_grad, n if copy else 0)
    assert steps[0][0] == 0 and steps[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in itertools.pairwise(steps))
    kinds = [(in_w, copied) for _, _, in_w, copied in steps]
    assert kinds == sorted(kinds, reverse=True)  # copied steps, in-weight-gradient steps, then the side buffer
    assert copy and weight_grad or not any(copied for *_, copied in steps)
    for v0, v1, in_w, copied in steps:
        assert 0 < v1 - v0 <= chunk
        if copied:
            assert n * (v1 - v0) <= (vocab - n - v1) * hdim
            assert v1 - v0 >= min(chunk, linear_ce.COPY_MIN_WIDTH)
        if in_w:
            assert n * (v1 - v0) <= (vocab - v1) * hdim
        else:
            assert v1 - v0 <= side
    assert weight_grad or side == min(chunk, vocab)
    if weight_grad:
        assert n * side <= max(linear_ce.TAIL_ELEMENTS, n * linear_ce.STEP_ALIGN)
    for a, b in itertools.pairwise(steps):
        if a[2:] == b[2:]:
            assert a[1] - a[0] >= min(chunk, linear_ce.STEP_ALIGN)


@pytest.mark.parametrize("knob,value", [("DW_MATMUL", "cublas"), ("DW_MATMUL", "triton"), ("HIDDEN_ACC", "separate"),
                                        ("COPY_MIN_WIDTH", 16), ("TAIL_ELEMENTS", 1 << 30)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alternatives_match_reference(monkeypatch, knob, value, dtype):
    """The alternatives the benchmark times are exact too."""
    monkeypatch.setattr(linear_ce, knob, value)
    hidden, weight, labels, _ = _inputs((21,), 40, 700, dtype)
    _check_against_reference(hidden, weight, labels, reduction="sum")


@pytest.mark.parametrize("tokens,width,hdim", [(37, 19, 40), (16, 32, 16), (5, 3, 33)])
def test_dweight_kernel_reads_rows_through_the_index(tokens, width, hdim):
    hidden = torch.randn(tokens + 7, hdim)
    rows = torch.randperm(tokens + 7)[:tokens].sort().values
    d = torch.randn(tokens, width)
    out = torch.full((width, hdim), float("nan"))
    linear_ce._dweight_triton(d, hidden, rows, out, chunk=width)
    ref = d.double().T @ hidden.double()[rows]
    assert _rel(out, ref) < 2e-5


def _check_memory_model(dtype, loss_tokens, weight_grad, triton_path):
    """Peak bytes the backward allocates (CPU storage tracker) against ``backward_memory`` of its path, within 1%."""
    from memfit.measure.memory import CpuAllocationTracker

    tokens, hdim, vocab = 64, 32, 700
    hidden, weight, labels, _ = _inputs((tokens,), hdim, vocab, dtype, ignore_frac=0.0)
    labels[torch.randperm(tokens)[: tokens - loss_tokens]] = -100
    hidden, weight = hidden.detach(), weight.detach()
    _, lse = linear_ce._forward(hidden, weight, labels, None, -100, 0.0, 0.0, triton_path)
    grad = torch.ones(tokens)
    with CpuAllocationTracker((hidden, weight, labels, lse, grad)) as tracker:
        linear_ce._backward(grad, hidden, weight, labels, None, lse, -100, 0.0, 0.0, weight_grad, 0, triton_path)
    model = linear_ce.backward_memory(tokens, loss_tokens, hdim, vocab, hidden.element_size(), weight_grad=weight_grad,
                                      pytorch_path=not triton_path)
    measured = tracker.peak - tracker.baseline
    assert abs(measured - (model["peak"] - model["saved"])) <= 0.01 * measured, (measured, model)


@pytest.mark.cpu_only(reason="CpuAllocationTracker counts CPU allocations")
@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("dw_matmul", ["triton", "cublas", "cublas-in-grad"])
@pytest.mark.parametrize("loss_tokens", [32, 64])
def test_memory_model_matches_the_tracked_backward(monkeypatch, weight_grad, dw_matmul, loss_tokens):
    """The Triton path's backward against ``backward_memory``. fp32 and the accumulator in dH's buffer: the
    interpreter frees a side buffer only at the next garbage collection, which only the separate-accumulator
    timeline would notice."""
    monkeypatch.setattr(linear_ce, "DW_MATMUL", dw_matmul)
    monkeypatch.setattr(linear_ce, "TAIL_ELEMENTS", 4096)
    _check_memory_model(torch.float32, loss_tokens, weight_grad, triton_path=True)


@pytest.mark.cpu_only(reason="CpuAllocationTracker counts CPU allocations")
@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_tokens,widened", [(32, False), (64, False), (32, True)])
def test_memory_model_of_the_pytorch_path_matches_the_tracked_backward(monkeypatch, weight_grad, dtype, loss_tokens,
                                                                       widened):
    """The PyTorch path's backward against ``backward_memory(pytorch_path=True)``: its own fp32 chunk whether or not
    the weight trains (``widened``: twice VOCAB_CHUNK at 32 loss tokens), the gathered fp32 loss rows, in 16-bit a
    fp32 weight chunk."""
    if widened:
        monkeypatch.setattr(linear_ce, "TRAINED_VOCAB_CHUNK", 512)
        monkeypatch.setattr(linear_ce, "FROZEN_STEP_ELEMENTS", 32 * 512)
    _check_memory_model(dtype, loss_tokens, weight_grad, triton_path=False)


def test_fp32_at_ieee_on_cuda_takes_the_pytorch_path(monkeypatch):
    """In auto mode only fp32 on CUDA at torch's default ("highest") precision leaves the Triton kernels, whose dots
    would run on CUDA cores; a forced path, TF32, 16-bit inputs and CPU tensors under the interpreter keep theirs,
    and CPU tensors where Triton cannot run (no interpreter) take the PyTorch path whatever their dtype."""
    monkeypatch.delenv("MEMFIT_KERNELS", raising=False)
    torch.set_float32_matmul_precision("highest")   # the conftest fixture restores the precision
    assert linear_ce.takes_pytorch_path(torch.float32, "cuda")
    assert not linear_ce.takes_pytorch_path(torch.float32, "cuda", path="triton")
    assert not linear_ce.takes_pytorch_path(torch.bfloat16, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not linear_ce.takes_pytorch_path(torch.float32, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert linear_ce.takes_pytorch_path(torch.bfloat16, "cpu")
    monkeypatch.setenv("MEMFIT_KERNELS", "reference")
    assert linear_ce.takes_pytorch_path(torch.bfloat16, "cuda")
    monkeypatch.delenv("MEMFIT_KERNELS")
    torch.set_float32_matmul_precision("high")
    assert not linear_ce.takes_pytorch_path(torch.float32, "cuda")


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_the_op_runs_the_path_chosen_for_fp32_and_says_so_once(monkeypatch, caplog, precision):
    """The forward and the backward both follow :func:`takes_pytorch_path` (here as if the CPU tensors were CUDA
    ones), and leaving the Triton kernels is said once; the result matches the definition either way."""
    from memfit import log

    real = linear_ce.takes_pytorch_path
    monkeypatch.setattr(linear_ce, "takes_pytorch_path", lambda dtype, device_type, path=None: real(dtype, "cuda", path))
    ran = []
    for name in ("_lse_triton", "_dlogits_triton"):
        kernel = getattr(linear_ce, name)
        monkeypatch.setattr(linear_ce, name, lambda *a, _k=kernel, _n=name: ran.append(_n) or _k(*a))
    monkeypatch.delenv("MEMFIT_KERNELS", raising=False)
    log._said.discard("linear_ce:ieee")
    torch.set_float32_matmul_precision(precision)   # the conftest fixture restores it
    for _ in range(2):
        hidden, weight, labels, _ = _inputs((2, 11), 48, 1037, torch.float32)
        tf32 = precision == "high" and hidden.is_cuda       # the kernels' TF32 dots (the interpreter's are fp32)
        _check_against_reference(hidden, weight, labels, path=None, tol=2e-3 if tf32 else None)
    said = [r for r in caplog.records if "runs the PyTorch path" in r.getMessage()]
    if precision == "highest":
        assert ran == [] and len(said) == 1
    else:
        assert set(ran) == {"_lse_triton", "_dlogits_triton"} and said == []


class _DeviceReads(TorchDispatchMode):
    """Records the host reads of device data: a scalar read or a data-dependent output shape
    (each a host sync on a GPU) of a tensor that derives from one marked as on the device.
    Marked tensors are kept alive, so a freed storage's address cannot taint a host tensor.
    ``.tolist()`` and ``.cpu()`` of a CPU tensor never reach the dispatcher: not seen here."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}

    def __init__(self, device_tensors):
        super().__init__()
        self.device, self.reads, self.paused = {}, [], False
        self.mark(device_tensors)

    def mark(self, tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                self.device[t.untyped_storage().data_ptr()] = t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not self.paused and any(t.untyped_storage().data_ptr() in self.device for t in tensors):
            if func in self.READS:
                self.reads.append(str(func))
            self.mark(tree_flatten(out)[0])
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_acc", ["in-buffer", "separate"])
def test_one_host_sync_per_pass(monkeypatch, dtype, hidden_acc):
    """Forward and backward read device data on the host only in ``_split_tokens`` (the labels'
    copy): every later host decision (label check, accumulator placement, the finish's row
    moves) uses its host copies. On the CPU the 'device' tensors are the inputs and the index
    copies ``_split_tokens`` hands back, and everything computed from them."""
    monkeypatch.setattr(linear_ce, "HIDDEN_ACC", hidden_acc)
    hidden, weight, labels, bias = _inputs((29,), 40, 700, dtype, bias=True)
    hidden, weight, bias = hidden.detach(), weight.detach(), bias.detach()
    grad = torch.randn(29)
    mode = _DeviceReads([hidden, weight, labels, bias, grad])
    split = linear_ce._split_tokens

    def split_on_device(labels, ignore_index):  # the one sync; rows and ignored go back to the device
        mode.paused = True
        rows, rows_host, ignored, host = split(labels, ignore_index)
        rows, ignored, host = rows.clone(), ignored.clone(), host.clone()
        mode.paused = False
        mode.mark([rows, ignored])
        return rows, rows_host, ignored, host

    monkeypatch.setattr(linear_ce, "_split_tokens", split_on_device)
    with mode:
        _, lse = linear_ce._forward(hidden, weight, labels, bias, -100, 3.0, 1e-3, True)
        linear_ce._backward(grad, hidden, weight, labels, bias, lse, -100, 3.0, 1e-3, True, 0, True)
    assert mode.reads == []


def test_reference_backward_keeps_the_frozen_chunk(monkeypatch):
    """TRAINED_VOCAB_CHUNK is wide because a Triton step's chunk lives in the weight gradient; the reference's fp32
    chunks are buffers of their own, so with a trained weight too it takes a frozen weight's width (VOCAB_CHUNK
    here, where the fixture keeps FROZEN_STEP_ELEMENTS from widening it)."""
    widths = []
    dlogits = linear_ce._dlogits_reference

    def spy(hs, weight, bias, labels_n, lse, g, softcap, z_loss, v0, v1):
        widths.append(v1 - v0)
        return dlogits(hs, weight, bias, labels_n, lse, g, softcap, z_loss, v0, v1)

    monkeypatch.setattr(linear_ce, "TRAINED_VOCAB_CHUNK", 512)
    monkeypatch.setattr(linear_ce, "_dlogits_reference", spy)
    hidden, weight, labels, _ = _inputs((9,), 16, 1037, torch.float32)
    linear_cross_entropy(hidden, weight, labels, path="reference").backward()
    assert max(widths) == linear_ce.VOCAB_CHUNK and sum(widths) == 1037


def test_reference_forward_takes_the_given_chunk(monkeypatch):
    """A ``vocab_chunk`` sets the PyTorch path's forward chunk too, so that its N x C logits stay within what the
    backward holds."""
    chunks = []
    lse_reference = linear_ce._lse_reference
    monkeypatch.setattr(linear_ce, "_lse_reference", lambda *a: chunks.append(a[-1]) or lse_reference(*a))
    hidden, weight, labels, _ = _inputs((9,), 16, 1037, torch.float32)
    linear_cross_entropy(hidden, weight, labels, path="reference", vocab_chunk=96)
    assert chunks == [96]


def test_frozen_chunk_widens_for_few_loss_tokens(monkeypatch):
    """A frozen weight's step (a buffer of its own) is FROZEN_STEP_ELEMENTS / N's power-of-two bucket columns wide,
    from VOCAB_CHUNK up to TRAINED_VOCAB_CHUNK; a trained weight's and a given chunk do not move. The Triton backward
    then walks the wider steps, exactly."""
    for name, value in (("VOCAB_CHUNK", 2048), ("TRAINED_VOCAB_CHUNK", 8192), ("FROZEN_STEP_ELEMENTS", 1 << 23)):
        monkeypatch.setattr(linear_ce, name, value)
    chunk = linear_ce._vocab_chunk
    assert [chunk(128256, 0, False, n) for n in (1, 1024, 1025, 2047, 2048, 4095, 4096, 16384)] == [
        8192, 8192, 4096, 4096, 4096, 2048, 2048, 2048]      # N x C at most 8M, one width per power-of-two bucket
    assert (chunk(128256, 0, True, 1024), chunk(128256, 512, False, 1024), chunk(3000, 0, False, 1024)) == (
        8192, 512, 3000)
    for name, value in (("VOCAB_CHUNK", 256), ("TRAINED_VOCAB_CHUNK", 1024), ("FROZEN_STEP_ELEMENTS", 32 * 512)):
        monkeypatch.setattr(linear_ce, name, value)
    widths = []
    dlogits = linear_ce._dlogits_triton
    monkeypatch.setattr(linear_ce, "_dlogits_triton", lambda *a: widths.append(a[-2].shape[1]) or dlogits(*a))
    hidden, weight, labels, _ = _inputs((20,), 16, 1037, torch.float32, ignore_frac=0.0)
    linear_cross_entropy(hidden, weight.detach(), labels, path="triton").backward()
    ref, (h, _, _) = _reference(hidden, weight, labels)
    ref.backward()
    assert widths == [512, 512, 13] and _rel(hidden.grad, h.grad) < 2 * TOL[torch.float32]   # 20 tokens: bucket 32


def test_env_reference_is_not_overridden(monkeypatch):
    """MEMFIT_KERNELS=reference with no path argument must run the reference, not auto."""
    def forbidden(*args, **kwargs):
        raise AssertionError("Triton kernel launched although MEMFIT_KERNELS=reference")

    monkeypatch.setenv("MEMFIT_KERNELS", "reference")
    monkeypatch.setattr(linear_ce, "_lse_triton", forbidden)
    monkeypatch.setattr(linear_ce, "_dlogits_triton", forbidden)
    hidden, weight, labels, _ = _inputs((9,), 16, 300, torch.float32)
    _check_against_reference(hidden, weight, labels, path=None)


def test_reference_path_matches_reference():
    hidden, weight, labels, bias = _inputs((3, 7), 33, 517, torch.float32, bias=True)
    _check_against_reference(hidden, weight, labels, bias=bias, path="reference", softcap=2.5, z_loss=1e-2)


def test_one_token():
    hidden, weight, labels, _ = _inputs((1,), 17, 1003, torch.float32, ignore_frac=0.0)
    _check_against_reference(hidden, weight, labels, reduction="mean")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_tokens_ignored(reduction):
    hidden, weight, labels, _ = _inputs((2, 5), 16, 300, torch.float32)
    labels.fill_(-100)
    loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction, path="triton")
    assert torch.equal(loss.detach(), torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_masked_equals_unmasked_on_loss_tokens():
    hidden, weight, labels, _ = _inputs((23,), 48, 1037, torch.float32)
    keep = labels != -100
    masked = linear_cross_entropy(hidden, weight, labels, reduction="sum", path="triton")
    masked.backward()
    h2 = hidden.detach()[keep].clone().requires_grad_()
    w2 = weight.detach().clone().requires_grad_()
    plain = linear_cross_entropy(h2, w2, labels[keep], reduction="sum", path="triton")
    plain.backward()
    torch.testing.assert_close(masked, plain)
    torch.testing.assert_close(hidden.grad[keep], h2.grad)
    assert torch.equal(hidden.grad[~keep], torch.zeros_like(hidden.grad[~keep]))
    torch.testing.assert_close(weight.grad, w2.grad)


def test_frozen_weight_gets_no_gradient_and_hidden_still_exact():
    hidden, weight, labels, _ = _inputs((13,), 24, 700, torch.float32)
    weight.requires_grad_(False)
    linear_cross_entropy(hidden, weight, labels, path="triton").backward()
    _, (h, _, _) = ref = _reference(hidden, weight, labels)
    ref[0].backward()
    assert weight.grad is None
    assert _rel(hidden.grad, h.grad) < 2e-5


def test_vocab_subset_whole_vocab_is_exact_and_partial_is_lower():
    hidden, weight, labels, _ = _inputs((17,), 32, 600, torch.float32)
    exact = linear_cross_entropy(hidden, weight, labels, path="reference")
    whole = linear_cross_entropy(hidden, weight, labels, vocab_subset=torch.arange(600), path="reference")
    torch.testing.assert_close(whole, exact)
    whole.backward()
    g_whole = weight.grad.clone()
    weight.grad = None
    exact.backward()
    torch.testing.assert_close(g_whole, weight.grad)
    hidden, weight, labels, _ = _inputs((17,), 32, 3 * linear_ce.SUBSET_ROWS_STEP, torch.float32)
    subset = frequent_token_subset(labels, 50, vocab_size=weight.shape[0])
    report = subset_loss_deviation(hidden, weight, labels, subset, path="reference")
    assert report["abs_dev"] > 0 and report["approx"] < report["exact"]
    assert report["softmax_ids"] == linear_ce.SUBSET_ROWS_STEP < weight.shape[0]


def test_vocab_subset_is_padded_to_whole_steps_of_the_lowest_other_ids():
    """labels ∪ subset is padded with the lowest ids outside it to a multiple of SUBSET_ROWS_STEP ids (the
    whole vocabulary at most): two batches with different labels give the kernels the same vocabulary size,
    and every label maps to its own weight and bias row."""
    step = linear_ce.SUBSET_ROWS_STEP
    vocab = 3 * step + 5
    weight = torch.arange(vocab, dtype=torch.float32)[:, None].repeat(1, 4)    # row v holds v: kept ids readable
    bias = -torch.arange(vocab, dtype=torch.float32)
    subset = torch.arange(step // 2, 2 * step, 7)
    sizes = []
    for seed in range(2):
        labels = torch.randint(0, vocab, (300,), generator=seeded(seed))
        labels[::5] = -100
        rows, bias_rows, local = linear_ce._restrict_vocab(weight, bias, labels, -100, subset)
        valid = labels != -100
        wanted = set(subset.tolist()) | set(labels[valid].tolist())
        kept = rows[:, 0].long().tolist()
        padding = sorted(set(kept) - wanted)
        assert set(kept) >= wanted and kept == sorted(set(kept))
        assert padding == [v for v in range(vocab) if v not in wanted][:len(padding)]    # the lowest others
        assert torch.equal(rows[local[valid]], weight[labels[valid]]) and (local[~valid] == linear_ce.SUBSET_IGNORE).all()
        assert torch.equal(bias_rows, -rows[:, 0])
        sizes.append(rows.shape[0])
    assert sizes[0] == sizes[1] == step
    whole, _, _ = linear_ce._restrict_vocab(weight, None, torch.tensor([vocab - 1]), -100, torch.arange(3 * step))
    assert whole.shape[0] == vocab


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_vocab_subset_with_a_non_negative_ignore_index(path):
    """ignore_index=0 (a pad id) with a subset that leaves id 0 out: the label renumbered to 0 (the subset's first
    id) is a real label, and counts (it read as ignored until the renumbered labels marked ignored ones apart)."""
    step = linear_ce.SUBSET_ROWS_STEP
    hidden, weight = torch.randn(4, 4), torch.randn(2 * step, 4)
    subset = torch.arange(1000, 1000 + step)                       # one whole step: no padding ids
    labels = torch.tensor([1000, 1500, 0, 1010])                   # the first renumbers to 0; the third is padding
    per_token = linear_cross_entropy(hidden, weight, labels, ignore_index=0, reduction="none",
                                     vocab_subset=subset, path=path)
    logits = hidden.double() @ weight.double()[subset].T           # the softmax over the subset
    real = labels != 0
    want = torch.logsumexp(logits, -1) - logits.gather(1, (labels.clamp(min=1000) - 1000)[:, None])[:, 0]
    want = torch.where(real, want, 0.0)
    assert rel(per_token, want) < 1e-5 and per_token[0] > 0
    mean = linear_cross_entropy(hidden, weight, labels, ignore_index=0, vocab_subset=subset, path=path)
    assert rel(mean, want.sum() / real.sum()) < 1e-5


def test_frequent_token_subset_orders_by_count():
    ids = torch.tensor([5, 5, 5, 2, 2, 9, -100, -100, -100, -100])
    assert frequent_token_subset(ids, 2).tolist() == [2, 5]
    assert frequent_token_subset(ids, 10).tolist() == [2, 5, 9]


def test_bad_inputs_are_named():
    hidden, weight, labels, _ = _inputs((4,), 16, 100, torch.float32)
    with pytest.raises(MemfitError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="avg")
    with pytest.raises(MemfitError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:2])
    with pytest.raises(MemfitError, match="dtype"):
        linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(MemfitError, match="softcap"):
        linear_cross_entropy(hidden, weight, labels, softcap=0.0)
    with pytest.raises(MemfitError, match=r"\[0, 100\)"):
        linear_cross_entropy(hidden, weight, torch.full((4,), 100), path="reference")


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = torch.empty(6, 16, dtype=torch.bfloat16)
        weight = torch.empty(50, 16, dtype=torch.bfloat16)
        loss, lse = torch.ops.memfit.linear_ce(hidden, weight, torch.zeros(6, dtype=torch.int64), None,
                                               -100, 0.0, 0.0, 0, "reference")
        assert loss.shape == (6,) and loss.dtype == torch.float32 and lse.shape == (6,)


@pytest.mark.parametrize("row_blocks,tiles,sms", [(32, 501, 132), (64, 501, 132), (128, 501, 132), (1, 501, 132),
                                                  (8, 7, 108), (300, 1000, 132)])
def test_forward_splits_balance_the_waves(row_blocks, tiles, sms):
    """The forward's vocabulary split keeps the busiest SM within 2% of the best split's load,
    and takes the fewest slices that do (each slice adds partials to combine)."""
    def busiest(s):
        return math.ceil(row_blocks * s / sms) * math.ceil(tiles / s)

    chosen = linear_ce._balanced_splits(row_blocks, tiles, sms)
    best = min(busiest(s) for s in range(1, 65))
    assert busiest(chosen) <= 1.02 * best
    assert all(busiest(s) > 1.02 * best for s in range(1, chosen))


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_backward_step_tiles_fit_every_step_width(monkeypatch, precision):
    """The backward kernels' tile sets as a GPU sees them (the interpreter has one tile): at every step-width bucket
    some tile of the precision's own set fits the step (its step block at most twice the width, and on the tensor
    cores at least 128 on a step of 512 or more), and the pruner keeps exactly those. The weight-gradient kernel's
    step spans its rows, and its narrow tiles had been built the other way round: at a 16-wide step none fit and
    every tensor-core tile was compiled."""
    monkeypatch.setattr(linear_ce, "interpreting", lambda: False)
    ieee = precision == "ieee"
    for rows, cols, step_block in (("BLOCK_N", "BLOCK_V", "BLOCK_V"), ("BLOCK_M", "BLOCK_H", "BLOCK_M")):
        tiles = linear_ce._TileSets(rows, cols, (16, 16, 16, 4, 1), narrow_block=step_block)
        for key in (16, 32, 64, 128, 256, 512, 8192):
            fitting = [c for c in tiles.configs if (id(c) in tiles.ieee_ids) == ieee
                       and c.kwargs[step_block] <= max(16, 2 * key) and (ieee or key < 512 or c.kwargs[step_block] >= 128)]
            assert fitting, (step_block, key)
            assert tiles.prune(tiles.configs, {"WIDTH_KEY": key}, PRECISION=precision) == fitting
