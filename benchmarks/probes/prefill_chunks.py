"""Probe: memfit generate's prefill of a long prompt in one chunk against chunks of queries
(``memfit.infer.generate.PREFILL_MASK_BYTES``), on a random-init Llama-3.2-1B in bf16 on a GPU: the prefill's peak
above what was allocated before it, its time (median of three), and the first token's logits of the two (relative
difference). Writes OUT/prefill_chunks.json:

    OUT=/some/dir python benchmarks/probes/prefill_chunks.py
"""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp"))
CASES = [(1, 2048), (1, 8192), (4, 8192)]     # (batch, prompt tokens)
WHOLE = 2**62                                 # a mask budget no prompt reaches: one chunk


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
    from memfit.infer import generate
    from memfit.models import PRESETS, build_model
    torch.manual_seed(0)
    model = build_model(PRESETS["llama-3.2-1b"], dtype=torch.bfloat16, device="cuda").eval()
    default = generate.PREFILL_MASK_BYTES
    rows = []
    for batch, tokens in CASES:
        ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device="cuda")
        logits = {}
        for name, budget in (("whole", WHOLE), ("chunked", default)):
            generate.PREFILL_MASK_BYTES = budget
            gen = generate.Generator(model, tokens + 16, batch=batch, graphs=False, compile=False, fast=False,
                                     fused=False)
            runs = [prefill(gen, ids) for _ in range(3)]
            logits[name] = runs[-1][2]
            rows.append({"batch": batch, "prompt_tokens": tokens, "prefill": name, "mask_budget_bytes": budget,
                         "chunks": len(gen.prefill_chunks(tokens)), "peak_above_GB": max(r[0] for r in runs) / 1e9,
                         "prefill_ms": statistics.median(r[1] for r in runs) * 1e3})
            del gen
            torch.cuda.empty_cache()
        rows[-1]["first_token_logits_rel_diff"] = float((logits["chunked"] - logits["whole"]).norm()
                                                        / logits["whole"].norm())
        print(rows[-2], rows[-1], flush=True)
    commit = os.environ.get("MEMFIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                               capture_output=True, text=True).stdout.strip()
    result = {"probe": "prefill_chunks", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": commit, "model": "llama-3.2-1b", "dtype": "bfloat16", "rows": rows}
    (OUT / "prefill_chunks.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
