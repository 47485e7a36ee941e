"""Probe: the CPU memory of a prefill chunk's lower-right causal attention, torch's bias against the decode loop's
own path (``memfit.infer.generate._causal_attention``: SDPA's causal flag where the chunk's queries are all its keys,
else an additive (queries x keys) mask in the query's dtype). Per shape and dtype, the CPU tracker's peak above the
output (the attention's own bytes) in bytes per (query, key) pair, for each path, and whether the two outputs are
bit-identical. Writes OUT/cpu_causal_attention_memory_<commit>.json:

    MEMFIT_COMMIT=<sha> OUT=/some/dir python benchmarks/probes/cpu_causal_attention_memory.py
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from memfit.infer.generate import _causal_attention, _merge_heads  # noqa: E402
from memfit.measure.memory import CpuAllocationTracker  # noqa: E402
from memfit.measure.results import environment  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
# (batch, query heads, KV heads, head dim, queries, keys): a first chunk (queries = keys) and later ones
SHAPES = [(1, 4, 2, 32, 256, 256), (1, 4, 2, 32, 256, 1536), (1, 4, 2, 32, 512, 1536), (2, 4, 2, 32, 256, 1536),
          (1, 8, 8, 64, 256, 1536), (1, 4, 2, 32, 64, 4096)]


def torch_bias(q, k, v):
    """The loop's attention as it was: torch's lower-right causal bias on every device."""
    heads, T = q.shape[1:3]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, k.shape[2]), scale=0.1,
                                       enable_gqa=heads != k.shape[1])
    return _merge_heads(o, T)


def bytes_per_pair(attend, q, k, v) -> tuple[float, torch.Tensor]:
    """The peak the CPU tracker sees during ``attend(q, k, v)`` above its output, per (query, key) pair."""
    with CpuAllocationTracker() as tracker:
        out = attend(q, k, v)
    return (tracker.peak - out.untyped_storage().nbytes()) / (q.shape[2] * k.shape[2]), out


def main() -> None:
    env = environment()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, heads, kv_heads, head_dim, queries, keys in SHAPES:
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(batch, heads, queries, head_dim, dtype=dtype, generator=gen)
            k, v = (torch.randn(batch, kv_heads, keys, head_dim, dtype=dtype, generator=gen) for _ in range(2))
            theirs, reference = bytes_per_pair(torch_bias, q, k, v)
            ours, out = bytes_per_pair(lambda *qkv: _causal_attention(*qkv, 0.1), q, k, v)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "batch": batch, "heads": heads,
                         "kv_heads": kv_heads, "head_dim": head_dim, "queries": queries, "keys": keys,
                         "torch_bias_bytes_per_pair": theirs, "loop_bytes_per_pair": ours,
                         "bit_identical": bool(torch.equal(out, reference))})
            print(json.dumps(rows[-1]), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    record = {"probe": "cpu_causal_attention_memory", **env, "threads": torch.get_num_threads(), "rows": rows}
    (OUT / f"cpu_causal_attention_memory_{env['commit']}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
