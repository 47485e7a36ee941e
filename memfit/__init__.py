"""memfit: make LLM training, fine-tuning and inference fit the GPU memory you have.

    import memfit
    job = memfit.Job(memfit.load_spec("llama-3.2-3b"), task="lora", seq=2048)
    asked, plans = memfit.plan(job, memfit.Knobs(), budget=memfit.parse_bytes("8GiB"))
    result = memfit.verify(job, plans[0].knobs)          # on a GPU: predicted vs measured

``import memfit`` brings the ledger and torch; the rest is imported by name:
``memfit.compress``, ``memfit.train.patch``, ``memfit.infer``, ``memfit.layers``, ``memfit.kernels``.
"""
from memfit.errors import MemfitError
from memfit.ledger.job import Job, Knobs
from memfit.ledger.planner import Plan, plan
from memfit.ledger.predict import Ledger, predict
from memfit.ledger.verify import VerifyResult, verify
from memfit.models import PRESETS, ModelSpec, build_model, load_spec
from memfit.units import format_bytes, parse_bytes

__version__ = "0.1.0"
__all__ = ["MemfitError", "Job", "Knobs", "Plan", "plan", "Ledger", "predict", "VerifyResult", "verify", "PRESETS",
           "ModelSpec", "build_model", "load_spec", "format_bytes", "parse_bytes"]
