"""Dense -> block-low-rank compression: projections, model conversion, save/load.

``compress_model(model, method="blast", ratio=0.5, blocks=16, ...)`` converts a Hugging
Face Llama-family model in place; ``save_compressed``/``load_compressed`` store it;
``compressed_param_count(spec, method, ratio, blocks)`` tells the ledger the result's
size without building anything.
"""
from memfit.compress.convert import CompressionResult, compress_model, structure_model
from memfit.compress.io import load_compressed, save_compressed
from memfit.compress.plan import METHODS, PAPER_RANKS_LLAMA_1B, compressed_param_count, plan_kinds

__all__ = ["CompressionResult", "compress_model", "compressed_param_count", "load_compressed", "save_compressed",
           "plan_kinds", "structure_model", "METHODS", "PAPER_RANKS_LLAMA_1B"]
