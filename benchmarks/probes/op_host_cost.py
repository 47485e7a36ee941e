"""Probe: where the host time of one BLR layer call goes (Monarch, BLAST; Llama-3.2-1B's q/o and gate shapes at the
paper's ranks, bf16, on a GPU). memfit's eager prefill of a compressed model was host-bound: the ops' self CPU time
was 267 and 445 us a call, while the GPU ran 19 and 23 us of the whole prefill per op call
(``results/probes/prefill_profile_*_d170d8e.txt``). Each case
times the call issued back to back at every level of what runs in it (in interleaved rounds), so the differences
say what each level costs:

    module      the layer's forward (what a model calls)
    wrapper     memfit.kernels.<op>(...): shape checks, then the op's function (from b3c4e90 called directly where
                nothing needs the dispatcher, blr_common.skips_dispatcher) or the custom op, with variant="auto"
    op_auto     torch.ops.memfit.<op>(..., "auto"): the custom op, its pick (offer, key, cache; from b3c4e90
                remembered, autotune.auto_variant) and its pipeline
    op_named    the custom op with the picked variant named: its dispatch and the pipeline
    function_named  the op's function with the variant named, without the custom op (from the run after dfd69a8)
    pipeline    the picked pipeline's Python function alone (its launches, its tile picks)
    reference   the PyTorch reference (path="reference")
    dense       an nn.Linear of the same shape

plus a cProfile of the module calls. Writes OUT/op_host_cost.json and OUT/op_host_profile_<case>.txt:

    OUT=/some/dir python benchmarks/probes/op_host_cost.py
"""
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from memfit.kernels import blast as blast_kernels  # noqa: E402
from memfit.kernels import monarch as monarch_kernels  # noqa: E402
from memfit.layers import BlastLinear, MonarchLinear  # noqa: E402

CALLS = 200
ROUNDS = 5
SHAPES = {"q_o": (2048, 2048, 256), "gate": (2048, 8192, 512)}     # in, out, rank (PAPER_RANKS_LLAMA_1B)


def issue_us(calls: dict, rounds: int = ROUNDS, count: int = CALLS) -> dict:
    """Per label, the host time per call of ``count`` calls issued back to back (no sync between) in each of
    ``rounds`` rounds, the labels taken in turn within a round (at a93ab16, one loop of 200 per level, a level read
    up to 82 us below one it calls): the median and every round; and per call once the GPU had caught up, the
    median."""
    times = {label: {"issue": [], "done": []} for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(count):
                call()
            issued = time.perf_counter()
            torch.cuda.synchronize()
            times[label]["issue"].append(1e6 * (issued - start) / count)
            times[label]["done"].append(1e6 * (time.perf_counter() - start) / count)
    return {label: {"issue_us": statistics.median(t["issue"]), "issue_rounds_us": t["issue"],
                    "done_us": statistics.median(t["done"])} for label, t in times.items()}


def layer_calls(structure: str, layer, x) -> dict:
    """The call at each level of what runs in a layer call (the module docstring), and the variant the auto pick took
    for this shape (recorded from the op itself: a pick remembered earlier in the process leaves no timing record)."""
    if structure == "monarch":
        op, kernels, factors = torch.ops.memfit.monarch_linear, monarch_kernels, (layer.w1, layer.w2)
        wrapper = lambda: kernels.monarch_linear(x, *factors, None, layer.permute_output)           # noqa: E731
        op_args = (x, *factors, None, layer.permute_output)
        b, m = factors[0].shape[:2]
        pipeline_args = (x.reshape(-1, b * m), *factors, None, layer.permute_output)
    else:
        op, kernels, factors = torch.ops.memfit.blast_linear, blast_kernels, (layer.U, layer.V, layer.S)
        wrapper = lambda: kernels.blast_linear(x, *factors, None)                                   # noqa: E731
        op_args = (x, *factors, None)
        b, m = factors[1].shape[:2]
        pipeline_args = (x.reshape(-1, b * m), *factors, None)
    picks, auto_variant = [], kernels.auto_variant
    kernels.auto_variant = lambda *args: picks.append(auto_variant(*args)) or picks[-1]
    try:
        layer(x)
    finally:
        kernels.auto_variant = auto_variant
    picked, forward = picks[0], getattr(kernels, f"_{structure}_forward")
    return {"picked": picked, "calls": {
        "module": lambda: layer(x),
        "wrapper": wrapper,
        "op_auto": lambda: op(*op_args, "auto"),
        "op_named": lambda: op(*op_args, picked),
        "function_named": lambda: forward(*op_args, picked),
        "pipeline": lambda: kernels.VARIANTS[picked](*pipeline_args),
        "reference": lambda: kernels.__dict__[f"{structure}_linear"](*op_args, path="reference"),
    }}


def profile_text(call, calls: int = 100) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"{calls} calls\n")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return text.getvalue()


@torch.no_grad()
def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp"))
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": CALLS, "rounds": ROUNDS,
              "commit": os.environ.get("MEMFIT_COMMIT"), "cases": {}}
    for structure, cls in (("monarch", MonarchLinear), ("blast", BlastLinear)):
        for shape_name, (fan_in, fan_out, rank) in SHAPES.items():
            layer = cls(fan_in, fan_out, rank, 16, device="cuda", dtype=torch.bfloat16)
            dense = torch.nn.Linear(fan_in, fan_out, bias=False, device="cuda", dtype=torch.bfloat16)
            for n in (1, 128):
                name = f"{structure}_{shape_name}_N{n}"
                x = torch.randn(1, n, fan_in, device="cuda", dtype=torch.bfloat16)
                start = time.perf_counter()
                case = layer_calls(structure, layer, x)
                case["first_call_s"] = time.perf_counter() - start
                calls = case.pop("calls") | {"dense": lambda dense=dense, x=x: dense(x)}
                case["us"] = issue_us(calls)
                (out / f"op_host_profile_{name}.txt").write_text(profile_text(calls["module"]))
                report["cases"][name] = case
                print(name, case["picked"], {k: round(v["issue_us"], 1) for k, v in case["us"].items()}, flush=True)
    (out / "op_host_cost.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
