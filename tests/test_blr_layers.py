"""Structured linear layers: definitions, projections, errors, training, permutation folding."""
import copy
import itertools

import pytest
import torch
from conftest import rel, seeded
from torch import nn

from memfit.errors import MemfitError
from memfit.layers import (
    BlastLinear,
    LowRankLinear,
    MonarchLinear,
    fold_output_permutation,
)

IN, OUT = 48, 80
CASES = [(LowRankLinear, {}), (MonarchLinear, {"blocks": 4}), (MonarchLinear, {"blocks": 4, "permute_output": True}),
         (BlastLinear, {"blocks": 4})]
IDS = ["lowrank", "monarch", "monarch-permuted", "blast"]


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """Layer logic runs on the PyTorch reference (fast); the Triton ops have their own tests."""
    monkeypatch.setenv("MEMFIT_KERNELS", "reference")


@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_to_dense_matches_forward_and_counts(cls, kw, monkeypatch):
    layer = cls(IN, OUT, 8, bias=True, **kw)
    x = torch.randn(3, 5, IN)
    ref = x @ layer.to_dense().T + layer.bias
    assert rel(layer(x), ref) < 1e-5
    monkeypatch.setenv("MEMFIT_KERNELS", "triton")   # the layer's Triton path (interpreter here)
    assert rel(layer(x), ref) < 1e-5
    assert layer.num_params() == sum(p.numel() for p in layer.parameters())
    assert layer.num_params() == cls.params_for_rank(IN, OUT, 8, kw.get("blocks", 1)) + OUT
    assert layer.flops(10) == 2 * 10 * cls.params_for_rank(IN, OUT, 8, kw.get("blocks", 1))
    assert "rank=8" in repr(layer)


@pytest.mark.parametrize("cls,kw", CASES[:3], ids=IDS[:3])
def test_from_dense_recovers_representable(cls, kw):
    source = cls(IN, OUT, 8, **kw)
    dense = nn.Linear(IN, OUT, bias=False)
    dense.weight.data = source.to_dense().detach()
    layer = cls.from_dense(dense, rank=8, **kw)
    assert rel(layer.to_dense(), dense.weight) < 1e-5


def test_monarch_layouts_equally_good():
    """P-free and permuted Monarch differ by a relabelling of the output features.

    The P-free layer from the row-relabelled matrix P^T W has exactly the permuted
    layer's error on W and the same outputs up to that relabelling; on W itself (a
    random matrix, whose rows have no order) its error is statistically the same.
    """
    from memfit.layers.monarch import output_permutation

    dense = nn.Linear(IN, OUT, bias=False)
    permuted = MonarchLinear.from_dense(dense, rank=8, blocks=4, permute_output=True)
    perm = output_permutation(permuted)                # y_paper[k] = y_blocks[perm[k]]
    relabelled = nn.Linear(IN, OUT, bias=False)
    relabelled.weight.data = torch.empty_like(dense.weight)
    relabelled.weight.data[perm] = dense.weight.detach()
    free = MonarchLinear.from_dense(relabelled, rank=8, blocks=4)
    assert not free.permute_output
    w = dense.weight.detach()
    err_permuted = rel(permuted.to_dense(), w)
    assert abs(rel(free.to_dense(), relabelled.weight) - err_permuted) < 1e-6
    x = torch.randn(5, IN)
    assert rel(free(x)[:, perm], permuted(x)) < 1e-5
    err_free = rel(MonarchLinear.from_dense(dense, rank=8, blocks=4).to_dense(), w)
    assert abs(err_free - err_permuted) < 0.05 * err_permuted


def test_blast_one_block_recovers_low_rank():
    """With b = 1 BLAST is U diag(s) V^T, which the SVD start recovers exactly."""
    source = LowRankLinear(IN, OUT, 6)
    dense = nn.Linear(IN, OUT, bias=False)
    dense.weight.data = source.to_dense().detach()
    assert rel(BlastLinear.from_dense(dense, rank=6, blocks=1).to_dense(), dense.weight) < 1e-4


@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_error_falls_with_rank(cls, kw):
    dense = nn.Linear(IN, OUT)
    errors = [rel(cls.from_dense(dense, rank=r, **kw).to_dense(), dense.weight.detach()) for r in (4, 8, 16, 32)]
    assert all(b < a for a, b in itertools.pairwise(errors)), errors
    layer = cls.from_dense(dense, ratio=0.5, **kw)
    assert layer.num_params() - OUT <= 0.5 * IN * OUT
    assert torch.equal(layer.bias, dense.bias)


def test_from_dense_keeps_dtype():
    dense = nn.Linear(IN, OUT, dtype=torch.bfloat16)
    layer = MonarchLinear.from_dense(dense, ratio=0.5, blocks=4)
    assert layer.w1.dtype == torch.bfloat16 and layer(torch.randn(2, IN, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("make,match", [
    (lambda: MonarchLinear(50, 80, 8, blocks=4), "in_features=50"),
    (lambda: MonarchLinear(48, 81, 8, blocks=4), "out_features=81"),
    (lambda: MonarchLinear(48, 80, 6, blocks=4), "rank=6"),
    (lambda: BlastLinear(48, 82, 8, blocks=4), "out_features=82"),
    (lambda: LowRankLinear(48, 80, 0), "rank"),
    (lambda: MonarchLinear.from_dense(nn.Linear(48, 80), ratio=0.01, blocks=4), "ratio=0.01"),
    (lambda: LowRankLinear.from_dense(nn.Linear(48, 80), rank=4, ratio=0.5), "exactly one"),
    (lambda: LowRankLinear.from_dense(nn.Conv1d(3, 3, 1), rank=4), "nn.Linear"),
    (lambda: MonarchLinear.from_dense(nn.Linear(48, 80), rank=8), r"MonarchLinear.from_dense needs blocks= "),
    (lambda: BlastLinear.from_dense(nn.Linear(48, 80), ratio=0.5), r"BlastLinear.from_dense needs blocks= "),
    (lambda: LowRankLinear.from_dense(nn.Linear(48, 80), rank=4, blocks=4),
     "LowRankLinear.from_dense takes no blocks; it takes rank=, ratio=$"),
    (lambda: BlastLinear.from_dense(nn.Linear(48, 80), rank=4, blocks=4, step=3),
     "BlastLinear.from_dense takes no step; it takes rank=, ratio=, blocks=, steps=$"),
    (lambda: MonarchLinear(48, 80, 8, blocks=4).set_factors(torch.randn(4, 4, 2, 20), torch.randn(4, 4, 12, 2)),
     r"set_factors: factors of shapes .*'left': \(4, 4, 2, 20\).*takes .*'left': \(4, 4, 20, 2\)"),
])
def test_bad_shapes_raise(make, match):
    with pytest.raises(MemfitError, match=match):
        make()


@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_trains(cls, kw):
    """A few Adam steps fit a random target: the layers have working gradients."""
    target = nn.Linear(IN, OUT)
    layer = cls(IN, OUT, 8, bias=True, **kw)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(64, IN)
    losses = []
    for _ in range(30):
        loss = (layer(x) - target(x).detach()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("consumer", ["linear", "lowrank"])
def test_fold_output_permutation_in_swiglu(consumer):
    gate, up = (MonarchLinear(IN, OUT, 8, blocks=4, bias=True, permute_output=True) for _ in range(2))
    down = nn.Linear(OUT, IN) if consumer == "linear" else LowRankLinear(OUT, IN, 8)
    x = torch.randn(7, IN)

    def mlp():
        return down(nn.functional.silu(gate(x)) * up(x))

    before = mlp()
    fold_output_permutation([gate, up], down)
    assert not gate.permute_output and not up.permute_output
    assert rel(mlp(), before) < 1e-5
    with pytest.raises(MemfitError, match="already folded"):
        fold_output_permutation([gate, up], down)


def test_fold_rejects_block_consumer():
    gate = MonarchLinear(IN, OUT, 8, blocks=4, permute_output=True)
    with pytest.raises(MemfitError, match="MonarchLinear"):
        fold_output_permutation([gate], MonarchLinear(OUT, IN, 8, blocks=4))


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_under_autocast_a_layer_computes_in_autocasts_dtype_as_nn_linear_does(cls, kw, path, monkeypatch):
    """fp32 weights and input under bf16 autocast: the output is bf16, as nn.Linear's, and equals the layer run on
    bf16 copies; the gradient reaches the fp32 weights. The layers had computed in fp32 and returned fp32 there."""
    monkeypatch.setenv("MEMFIT_KERNELS", path)
    layer = cls(IN, OUT, rank=8, bias=True, **kw)
    x = torch.randn(5, IN)
    with torch.autocast(x.device.type, torch.bfloat16):        # the tests' default device: the CPU, or CUDA on a GPU
        y = layer(x)
        assert y.dtype == nn.Linear(IN, OUT)(x).dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())
    with torch.no_grad():
        assert torch.equal(y, copy.deepcopy(layer).to(torch.bfloat16)(x.to(torch.bfloat16)))


@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_a_layer_on_the_meta_device_gives_its_output_shape(cls, kw):
    """Shape inference, as nn.Linear allows it: autocast, which the layers now follow, has no meta device."""
    layer = cls(IN, OUT, rank=8, bias=True, device="meta", **kw)
    assert layer(torch.empty(3, 5, IN, device="meta")).shape == (3, 5, OUT)


@pytest.mark.parametrize("shape, rank", [((3, 40, 12), 5), ((3, 12, 40), 5), ((24, 24), 8), ((7, 5), 9), ((5, 7), 9)])
def test_truncated_svd_fits_as_the_svd_does(shape, rank):
    """Wide, tall, square and batched, and a rank past min(rows, cols): the Gram-based factors fit as well as the
    SVD's truncation (the optimum: the square root of the dropped squared singular values), padded with zeros past the
    smaller side, in the input's dtype."""
    from memfit.layers.structured import truncated_svd

    M = torch.randn(*shape, generator=seeded(0)) @ torch.diag(torch.logspace(0, -3, shape[-1]))
    A, B = truncated_svd(M, rank)
    assert A.shape == (*shape[:-1], rank) and B.shape == (*shape[:-2], shape[-1], rank) and A.dtype == M.dtype
    s = torch.linalg.svdvals(M.double())
    optimum = s[..., rank:].square().sum(-1).sqrt()
    error = torch.linalg.matrix_norm(M.double() - A.double() @ B.double().transpose(-1, -2))
    assert bool((error <= optimum + 1e-6 * s[..., 0]).all()), (error, optimum)
    kept = min(rank, *shape[-2:])
    assert not A[..., kept:].any() and not B[..., kept:].any()


def test_truncated_svd_drops_pairs_below_its_floor_as_zero_columns():
    """A float64 matrix whose spectrum falls below GRAM_SVD_FLOOR of its largest singular value: the pairs there come
    out as zero columns (their digits are lost in the squared spectrum), so the fit is the SVD's only to that floor."""
    from memfit.layers.structured import GRAM_SVD_FLOOR, truncated_svd

    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=seeded(1), dtype=torch.float64))
    values = torch.cat([torch.logspace(0, -5, 15), torch.logspace(-9, -12, 15)]).double()   # none near the floor
    A, B = truncated_svd((q * values) @ q.T, 30)
    nonzero = int((A.norm(dim=0) > 0).sum())
    assert nonzero == int((values > GRAM_SVD_FLOOR).sum()) == 15 and not B[:, nonzero:].any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_linear_with_non_finite_weights_is_refused_not_factored_to_zeros(bad):
    """Gram-based factors of a NaN matrix would come out all zero (no pair above the floor) where the eigensolver
    returns NaN without raising, as it may on CUDA: refused, naming the cause."""
    linear = nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        linear.weight[3, 5] = bad
    with pytest.raises(MemfitError, match="non-finite values"):
        LowRankLinear.from_dense(linear, rank=4)
