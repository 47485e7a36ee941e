"""End to end: a Llama-3.2-1B-shaped model, dense vs block-low-rank, prefill and decode.

Both models are random-init bf16 (speed depends on shapes, not values); the BLR ones
have the paper's ranks (q/o 256, gate 512, up/down 768, b=16; k/v dense) built by
memfit.compress.structure_model. Each is run eager and torch.compile'd with CUDA graphs
(mode="reduce-overhead"):

* prefill: 1024 tokens at batch 1, logits for the last token only (``logits_to_keep=1``);
* decode: one token at batch 1 against a static KV cache of 1024 + 64 positions.

Attention is transformers' SDPA by default; ``--attention memfit`` runs every model's
attention through memfit's kernels instead (prefill: the causal Triton kernel; decode, one
query against the cache: ``memfit.kernels.decode.cache_attention``, from b8f83d3; SDPA before),
to show how the speedup moves when the part BLR cannot change gets faster for both.

Baselines in the same run: the dense model (eager and compiled), the roofline floor
(matmul FLOPs at the measured bf16 rate, weight + KV bytes at the measured bandwidth), and
the ``free`` model: the dense model with every layer the BLR models compress replaced by
one that costs nothing (its input broadcast to the output's shape, a view). Its time is
what the BLR layers cannot change (attention, norms, k/v, the head, launches), so dense /
free is the most any BLR kernel could speed the step up: the Amdahl bound of the targets.
Targets: BLAST prefill >= 2.0x and decode >= 1.8x the compiled dense model.

Each compiled step is timed twice: as a caller gets it (``do_bench``: events around each call, L2 flushed
between calls), and with its calls queued behind a sleep kernel (``memfit.measure.timing.queued_ms``: the GPU's
time alone, ``*_gpu_ms``, and the host's time to issue a step, ``*_host_ms``). They part where the host is the
slower of the two: the CUDA-graph trees of ``mode="reduce-overhead"`` check guards and inputs before each replay.
Before this column the ``free`` model's decode step read 0.52 to 0.83 ms across three runs with memfit's decode GEMV
(26d0282 and 97724cb, which also carried their commits' fused-MLP option, and b476899), where b476899's profile
summed its kernels to 0.45 ms.
Each row records the graph breaks its compilation met, and a model that passes dynamo's recompile limit stops the
run (``fail_on_recompile_limit_hit``): past it dynamo runs frames eagerly, which at fd16a94, where every BLR
layer's wrapper broke the graph, timed the compiled BLR models at 0.02-0.23x dense.
Writes benchmarks/results/blr_e2e.json and .png.

    python benchmarks/blr_e2e.py            # H200: ~3 min, mostly compilation
    python benchmarks/blr_e2e.py --smoke    # CPU, tiny preset, eager only
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch._dynamo.utils import counters

from memfit.compress import PAPER_RANKS_LLAMA_1B, structure_model
from memfit.compress.convert import decoder_linears, model_shapes, replace_module
from memfit.compress.plan import plan_kinds
from memfit.errors import MemfitError
from memfit.infer.decode_gemv import use_decode_gemv
from memfit.kernels import autotune, batched_gemm
from memfit.measure.results import check_out_dir, target, write_results
from memfit.measure.timing import queued_ms
from memfit.models import PRESETS, build_model

PREFILL = 1024
DECODE_CACHE = PREFILL + 64


def static_cache(model, length: int):
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=length)
    except TypeError:  # transformers 4.x signature
        param = next(model.parameters())
        return StaticCache(config=model.config, max_batch_size=1, max_cache_len=length, device=param.device, dtype=param.dtype)


def hold_write_position(cache) -> None:
    """Make every later step write its token where the next one would go now, without moving that position (call it
    once the cache is filled: the layers' own update allocates their tensors on first use). transformers 5's static
    cache layers write at a device counter (``cumulative_length``) that each update advances, so repeated timing
    calls of one decode step wrote further on, and at d7b7323, where a decode step was timed a second time, past the
    cache's end (a device-side assert of an index below 1088, the cache's length, in a compiled kernel:
    ``results/logs/blr_e2e_memfit_attention_decode_gemv_assert_d7b7323.log``). Each timed call is now the same step,
    the one after the prefill. transformers 4's layers write at the step's ``cache_position`` and need nothing; a
    counting layer of another kind (a sliding window's ring buffer) is refused."""
    for layer in getattr(cache, "layers", ()):
        if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            continue
        if type(layer).__name__ != "StaticLayer":
            raise MemfitError(f"blr_e2e: cannot hold the write position of a {type(layer).__name__} (only "
                              "transformers' StaticLayer)")
        layer.update = functools.partial(_update_in_place, layer)


def _update_in_place(layer, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """transformers 5's static layer update without advancing ``cumulative_length``."""
    position = torch.arange(key_states.shape[-2], device=layer.keys.device) + layer.cumulative_length
    layer.keys.index_copy_(2, position, key_states)
    layer.values.index_copy_(2, position, value_states)
    return layer.keys, layer.values


def add_gpu_only_times(row: dict, steps: dict, label: str) -> None:
    """Each step's GPU-only time and the host's time to issue it (``queued_ms``) into ``row`` as ``{step}_gpu_ms``
    and ``{step}_host_ms``; a step whose calls cannot be queued gets ``{step}_gpu_error`` instead, said, and the run
    goes on (its times as called stand)."""
    for step, fn in steps.items():
        try:
            queued = queued_ms(fn)
        except MemfitError as err:
            row[f"{step}_gpu_error"] = str(err)
            print(f"{label} {step}: no GPU-only time: {err}", flush=True)
            continue
        row[f"{step}_gpu_ms"], row[f"{step}_host_ms"] = queued.gpu_ms, queued.host_ms


def timer(smoke: bool):
    if not smoke:
        from memfit.measure.timing import bench_ms

        return bench_ms

    def cpu_ms(fn, reps: int = 3) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - start) / reps

    return cpu_ms


def workloads(model, compile_: bool, device: str):
    """(prefill_fn, decode_fn) closures over fixed inputs; compiled with CUDA graphs when asked."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, PREFILL), device=device)
    tok = torch.randint(0, vocab, (1, 1), device=device)
    pos = torch.tensor([PREFILL], device=device)
    cache = static_cache(model, DECODE_CACHE)
    from memfit.models.hf_calls import cache_keyword

    cache_arg = cache_keyword(model)

    def prefill():
        return model(input_ids=ids, logits_to_keep=1, use_cache=False).logits

    def decode():
        return model(input_ids=tok, cache_position=pos, use_cache=True, logits_to_keep=1, **{cache_arg: cache}).logits

    if compile_:
        prefill = torch.compile(prefill, mode="reduce-overhead", fullgraph=False)
        decode = torch.compile(decode, mode="reduce-overhead", fullgraph=False)
    with torch.no_grad():  # fill the cache once so decode attends over real positions
        model(input_ids=ids, cache_position=torch.arange(PREFILL, device=device), use_cache=True, logits_to_keep=1,
              **{cache_arg: cache})
    hold_write_position(cache)
    return prefill, decode


class FreeLinear(nn.Module):
    """A compressed layer's stand-in that costs nothing: its input's first feature broadcast to the
    output's shape (a view, no kernel). It must depend on its input: a stand-in that did not (an
    uninitialised tensor) let torch.compile drop everything before it as dead code (the attention
    before o_proj, the whole MLP), which timed 0.16 ms prefill steps (27344f8, log in
    benchmarks/results/logs/). Elementwise work next to it may shrink too (a broadcast input), so
    the bound errs high. Values are garbage, times are not."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return x[..., :1].expand(*x.shape[:-1], self.out_features)


def free_compressed_layers(model, method: str, ratio: float | None, blocks: int, ranks: dict | None) -> None:
    """Replace every layer that ``method`` would compress (the plan ``structure_model`` follows) with a
    :class:`FreeLinear`."""
    linears = decoder_linears(model)
    plan = plan_kinds(model_shapes(linears), method, ratio, blocks, ranks)
    for name, linear in linears.items():
        if plan[name.rsplit(".", 1)[-1]].rank is not None:
            replace_module(model, name, FreeLinear(linear.out_features))


def linear_params(model) -> int:
    from memfit.compress.convert import KINDS

    return sum(p.numel() for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in KINDS for p in m.parameters())


def floors(model, spec, ceilings, elem: int) -> dict:
    """Roofline floors (ms) of prefill and decode for this model."""
    lin = linear_params(model)
    head = spec.vocab * spec.hidden
    attn = 2 * PREFILL * PREFILL * spec.q_dim * spec.num_layers  # causal QK^T + PV
    kv_bytes = 2 * spec.num_layers * spec.kv_dim * DECODE_CACHE * elem
    prefill_flops = 2 * PREFILL * lin + attn + 2 * head
    decode_flops = 2 * (lin + head) + 4 * DECODE_CACHE * spec.q_dim * spec.num_layers
    weight_bytes = (lin + head) * elem
    return {"prefill": ceilings.floor_ms(prefill_flops, weight_bytes + kv_bytes),
            "decode": ceilings.floor_ms(decode_flops, weight_bytes + kv_bytes)}


KERNEL_KINDS = (  # (kind, name fragments), first match wins; lower-case
    ("blr", ("memfit::blast", "memfit::monarch", "memfit::lowrank", "memfit::gemv", "memfit::decode_linear")),  # CPU smoke
    ("attention", ("sdpa", "flash", "fmha", "attention", "attn", "_fwd_kernel")),  # _fwd_kernel: memfit's, prefill
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "splitk", "gemv", "aten::mm", "aten::bmm", "aten::addmm")),
)


@functools.cache
def blr_kernel_names() -> frozenset[str]:
    """The Triton kernels of memfit's BLR kernel modules, by the name the profiler gives them: every
    module-level Triton function named ``*_kernel`` (memfit's name for a launched one; its jit
    helpers are not), autotuned, with heuristics or plain, read from the modules so a new kernel is counted without
    being listed here. The GEMV module is one: its kernels run BLAST's last stage and Monarch's two at one token (and
    with ``--decode-gemv`` the dense layers, which then count here too)."""
    from triton.runtime import JITFunction
    from triton.runtime.interpreter import InterpretedFunction  # what triton.jit makes under TRITON_INTERPRET=1

    from memfit.kernels import blast, blr_common, gemv, lowrank, monarch

    functions = [batched_gemm.jit_function(value)
                 for module in (batched_gemm, blast, blr_common, gemv, lowrank, monarch)
                 for value in vars(module).values()]
    return frozenset(fn.__name__ for fn in functions
                     if isinstance(fn, (JITFunction, InterpretedFunction)) and fn.__name__.endswith("_kernel"))


def kernel_kind(name: str) -> str:
    """Which part of a step a kernel belongs to: BLR (memfit's BLR Triton kernels and ops), dense matmul
    (cuBLAS, including the BLR pipelines' cuBLAS stages), attention, or other (norms, rope,
    activations, copies)."""
    if name in blr_kernel_names():
        return "blr"
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(part in low for part in parts)), "other")


def step_profile(step, device: str) -> dict:
    """One step's GPU ms by kernel kind, the idle time between kernels, and the longest kernels."""
    from memfit.measure.kernel_profile import kernel_profile

    step()                                             # warm (graph replay, not capture)
    kernels, _, idle = kernel_profile(step, device, name_chars=100)
    by_kind: dict[str, float] = {}
    for name, entry in kernels.items():
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + entry["ms"]
    top = [{"name": name, **entry} for name, entry in list(kernels.items())[:12]]
    return {"ms_by_kind": by_kind, "idle_ms": idle["idle_ms"], "span_ms": idle["span_ms"], "top": top}


@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)    # a frame run eagerly past the limit is not "compiled"
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="blast,monarch", help="comma-separated BLR methods to compare with dense")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-eager", action="store_true", help="time only the compiled models")
    parser.add_argument("--no-bound", action="store_true",
                        help="skip the 'free' model (compressed layers at no cost: the most BLR could gain)")
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU, eager only")
    parser.add_argument("--attention", choices=("sdpa", "memfit"), default="sdpa",
                        help="attention of every model: transformers' SDPA (what a Hugging Face user gets; the "
                             "default) or memfit's attention kernels, prefill and decode (writes "
                             "blr_e2e_memfit_attention.json)")
    parser.add_argument("--inductor-pdl", action="store_true",
                        help="compile every model with torch._inductor.config.triton.enable_pdl (Hopper+): each "
                             "compiled kernel may start before the kernel ahead of it ends and waits only where it "
                             "reads that kernel's output (writes *_inductor_pdl.json)")
    parser.add_argument("--decode-gemv", action="store_true",
                        help="every model, dense included, computes its plain nn.Linear layers at decode by the path "
                             "memfit's pick times fastest per shape, cuBLAS or memfit's GEMV (the k/v projections "
                             "the BLR models keep dense, the head; memfit.infer.decode_gemv; writes *_decode_gemv.json)")
    parser.add_argument("--profile", action="store_true",
                        help="also split each timed step's GPU time by kernel kind (matmul, BLR, attention, other, idle)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)
    if args.inductor_pdl:
        from torch._inductor import config as inductor_config

        if not hasattr(inductor_config.triton, "enable_pdl"):
            parser.error(f"--inductor-pdl: torch {torch.__version__}'s inductor has no triton.enable_pdl")
        inductor_config.triton.enable_pdl = True
    global PREFILL, DECODE_CACHE
    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    if smoke:
        PREFILL, DECODE_CACHE = 32, 40
        spec, blocks, ranks = PRESETS["tiny"], 4, None
    else:
        spec, blocks, ranks = PRESETS["llama-3.2-1b"], args.blocks, PAPER_RANKS_LLAMA_1B
    ceilings = None if smoke else __import__("memfit.measure.timing", fromlist=["x"]).measure_ceilings()
    bench = timer(smoke)
    rows, results = [], {}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := [m for m in methods if m not in ("blast", "monarch", "lowrank")]:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from blast, monarch, lowrank")
    variants = ["dense", *methods] + ([] if args.no_bound else ["free"])
    attention = args.attention
    if attention == "memfit":
        from memfit.train.attention_hf import register

        attention = register()
    name = ("blr_e2e" + ("_memfit_attention" if args.attention == "memfit" else "")
            + ("_inductor_pdl" if args.inductor_pdl else "")
            + ("_decode_gemv" if args.decode_gemv else "") + ("_smoke" if smoke else ""))

    def save(targets: list[dict], complete: bool) -> Path:
        # the kernel variant each BLR layer shape took, with what the pick measured (or that it came from the cache),
        # and the tile each kernel's autotuner took
        return write_results(name, rows, targets, out_dir=args.out, model=spec.name, blocks=blocks, ranks=ranks,
                             attention=args.attention, inductor_pdl=args.inductor_pdl,
                             decode_gemv=args.decode_gemv,
                             pick_timings=autotune.PICK_TIMINGS,
                             tile_picks=autotune.tile_picks(), complete=complete,
                             ceilings=None if ceilings is None else {"matmul_tflops": ceilings.matmul_flops / 1e12,
                                                                     "bandwidth_gbs": ceilings.bandwidth / 1e9})

    for variant in variants:
        torch.manual_seed(0)
        model = build_model(spec, dtype="bfloat16", device=device, attn_implementation=attention)
        ratio = None
        plan = {"ratio": 0.5 if ranks is None else None, "blocks": blocks, "ranks": ranks}
        if variant == "free":
            free_compressed_layers(model, methods[0] if methods else "blast", **plan)
        elif variant != "dense":
            ratio = structure_model(model, variant, **plan).summary()["linear_ratio"]
        gemv_linears = use_decode_gemv(model) if args.decode_gemv else 0
        model.eval().requires_grad_(False)
        floor = floors(model, spec, ceilings, 2) if ceilings else {"prefill": None, "decode": None}
        for mode in (["compiled"] if args.no_eager else ["eager", "compiled"]):
            if mode == "compiled" and smoke:
                continue
            t0 = time.perf_counter()
            prefill, decode = workloads(model, mode == "compiled", device)
            breaks = dict(counters["graph_break"])
            with torch.no_grad():
                prefill_ms = bench(prefill)
                decode_ms = bench(decode)
            breaks = {reason: n - breaks.get(reason, 0) for reason, n in counters["graph_break"].items()
                      if n > breaks.get(reason, 0)}
            row = {"model": variant, "mode": mode, "linear_params": linear_params(model), "linear_ratio": ratio,
                   "prefill_tokens": PREFILL, "prefill_ms": prefill_ms, "prefill_floor_ms": floor["prefill"],
                   "decode_ms": decode_ms, "decode_tokens_per_s": 1e3 / decode_ms, "decode_floor_ms": floor["decode"],
                   "setup_and_bench_s": time.perf_counter() - t0, "graph_breaks": sum(breaks.values()),
                   "decode_gemv_linears": gemv_linears}
            for reason, n in breaks.items():
                print(f"{variant} {mode}: {n} graph break(s): {reason.splitlines()[0]}", flush=True)
            if mode == "compiled" and device == "cuda":
                with torch.no_grad():
                    add_gpu_only_times(row, {"prefill": prefill, "decode": decode}, f"{variant} {mode}")
            if args.profile and (mode == "compiled" or smoke):       # an eager step is mostly Python, not kernels
                with torch.no_grad():
                    row["prefill_profile"] = step_profile(prefill, device)
                    row["decode_profile"] = step_profile(decode, device)
            rows.append(row)
            results[(variant, mode)] = row
            gpu_only = "".join(f"  {step} GPU only {row[f'{step}_gpu_ms']:.3f} ms (host issues it in "
                               f"{row[f'{step}_host_ms']:.3f} ms)" for step in ("prefill", "decode")
                               if f"{step}_gpu_ms" in row)
            print(f"{variant:8s} {mode:8s} prefill {prefill_ms:8.3f} ms  decode {decode_ms:7.3f} ms "
                  f"({row['decode_tokens_per_s']:.0f} tok/s)  floors {floor['prefill']} / {floor['decode']}{gpu_only}",
                  flush=True)
        save([], complete=False)                  # a run stopped by a time limit keeps the models it measured
        del model
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    mode = "eager" if smoke else "compiled"
    dense = results[("dense", mode)]
    targets = []
    for variant in variants[1:]:
        row = results[(variant, mode)]
        row["prefill_speedup"] = dense["prefill_ms"] / row["prefill_ms"]
        row["decode_speedup"] = dense["decode_ms"] / row["decode_ms"]
        for step in ("prefill", "decode"):
            if f"{step}_gpu_ms" in row and f"{step}_gpu_ms" in dense:
                row[f"{step}_gpu_speedup"] = dense[f"{step}_gpu_ms"] / row[f"{step}_gpu_ms"]
        if variant == "free":
            gpu_only = "".join(f", {step} {row[f'{step}_gpu_speedup']:.2f}x GPU only" for step in ("prefill", "decode")
                               if f"{step}_gpu_speedup" in row)
            print(f"bound (compressed layers free): prefill {row['prefill_speedup']:.2f}x, "
                  f"decode {row['decode_speedup']:.2f}x dense{gpu_only}")
            continue
        targets.append(target(f"{variant} prefill speedup vs dense ({mode})", row["prefill_speedup"], 2.0, "x", "higher"))
        targets.append(target(f"{variant} decode speedup vs dense ({mode})", row["decode_speedup"], 1.8, "x", "higher"))
    path = save(targets, complete=True)
    plot(rows, path.with_suffix(".png"))
    for t in targets:
        print(f"{t['name']}: {t['measured']:.2f}x (target {t['target']}x) {'met' if t['met'] else 'NOT met'}")
    print(f"results: {path}")
    return 0


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    for ax, key, title in ((axes[0], "prefill_ms", f"prefill {PREFILL} tokens (ms)"), (axes[1], "decode_ms", "decode, ms/token")):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=["C0" if r["model"] == "dense" else "C1" for r in rows])
        floor_key = key.replace("_ms", "_floor_ms")
        ax.scatter(range(len(rows)), [r[floor_key] or float("nan") for r in rows], color="k", marker="_", s=400,
                   label="roofline floor", zorder=3)
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
