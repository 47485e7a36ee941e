"""memfit: make LLM training, fine-tuning and inference fit the GPU memory you have.

    import memfit
    job = memfit.Job(memfit.load_spec("llama-3.2-3b"), task="lora", seq=2048)
    asked, plans = memfit.plan(job, memfit.Knobs(), budget=memfit.parse_bytes("8GiB"))
    result = memfit.verify(job, plans[0].knobs)          # on a GPU: predicted vs measured

``import memfit`` brings the ledger, which needs no torch; ``verify``, ``build_model`` and
``compress`` (which do) load on first use, ``memfit.compress("llama-3.2-1b", "./blast-1b",
method="blast")`` compressing and saving a model; the rest is imported by name:
``memfit.train.patch``, ``memfit.infer``, ``memfit.layers``, ``memfit.kernels``.
"""
from memfit.errors import MemfitError
from memfit.ledger.job import Job, Knobs
from memfit.ledger.planner import Plan, plan
from memfit.ledger.predict import Ledger, predict
from memfit.models import PRESETS, ModelSpec, load_spec
from memfit.units import format_bytes, parse_bytes

__version__ = "0.1.0"
__all__ = ["MemfitError", "Job", "Knobs", "Plan", "plan", "Ledger", "predict", "VerifyResult", "verify", "PRESETS",
           "ModelSpec", "build_model", "compress", "load_spec", "format_bytes", "parse_bytes"]


_LAZY = {"verify": "memfit.ledger.verify", "VerifyResult": "memfit.ledger.verify", "build_model": "memfit.models.build"}


def __getattr__(name: str):
    """The names whose modules import torch, loaded on first use (``memfit plan`` never needs them)."""
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "compress":                    # the module, callable: memfit.compress(MODEL, OUT, method=...)
        return importlib.import_module("memfit.compress")
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
