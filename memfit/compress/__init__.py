"""Dense -> block-low-rank compression: projections, model conversion, save/load.

``memfit.compress(MODEL, OUT, method=..., ratio=..., blocks=...)`` (this module is callable: it
runs :func:`compress`, as ``memfit compress`` does) loads a preset or a local model, projects it
and saves it. The pieces it is made of, for a model already in memory:
``compress_model(model, method="blast", ratio=0.5, blocks=16, ...)`` converts a Hugging
Face Llama-family model in place; ``save_compressed``/``load_compressed`` store it;
``compressed_param_count(spec, method, ratio, blocks)`` tells the ledger the result's
size without building anything.
"""
import inspect
import sys
import types

from memfit.compress.convert import CompressionResult, compress_model, structure_model
from memfit.compress.io import load_compressed, save_compressed
from memfit.compress.pipeline import compress
from memfit.compress.plan import METHODS, PAPER_RANKS_LLAMA_1B, compressed_param_count, plan_kinds

__all__ = ["CompressionResult", "compress", "compress_model", "compressed_param_count", "load_compressed",
           "save_compressed", "plan_kinds", "structure_model", "METHODS", "PAPER_RANKS_LLAMA_1B"]


class _CallableModule(types.ModuleType):
    """``memfit.compress(...)`` runs :func:`compress`, the one-call API (``memfit compress`` on the
    command line), while ``memfit.compress.compress_model`` and the rest stay module attributes."""

    def __call__(self, *args, **kwargs):
        return compress(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(compress)          # what help() and inspect show for memfit.compress(...)
