"""Probe: memfit generate's prefill of a long prompt with no padding, on a random-init Llama-3.2-1B in bf16 on a GPU,
by each attention path and chunking (``memfit.infer.generate``):

    masked whole        under the additive mask, one chunk
    masked chunks       under the mask, chunks within PREFILL_MASK_BYTES (what a padded batch runs)
    no mask, whole      lower-right causal SDPA with no mask, one chunk
    no mask, chunks     the same in chunks within PREFILL_ACTIVATION_BYTES (the default for unpadded prompts)
    no mask, 64 MiB     the same within a quarter of that budget

For each: the prefill's peak above what was allocated before it, its time (median of three), and the first token's
logits' relative difference from the masked whole prompt's. Also whether SDPA's flash attention alone takes the
model's heads (the mask-free path's kernel on the GPU). The masked rows force the mask as a GPU without a mask-free
kernel would have it, so the log says once that there is none. The file is rewritten after each case:

    MEMFIT_COMMIT=<sha> OUT=/some/dir python benchmarks/probes/prefill_chunks.py   # OUT/prefill_chunks_<commit>.json
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp"))
CASES = [(1, 2048), (1, 8192), (4, 8192)]     # (batch, prompt tokens)
WHOLE = 2**62                                 # a budget no prompt reaches: one chunk


@torch.no_grad()
def prefill(gen, ids):
    """(peak bytes above the allocation before it, seconds, first-token logits) of one prefill, without autograd (as
    the public Generator.prefill runs: this calls the method that returns the logits too)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logits = gen._prefill(ids, None)[0].float()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, time.perf_counter() - start, logits


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memfit.infer import generate
    from memfit.measure.results import environment
    from memfit.models import PRESETS, build_model

    torch.manual_seed(0)
    spec = PRESETS["llama-3.2-1b"]
    model = build_model(spec, dtype=torch.bfloat16, device="cuda").eval()
    cfg = model.config
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        flash = generate.mask_free_causal_kernel(torch.device("cuda"), torch.bfloat16, cfg.num_attention_heads,
                                                 cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    chooses = generate.mask_free_causal_kernel
    variants = {   # name: (mask-free, mask budget, activation budget)
        "masked whole": (False, WHOLE, generate.PREFILL_ACTIVATION_BYTES),
        "masked chunks": (False, generate.PREFILL_MASK_BYTES, generate.PREFILL_ACTIVATION_BYTES),
        "no mask, whole": (True, generate.PREFILL_MASK_BYTES, WHOLE),
        "no mask, chunks": (True, generate.PREFILL_MASK_BYTES, generate.PREFILL_ACTIVATION_BYTES),
        "no mask, 64 MiB": (True, generate.PREFILL_MASK_BYTES, 64 * 2**20),
    }
    environment_now = environment()
    result = {"probe": "prefill_chunks", **environment_now, "model": "llama-3.2-1b", "dtype": "bfloat16",
              "flash_takes_the_heads": flash, "rows": []}
    for batch, tokens in CASES:
        ids = torch.randint(0, cfg.vocab_size, (batch, tokens), device="cuda")
        reference = None
        for name, (mask_free, mask_budget, activation_budget) in variants.items():
            generate.PREFILL_MASK_BYTES, generate.PREFILL_ACTIVATION_BYTES = mask_budget, activation_budget
            generate.mask_free_causal_kernel = chooses if mask_free else (lambda *args: False)
            gen = generate.Generator(model, tokens + 16, batch=batch, graphs=False, compile=False, fast=False,
                                     fused=False)
            runs = [prefill(gen, ids) for _ in range(3)]
            attended_mask_free = gen._attends_mask_free(tokens)
            logits = runs[-1][2]
            reference = logits if reference is None else reference
            row = {"batch": batch, "prompt_tokens": tokens, "prefill": name, "mask_free": attended_mask_free,
                   "mask_budget_bytes": mask_budget, "activation_budget_bytes": activation_budget,
                   "chunks": len(gen.prefill_chunks(tokens, masked=not attended_mask_free)),
                   "peak_above_GB": max(r[0] for r in runs) / 1e9,
                   "prefill_ms": statistics.median(r[1] for r in runs) * 1e3,
                   "first_token_logits_rel_diff": float((logits - reference).norm() / reference.norm())}
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            del gen
            torch.cuda.empty_cache()
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"prefill_chunks_{environment_now['commit']}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
