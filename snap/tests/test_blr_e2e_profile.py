"""benchmarks/blr_e2e.py's kernel classification, which splits a profiled step into the part the
BLR layers can change (their kernels, cuBLAS) and the part they cannot (attention, the rest)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def blr_e2e():
    spec = importlib.util.spec_from_file_location("blr_e2e", ROOT / "benchmarks" / "blr_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,kind", [
    ("_bgemm_kernel", "blr"), ("_zmix_kernel", "blr"), ("_mixgemm_kernel", "blr"), ("_fused_kernel", "blr"),
    ("_permute_kernel", "blr"), ("memfit::monarch_linear", "blr"),
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
