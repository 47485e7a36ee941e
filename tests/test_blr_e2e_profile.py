"""benchmarks/blr_e2e.py's kernel classification, which splits a profiled step into the part the
BLR layers can change (their kernels, cuBLAS) and the part they cannot (attention, the rest), and its
`free` model, which measures the most the BLR layers could gain."""
import json

import pytest
from conftest import load_benchmark

from memfit.models import PRESETS


@pytest.fixture(scope="module")
def blr_e2e():
    return load_benchmark("blr_e2e")


@pytest.mark.parametrize("name,kind", [
    ("_bgemm_kernel", "blr"), ("_zmix_kernel", "blr"), ("_tmix_kernel", "blr"), ("_mixgemm_kernel", "blr"),
    ("_fused_kernel", "blr"), ("_permute_kernel", "blr"), ("memfit::monarch_linear", "blr"),
    ("_gemv_kernel", "blr"),                         # BLAST's last stage at one token (bgemm_mix_gemv_pdl)
    ("mma", "other"),                                # a jit helper (inlined), not a kernel
    ("_fwd_kernel", "attention"), ("memfit::attention_fwd", "attention"),      # --attention memfit (GPU, CPU smoke)
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_arange", "attention"),
    ("triton_poi_fused_monarch_linear_mul_silu_8", "other"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_14", "other"),
])
def test_kernel_kind(blr_e2e, name, kind):
    assert blr_e2e.kernel_kind(name) == kind


def test_blr_kernels_are_read_from_the_modules_autotuned_or_not(blr_e2e, monkeypatch):
    import triton

    from memfit.kernels import monarch

    @triton.jit
    def _plain_kernel(x_ptr):
        pass

    monkeypatch.setattr(monarch, "_plain_kernel", _plain_kernel, raising=False)
    blr_e2e.blr_kernel_names.cache_clear()
    try:
        names = blr_e2e.blr_kernel_names()
    finally:
        blr_e2e.blr_kernel_names.cache_clear()
    assert {"_plain_kernel", "_tmix_kernel", "_bgemm_kernel"} <= names
    assert all(name.endswith("_kernel") for name in names)


def test_free_compressed_layers_cost_nothing_and_keep_shapes(blr_e2e):
    """The Amdahl-bound model: the layers the BLR plan compresses become parameter-free stand-ins with
    the right output shape; the layers it skips (k/v at these ranks) stay dense."""
    import torch

    from memfit.models import PRESETS, build_model

    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], dtype="float32", device=torch.get_default_device())
    attn = model.model.layers[0].self_attn
    q_out, k_weight = attn.q_proj.out_features, attn.k_proj.weight
    blr_e2e.free_compressed_layers(model, "blast", ratio=None, blocks=4,
                                   ranks={"q_proj": 8, "o_proj": 8, "gate_proj": 8, "up_proj": 8, "down_proj": 8})
    assert isinstance(attn.q_proj, blr_e2e.FreeLinear) and attn.k_proj.weight is k_weight
    assert isinstance(model.model.layers[0].mlp.down_proj, blr_e2e.FreeLinear)
    x = torch.randn(2, 3, 7, requires_grad=True)
    assert attn.q_proj(x).shape == (2, 3, q_out) and not list(attn.q_proj.parameters())
    attn.q_proj(x).sum().backward()                  # depends on its input: nothing before it is dead code
    assert x.grad.abs().sum() > 0
    with torch.no_grad():
        assert model(input_ids=torch.zeros(1, 5, dtype=torch.long)).logits.shape[:2] == (1, 5)


def test_results_are_written_after_each_model(blr_e2e, tmp_path, monkeypatch):
    """A run stopped by a time limit keeps the models it measured: the file is written after each model with
    ``complete: false`` and no targets, then complete with them (CPU smoke run of dense and low-rank, eager)."""
    writes = []
    real = blr_e2e.write_results

    def record(name, rows, targets, **extra):
        writes.append((len(rows), extra["complete"], len(targets)))
        return real(name, rows, targets, **extra)

    monkeypatch.setattr(blr_e2e, "write_results", record)
    assert blr_e2e.main(["--smoke", "--methods", "lowrank", "--no-bound", "--out", str(tmp_path)]) == 0
    assert writes == [(1, False, 0), (2, False, 0), (2, True, 2)]


def test_decode_gemv_patches_every_models_plain_linears(blr_e2e, tmp_path):
    """--decode-gemv: the dense model's every projection and head, the low-rank model's dense k/v and head (CPU
    smoke: the tiny preset's low-rank plan keeps k and v dense)."""
    assert blr_e2e.main(["--smoke", "--methods", "lowrank", "--no-bound", "--decode-gemv", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "blr_e2e_decode_gemv_smoke.json").read_text())
    layers = PRESETS["tiny"].num_layers
    assert data["decode_gemv"] and [r["decode_gemv_linears"] for r in data["rows"]] == [7 * layers + 1, 2 * layers + 1]


def test_inductor_pdl_is_refused_where_inductor_has_no_such_setting(blr_e2e, monkeypatch, capsys):
    """--inductor-pdl on a torch whose inductor lacks triton.enable_pdl stops at parse time and says which torch."""
    from torch._inductor import config as inductor_config

    monkeypatch.delattr(inductor_config.triton, "enable_pdl")
    with pytest.raises(SystemExit) as stop:
        blr_e2e.main(["--inductor-pdl", "--smoke"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--inductor-pdl" in err and "has no triton.enable_pdl" in err


def test_every_timed_decode_call_is_the_same_step(blr_e2e, monkeypatch):
    """The decode step the benchmark times writes its token at the position after the prefill on every call: as
    many calls as a timing makes, the cache's write position does not move (transformers 5's static cache advanced it
    per call, and writing past its end asserted on the GPU) and the new token's keys land at that position."""
    import torch

    from memfit.models import build_model

    monkeypatch.setattr(blr_e2e, "PREFILL", 8)
    monkeypatch.setattr(blr_e2e, "DECODE_CACHE", 10)
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], dtype="float32", device="cpu").eval()
    made = []
    real = blr_e2e.static_cache
    monkeypatch.setattr(blr_e2e, "static_cache", lambda *a: made.append(real(*a)) or made[-1])
    _, decode = blr_e2e.workloads(model, False, "cpu")
    layers = getattr(made[0], "layers", [])
    compiled = torch.compile(decode, backend="eager", fullgraph=True)   # dynamo traces the held update, no break
    with torch.no_grad():
        for step in (decode, compiled):
            for _ in range(3):                       # 8 + 6 > 10: past the cache's end if each call moved on
                step()
    if layers and hasattr(layers[0], "cumulative_length"):             # transformers 5
        assert [int(layer.cumulative_length) for layer in layers] == [8] * len(layers)
        assert layers[0].keys[0, :, 8].abs().sum() > 0 and layers[0].keys[0, :, 9].abs().sum() == 0


def test_a_counting_cache_layer_of_another_kind_is_refused(blr_e2e):
    import torch

    from memfit.errors import MemfitError

    class StaticSlidingWindowLayer:
        cumulative_length = torch.tensor(4)

    class Cache:
        layers = [StaticSlidingWindowLayer()]

    with pytest.raises(MemfitError, match="cannot hold the write position of a StaticSlidingWindowLayer"):
        blr_e2e.hold_write_position(Cache())


def test_a_step_that_cannot_be_queued_is_recorded_and_the_others_timed(blr_e2e, monkeypatch, capsys):
    from memfit.errors import MemfitError
    from memfit.measure.timing import QueuedTime

    def fake_queued(fn):
        if fn == "prefill step":
            raise MemfitError("queued_ms: blocks the host")
        return QueuedTime(gpu_ms=1.5, host_ms=0.5)

    monkeypatch.setattr(blr_e2e, "queued_ms", fake_queued)
    row = {}
    blr_e2e.add_gpu_only_times(row, {"prefill": "prefill step", "decode": "decode step"}, "blast compiled")
    assert row == {"prefill_gpu_error": "queued_ms: blocks the host", "decode_gpu_ms": 1.5, "decode_host_ms": 0.5}
    assert "blast compiled prefill: no GPU-only time: queued_ms: blocks the host" in capsys.readouterr().out
