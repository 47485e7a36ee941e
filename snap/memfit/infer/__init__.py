"""Inference: partial FFN loading/computation (SelectInfer) and a static-cache, CUDA-graph decode loop.

    rankings = calibrate(dense_model, batches); rankings.save(model_dir / "rankings.safetensors")
    model = load_model(model_dir, PartialConfig(load=0.7, compute=0.4), device="cuda")
    result = Generator(model, max_len=384).generate(prompt_ids, max_new=256)
"""
from memfit.infer.calibrate import Rankings, calibrate
from memfit.infer.generate import GenerationResult, Generator, weight_bytes_per_token
from memfit.infer.partial_load import PartialConfig, load_model

__all__ = ["Rankings", "calibrate", "Generator", "GenerationResult", "weight_bytes_per_token", "PartialConfig", "load_model"]
