"""Probe: a compressed Llama-3.2-1B (Monarch, BLAST; paper ranks, bf16, on a GPU) in memfit's decode loop, as
``benchmarks/blr_generate.py`` runs it: memory after each stage (load, Generator, two generations) and the eager
128-token prefill's time and CPU profile. Writes OUT/probe.json and OUT/prefill_profile_<method>.txt:

    OUT=/some/dir python benchmarks/probes/blr_generate_stages.py
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blr_generate import save_structured  # noqa: E402

from memfit.compress import PAPER_RANKS_LLAMA_1B, load_compressed  # noqa: E402
from memfit.infer.generate import Generator  # noqa: E402
from memfit.models import PRESETS  # noqa: E402


class Stages:
    """Memory above ``base`` now and at its peak since the last mark, and reserved, at each named stage."""

    def __init__(self, label: str):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.label, self.base, self.marks = label, torch.cuda.memory_allocated(), {}

    def mark(self, name: str) -> None:
        torch.cuda.synchronize()
        self.marks[name] = {"now_GB": (torch.cuda.memory_allocated() - self.base) / 1e9,
                            "peak_GB": (torch.cuda.max_memory_allocated() - self.base) / 1e9,
                            "reserved_GB": torch.cuda.memory_reserved() / 1e9}
        torch.cuda.reset_peak_memory_stats()
        print(self.label, name, self.marks[name], flush=True)


def probe(spec, method: str, prompt: torch.Tensor, out: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        directory = save_structured(spec, method, 16, PAPER_RANKS_LLAMA_1B, Path(tmp) / method)
        return _probe_saved(directory, method, prompt, out)


def _probe_saved(directory: Path, method: str, prompt: torch.Tensor, out: Path) -> dict:
    stages = Stages(method)
    model = load_compressed(directory, device="cuda")
    stages.mark("load")
    gen = Generator(model, 128 + 256)
    stages.mark("generator")
    first = gen.generate(prompt, 256)
    stages.mark("generate1")
    second = gen.generate(prompt, 256)
    stages.mark("generate2")
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        gen.prefill(prompt)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen.prefill(prompt)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    print(table)
    (out / f"prefill_profile_{method}.txt").write_text(table)
    return {"stages": stages.marks, "prefill_ms": times,
            "gpu_self_us_in_profile": sum(e.self_device_time_total for e in prof.key_averages()),
            "r1_prefill_ms": 1e3 * first.prefill_s, "r2_prefill_ms": 1e3 * second.prefill_s,
            "tps2": second.tokens_per_s}


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp"))
    spec = PRESETS["llama-3.2-1b"]
    prompt = torch.randint(0, spec.vocab, (1, 128), generator=torch.Generator().manual_seed(0))
    report = {}
    for method in ("monarch", "blast"):
        report[method] = probe(spec, method, prompt, out)
        torch.cuda.empty_cache()
    (out / "probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
