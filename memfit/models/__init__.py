"""Model shapes (ModelSpec, presets, config.json parsing) and offline random-init builders.

The builders import torch and transformers, so they load on first use: planning a job
(the ledger, ``memfit plan``) needs only the shapes.
"""
from memfit.models.presets import PRESETS
from memfit.models.spec import ModelSpec, dtype_bytes, dtype_of, load_spec

__all__ = ["ModelSpec", "PRESETS", "load_spec", "build_model", "save_model_dir", "model_skeleton", "dtype_of",
           "dtype_bytes"]


def __getattr__(name: str):
    if name in ("build_model", "save_model_dir", "model_skeleton"):
        from memfit.models import build

        return getattr(build, name)
    raise AttributeError(f"module 'memfit.models' has no attribute {name!r}")
