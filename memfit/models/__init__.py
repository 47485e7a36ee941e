"""Model shapes (ModelSpec, presets, config.json parsing) and offline random-init builders."""
from memfit.models.build import build_model, save_model_dir
from memfit.models.presets import PRESETS
from memfit.models.spec import ModelSpec, dtype_bytes, dtype_of, load_spec

__all__ = ["ModelSpec", "PRESETS", "load_spec", "build_model", "save_model_dir", "dtype_of", "dtype_bytes"]
