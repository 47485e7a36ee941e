"""The technique catalogue: what each technique can set, and what it costs in time.

A ``Technique`` proposes settings for some ``Knobs`` fields (its *variants*, given the
job and the user's own choices) and prices each variant in time. The memory effect of
a setting is not estimated here: the ledger replays the job with the knobs set
(``predict.py``), so a technique's memory model is whatever the replay makes of its knobs.
Later techniques register the same way with ``register``, adding the fields they need
to ``Knobs`` and the ops they change to the graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memfit.errors import MemfitError
from memfit.ledger.job import Job, Knobs
from memfit.ledger.predict import check_memfit_loop, ffn_partial_layers
from memfit.models.spec import dtype_bytes

REGISTRY: dict[str, "Technique"] = {}


@dataclass(frozen=True)
class Cost:
    """Predicted time cost of a technique, relative to the plain step's compute."""

    recompute: float = 0.0  # extra forward FLOPs as a fraction of the step's FLOPs
    overhead: float = 0.0  # other slowdown as a fraction (launches, dequantisation, optimizer kernels)
    pcie_bytes: int = 0  # bytes over PCIe per step

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.recompute + other.recompute, self.overhead + other.overhead, self.pcie_bytes + other.pcie_bytes)


@dataclass(frozen=True)
class Technique:
    """One memory technique: its knob variants and their time cost."""

    name: str
    summary: str
    variants: Callable[[Job, Knobs], list[dict]]  # knob changes to try; the first is "off"
    cost: Callable[[Job, Knobs], Cost]
    describe: Callable[[Knobs, Knobs], str | None]  # (knobs, as asked) -> a label when it changes them
    # whether a variant changes the numbers the model computes (its label then says "approximate"); None: never
    approximate: Callable[[Knobs], bool] | None = None


def register(technique: Technique) -> Technique:
    if technique.name in REGISTRY:
        raise ValueError(f"technique {technique.name!r} registered twice")
    REGISTRY[technique.name] = technique
    return technique


def step_flops(job: Job, knobs: Knobs) -> float:
    """FLOPs of one training step (or of prefill for inference): matmuls and attention."""
    spec = job.spec
    dense = spec.num_layers * sum(a * b for a, b in spec.linear_shapes().values()) + spec.vocab * spec.hidden
    attention = spec.num_layers * 2 * spec.q_dim * job.seq  # QK^T and PV per token, causal half of 4
    forward = 2 * job.tokens * (dense + attention)
    if job.task == "infer":
        return forward
    backward = 2 * forward if job.task == "full" else forward + 2 * job.tokens * attention  # LoRA: no weight grads
    return forward + backward


def layer_forward_fraction(job: Job) -> float:
    """A decoder layer's forward FLOPs as a fraction of the whole step."""
    spec = job.spec
    layer = sum(a * b for a, b in spec.linear_shapes().values()) + 2 * spec.q_dim * job.seq
    return 2 * job.tokens * layer / step_flops(job, Knobs())


# ---- the techniques of the foundation ---------------------------------------------------------

def _checkpoint_variants(job: Job, knobs: Knobs) -> list[dict]:
    if not job.training:
        return []
    counts = sorted({0, *(round(job.spec.num_layers * f) for f in (0.25, 0.5, 0.75)), job.spec.num_layers})
    variants = [{"checkpoint_layers": k, "offload_layers": 0} for k in counts]
    if job.device == "cuda":  # offloading to pinned host memory needs a GPU on the other side of PCIe
        variants += [{"checkpoint_layers": k, "offload_layers": k} for k in counts if k]
    return variants


def _offload_cost(job: Job, knobs: Knobs) -> Cost:
    """Each offloaded layer input crosses PCIe twice a step (out in forward, back in backward)."""
    micro = knobs.micro_batch or job.batch
    steps = job.batch // micro
    per_layer = micro * job.seq * job.spec.hidden * dtype_bytes(knobs.dtype)
    return Cost(pcie_bytes=2 * knobs.offload_layers * per_layer * steps)


def _checkpoint_words(knobs: Knobs) -> str:
    """The checkpoint variant in words; none is "no checkpointing" (a plan that drops an asked --checkpoint-layers)."""
    if not knobs.checkpoint_layers:
        return "no checkpointing"
    count = knobs.checkpoint_layers
    offloaded = f" ({knobs.offload_layers} offloaded to CPU)" if knobs.offload_layers else ""
    return f"checkpoint {count} layer{'s' if count != 1 else ''}{offloaded}"


register(Technique(
    name="checkpoint",
    summary="activation checkpointing per decoder layer: keep only each layer's input (optionally in pinned "
            "CPU memory), recompute in backward",
    variants=_checkpoint_variants,
    cost=lambda job, knobs: Cost(recompute=knobs.checkpoint_layers * layer_forward_fraction(job))
    + _offload_cost(job, knobs),
    describe=lambda knobs, base: _checkpoint_words(knobs)
    if (knobs.checkpoint_layers, knobs.offload_layers) != (base.checkpoint_layers, base.offload_layers) else None,
))

register(Technique(
    name="fused_ce",
    summary="fused linear cross-entropy (memfit.kernels.linear_ce): the loss from hidden states, no logits, "
            "tokens without a loss dropped first",
    variants=lambda job, knobs: [{"fused_ce": knobs.fused_ce}, {"fused_ce": True}] if job.training else [],
    # measured faster than materialised logits (benchmarks/results/linear_ce.json): no time cost
    cost=lambda job, knobs: Cost(),
    describe=lambda knobs, base: "fused linear cross-entropy" if knobs.fused_ce != base.fused_ce else None,
))

register(Technique(
    name="four_bit",
    summary="4-bit NF4 frozen base (bitsandbytes), dequantised per use; approximate: the base weights are "
            "quantised",
    variants=lambda job, knobs: [{"four_bit": knobs.four_bit}, {"four_bit": True}]
    if job.task in ("lora", "infer") and job.device == "cuda" else [],
    # dequantisation reads the 4-bit weights and writes a dense copy per linear, forward and backward
    cost=lambda job, knobs: Cost(overhead=0.15 if knobs.four_bit else 0.0),
    describe=lambda knobs, base: "4-bit NF4 base (approximate)" if knobs.four_bit != base.four_bit else None,
    approximate=lambda knobs: knobs.four_bit,
))

register(Technique(
    name="adamw8bit",
    summary="8-bit AdamW (bitsandbytes): 2 bytes of optimizer state per parameter instead of 8 (fp32) or 4",
    variants=lambda job, knobs: [{"optimizer": "adamw"}, {"optimizer": "adamw8bit"}]
    if job.training and job.device == "cuda" and knobs.optimizer == "adamw" else [],
    cost=lambda job, knobs: Cost(overhead=0.01 if knobs.optimizer == "adamw8bit" else 0.0),
    describe=lambda knobs, base: "8-bit AdamW" if knobs.optimizer != base.optimizer else None,
))


def _micro_batches(job: Job, knobs: Knobs) -> list[dict]:
    if not job.training or job.batch == 1:
        return []
    whole = knobs.micro_batch if knobs.micro_batch in (None, job.batch) else None   # as asked, if the job asked it
    return [{"micro_batch": m if m < job.batch else whole}
            for m in sorted({d for d in range(1, job.batch + 1) if job.batch % d == 0}, reverse=True)]


register(Technique(
    name="grad_accum",
    summary="gradient accumulation: run the batch as micro-batches, gradients summed in place",
    variants=_micro_batches,
    # smaller matmuls and more launches: a few percent per extra micro-batch
    cost=lambda job, knobs: Cost(overhead=0.03 * (job.batch // (knobs.micro_batch or job.batch) - 1)),
    describe=lambda knobs, base: (f"gradient accumulation (micro-batch {knobs.micro_batch})" if knobs.micro_batch
                                  else "no gradient accumulation") if knobs.micro_batch != base.micro_batch else None,
))

register(Technique(
    name="bf16",
    summary="bf16 weights and activations for a model stored in fp32 (half the bytes; LoRA adapters stay fp32); "
            "approximate: the weights are rounded to bf16",
    variants=lambda job, knobs: [{"dtype": "float32"}, {"dtype": "bfloat16"}] if knobs.dtype == "float32" else [],
    cost=lambda job, knobs: Cost(),
    describe=lambda knobs, base: "bf16 weights (approximate)" if knobs.dtype != base.dtype else None,
    approximate=lambda knobs: knobs.dtype == "bfloat16",
))


def _decode_bytes(job: Job, knobs: Knobs) -> float:
    """Weight bytes one decoded token reads: the linears (only the computed FFN neurons) and lm_head."""
    from memfit.infer.partial_load import PartialConfig

    spec = job.spec
    config = PartialConfig(load=knobs.partial_load, compute=knobs.partial_compute)
    computed = config.counts(spec.intermediate)[1]
    middle = len(ffn_partial_layers(spec))
    attention = sum(a * b for name, (a, b) in spec.linear_shapes().items() if name in ("q_proj", "k_proj", "v_proj",
                                                                                        "o_proj"))
    ffn = 3 * spec.hidden * ((spec.num_layers - middle) * spec.intermediate + middle * computed)
    return (spec.num_layers * attention + ffn + spec.vocab * spec.hidden) * dtype_bytes(knobs.dtype)


def _partial_ffn_words(knobs: Knobs) -> str:
    """The partial-FFN variant in words; the whole FFN is "no partial FFN" (a plan that drops an asked
    --partial-load), which computes the model's own numbers."""
    if (knobs.partial_load, knobs.partial_compute) == (1.0, 1.0):
        return "no partial FFN"
    return f"partial FFN (load {knobs.partial_load:g}, compute {knobs.partial_compute:g}; approximate)"


register(Technique(
    name="partial_ffn",
    summary="partial FFN loading and computation (memfit.infer): load gamma of the middle layers' FFN neurons, "
            "decode with phi of them; approximate",
    variants=lambda job, knobs: [{"partial_load": 1.0, "partial_compute": 1.0},
                                 {"partial_load": 0.7, "partial_compute": 0.4}]
    if job.task == "infer" and ffn_partial_layers(job.spec) and knobs.blr_method is None else [],
    # decode reads the weights once per token: time follows the bytes read
    cost=lambda job, knobs: Cost(overhead=_decode_bytes(job, knobs) / _decode_bytes(job, Knobs(dtype=knobs.dtype)) - 1),
    describe=lambda knobs, base: _partial_ffn_words(knobs) if (knobs.partial_load, knobs.partial_compute)
    != (base.partial_load, base.partial_compute) else None,
    approximate=lambda knobs: (knobs.partial_load, knobs.partial_compute) != (1.0, 1.0),
))


def _memfit_loop_variants(job: Job, knobs: Knobs) -> list[dict]:
    """Transformers' loop as asked and memfit's, for an inference job memfit's loop runs
    (predict.check_memfit_loop); nothing where the job asked for memfit's loop already."""
    if job.task != "infer" or knobs.generator == "memfit":
        return []
    try:
        check_memfit_loop(job, knobs.with_(generator="memfit"))
    except MemfitError:
        return []
    return [{}, {"generator": "memfit"}]


register(Technique(
    name="memfit_generate",
    summary="memfit's decode loop (memfit generate): a static KV cache allocated once, the prompt run in chunks of "
            "queries, each decode step one CUDA graph",
    variants=_memfit_loop_variants,
    # no time cost: a prompt of several chunks pays their extra launches, and its decode steps are the faster
    # (Llama-3.2-3B in fp16 on the H200: 456 tokens/s against transformers generate's 13.5, results/partial_ffn.json)
    cost=lambda job, knobs: Cost(),
    describe=lambda knobs, base: "memfit's decode loop (`memfit generate`)" if knobs.generator != base.generator
    else None,
))


def total_cost(job: Job, knobs: Knobs) -> Cost:
    total = Cost()
    for technique in REGISTRY.values():
        total = total + technique.cost(job, knobs)
    return total


def active(knobs: Knobs, base: Knobs) -> list[str]:
    """Labels of the techniques these knobs turn on beyond the job as asked (``base``)."""
    return [label for t in REGISTRY.values() if (label := t.describe(knobs, base))]


def approximate(knobs: Knobs, base: Knobs) -> bool:
    """Whether these knobs turn on a technique that changes the numbers the model computes."""
    return any(t.approximate is not None and t.approximate(knobs) and t.describe(knobs, base)
               for t in REGISTRY.values())
