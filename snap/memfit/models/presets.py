"""Built-in model shapes, with values as in each model's public ``config.json``.

These let memfit plan, build random-init models and benchmark with no download.
"""
from __future__ import annotations

from memfit.models.spec import ModelSpec


def _llama(name, layers, hidden, inter, heads, kv, vocab, tied, head_dim=None, **kw):
    return ModelSpec(name=name, model_type=kw.pop("model_type", "llama"), num_layers=layers, hidden=hidden,
                     intermediate=inter, num_heads=heads, num_kv_heads=kv, head_dim=head_dim or hidden // heads,
                     vocab=vocab, tied_embeddings=tied, **kw)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # A test shape: awkward sizes (intermediate not a power of two, GQA 2:1), runs on a CPU in milliseconds.
        _llama("tiny", 2, 64, 176, 4, 2, 512, False, dtype="float32"),
        _llama("llama-3.2-1b", 16, 2048, 8192, 32, 8, 128256, True, head_dim=64, rope_theta=500000.0, max_position=131072),
        _llama("llama-3.2-3b", 28, 3072, 8192, 24, 8, 128256, True, head_dim=128, rope_theta=500000.0, max_position=131072),
        _llama("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128256, False, rope_theta=500000.0, max_position=131072),
        _llama("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, False, dtype="float16", max_position=4096),
        _llama("qwen2.5-0.5b", 24, 896, 4864, 14, 2, 151936, True, model_type="qwen2", attention_bias=True,
               rms_norm_eps=1e-6, rope_theta=1000000.0, max_position=32768),
        _llama("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, 151936, True, model_type="qwen2", attention_bias=True,
               rms_norm_eps=1e-6, rope_theta=1000000.0, max_position=32768),
        _llama("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, False, model_type="qwen2", attention_bias=True,
               rms_norm_eps=1e-6, rope_theta=1000000.0, max_position=32768),
        _llama("mistral-7b", 32, 4096, 14336, 32, 8, 32000, False, model_type="mistral", max_position=32768),
    )
}
