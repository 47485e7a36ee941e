"""Predict a job's memory: per component, per phase, and the peak (a timeline, not a sum).

A training step is replayed as it runs: forward (activations pile up), the loss, backward
(activations are released layer by layer while gradients appear), then the optimizer
step (gradients, states and the optimizer's own temporaries together). With gradient
accumulation the later micro-batches run with the gradients already allocated. An
inference job is a prefill (KV cache filled, logits for the last token only) followed by
decode steps (the cache grows one token a step; DynamicCache re-allocates each layer's
cache with ``torch.cat``). The peak is the largest live total over all those moments.

Components: weights, gradients, optimizer state, activations (saved for backward),
logits (and their gradient, including the fp32 upcast the loss makes), KV cache,
temporaries (forward intermediates and activation gradients in flight), workspace
(cuBLAS, attention backward buffers, optimizer temporaries), and -- shown apart since
``max_memory_allocated`` never sees them -- allocator overhead and the CUDA context.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from memfit.errors import MemfitError
from memfit.ledger.graph import ModelGraph, Trainable, sdpa_fused_kernel
from memfit.ledger.job import OPTIMIZERS, TASK_ONLY_FIELDS, Job, Knobs, field_flag
from memfit.ledger.simulate import Event, Memory, Sym, replay_backward, replay_forward
from memfit.log import warn_once
from memfit.models.spec import dtype_bytes, dtype_of
from memfit.units import MiB, format_bytes

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "kv_cache", "temporaries", "workspace")
# cuBLAS keeps one workspace per handle and stream, taken from the caching allocator
# (torch's default on Hopper: 32 MiB), so it counts in max_memory_allocated.
CUBLAS_WORKSPACE = 32 * MiB
# torch gives each thread its own cuBLAS handle, and autograd runs a CUDA backward on its own device thread: a training
# step holds two workspaces, the forward's and the backward's (allocator history on the H200, 08bf567: one made at the
# rotary embedding's matmul in forward, one at linear_ce's first matmul in backward, both live between steps).
TRAINING_CUBLAS_WORKSPACES = 2 * CUBLAS_WORKSPACE
# What a training or inference process holds on the GPU outside the caching allocator: the CUDA context, the kernels
# it has loaded (torch's, Triton's, bitsandbytes'), library handles. Only shown and added to the budget check;
# max_memory_allocated never sees it. benchmarks/plan_fits.py measured 767-769 MiB at the end of every plan that ran on
# the H200 (torch 2.11, CUDA 13; e85f891, d2e16e1, 027117b), where 520 MiB, the bare context, had been assumed; 800
# leaves 31. A plan that offloads checkpoint inputs to pinned CPU memory read 839 (027117b; not traced).
CUDA_CONTEXT = 800 * MiB
# The caching allocator reserves more than it hands out: the gap between reserved and allocated at the peak. memfit's
# commands run it with expandable segments (memfit.local.use_expandable_segments); modelled as a fraction of the
# non-persistent bytes (activations and temporaries come and go; weights don't) plus, on CUDA, a fixed slack for its
# rounding and its small-block pool. With the fraction alone, half of plan_fits' plans ran out of memory under their
# predicted share; run again under their budget, their reserved bytes stood 0.16-0.26 GiB above their peaks (e85f891).
FRAGMENTATION = 0.04
ALLOCATOR_SLACK = 256 * MiB
# Said by a partial-FFN plan's ledger and by memfit verify, which refuses one.
NO_PARTIAL_FFN = ("verify does not build partial-FFN models: they are predicted by `memfit plan` and measured by "
                  "benchmarks/partial_ffn.py")
# Said by the ledger of memfit's loop at batch > 1, which counts prompts of one length (as verify runs them).
def _loop_padding_note() -> str:
    from memfit.infer.generate import PREFILL_MASK_BYTES

    return ("prompts of different lengths are left-padded, and memfit's loop then prefills under an attention mask, "
            f"in chunks that keep it within memfit.infer.generate.PREFILL_MASK_BYTES ({format_bytes(PREFILL_MASK_BYTES)})"
            ": up to that much more than this prediction of prompts of one length")


@dataclass
class Ledger:
    """Where the bytes of a job go at its peak, and the peak of each phase."""

    job: Job
    knobs: Knobs
    peak: dict[str, int]  # component -> bytes at the peak moment
    peak_phase: str
    peak_where: str
    phases: dict[str, int]  # phase -> peak total bytes in that phase
    allocator_overhead: int
    cuda_context: int
    trainable_params: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Predicted ``torch.cuda.max_memory_allocated`` (or tracked CPU peak)."""
        return sum(self.peak.values())

    @property
    def device_total(self) -> int:
        """What the job needs of the GPU: peak + allocator overhead + CUDA context."""
        return self.total + self.allocator_overhead + self.cuda_context

    def to_dict(self) -> dict:
        return {"job": self.job.to_dict(), "knobs": self.knobs.to_dict(), "peak_bytes": self.total,
                "device_bytes": self.device_total, "components": {c: self.peak.get(c, 0) for c in COMPONENTS},
                "allocator_overhead": self.allocator_overhead, "cuda_context": self.cuda_context,
                "peak_phase": self.peak_phase, "peak_at": self.peak_where, "phases": self.phases,
                "trainable_params": self.trainable_params, "notes": self.notes}


def _allocator_overhead(job: Job, transient: int) -> int:
    """Reserved above allocated at the peak, for ``transient`` bytes that come and go (see FRAGMENTATION)."""
    return int(FRAGMENTATION * transient) + (ALLOCATOR_SLACK if job.device == "cuda" else 0)


def _trainable(job: Job, knobs: Knobs) -> Trainable | None:
    if job.task == "infer":
        return None
    if job.task == "lora":
        return Trainable(linears=False, norms=False, embeddings=False, lora_rank=knobs.lora_rank,
                         lora_targets=knobs.lora_targets)
    return Trainable()


def _optimizer_bytes(param_bytes: list[tuple[int, int]], optimizer: str) -> int:
    """State bytes for (numel, element size) of each trainable parameter."""
    total = 0
    for numel, size in param_bytes:
        if optimizer == "adamw":
            total += 2 * numel * size + 4  # exp_avg, exp_avg_sq in the param dtype; step counter
        elif optimizer == "adamw8bit":
            # bitsandbytes: uint8 states with one fp32 absmax per 256-element block each,
            # only for tensors of >= 4096 elements; smaller ones keep 32-bit states.
            total += 2 * numel + 2 * 4 * -(-numel // 256) if numel >= 4096 else 2 * numel * 4
    return total


def _optimizer_temporary(param_bytes: list[tuple[int, int]], optimizer: str, device: str) -> int:
    """Bytes the optimizer step allocates and frees.

    torch's AdamW on CUDA uses the foreach path: ``_foreach_sqrt(exp_avg_sqs)`` makes one
    temporary the size of all states. On CPU it loops per tensor: ``exp_avg_sq.sqrt() / c``
    holds two temporaries of the largest tensor. bitsandbytes and plain SGD update in place.
    """
    if optimizer != "adamw" or not param_bytes:
        return 0
    if device == "cuda":
        return sum(n * s for n, s in param_bytes)
    return 2 * max(n * s for n, s in param_bytes)


def _fused_loss_on_pytorch_path(job: Job, knobs: Knobs) -> bool:
    """Whether this job's fused loss runs linear_ce's PyTorch path (``linear_ce.takes_pytorch_path``: it reads torch's
    float32 matmul precision and MEMFIT_KERNELS, state of this process). The cached functions below take it as an
    argument, so that a prediction follows a change of either."""
    if not knobs.fused_ce or job.task == "infer":
        return False
    from memfit.kernels.linear_ce import takes_pytorch_path

    return takes_pytorch_path(dtype_of(knobs.dtype), job.device)


def _train_graph(job: Job, knobs: Knobs, ce_pytorch_path: bool | None = None) -> tuple[ModelGraph, Sym]:
    """The ops of one micro-batch's forward and loss; returns the graph and the loss. Every decoder layer's ops are
    its own segment, so one graph serves every choice of checkpointed and offloaded layers (the replay's
    ``checkpointed`` set picks them) and every optimizer: the planner replays candidates that differ only there
    (most of them at large --batch) from one graph, which callers must not change. ``ce_pytorch_path``: the fused
    loss's path, by default :func:`_fused_loss_on_pytorch_path`'s."""
    if ce_pytorch_path is None:
        ce_pytorch_path = _fused_loss_on_pytorch_path(job, knobs)
    return _built_train_graph(job, knobs.with_(checkpoint_layers=0, offload_layers=0, optimizer=OPTIMIZERS[0]),
                              ce_pytorch_path)


@lru_cache(maxsize=32)
def _built_train_graph(job: Job, knobs: Knobs, ce_pytorch_path: bool) -> tuple[ModelGraph, Sym]:
    micro = knobs.micro_batch or job.batch
    graph = ModelGraph(job.spec, micro, job.seq, knobs.dtype, _trainable(job, knobs), job.device,
                       four_bit=knobs.four_bit and job.task == "lora", attention=knobs.attention,
                       structured=structured_kinds(job.spec, knobs), fused_swiglu=knobs.fused_swiglu)
    x, embedding = graph.embed()
    for layer in range(job.spec.num_layers):
        graph.segment = layer
        x = graph.decoder_layer(x, layer)
    graph.segment = None
    if knobs.fused_ce:   # per sequence (as verify masks them), less the last position, which the shift leaves unlabelled
        loss_tokens = micro * min(max(1, round(job.seq * job.loss_fraction)), job.seq - 1) or 1
        loss = graph.fused_linear_ce(x, embedding, loss_tokens, pytorch_path=ce_pytorch_path)
    else:
        loss = graph.causal_lm_loss(graph.head(x, embedding))
    return graph, loss


def predict(job: Job, knobs: Knobs) -> Ledger:
    """The ledger of ``job`` run with ``knobs`` (a fresh copy: callers may change it). A fused loss is counted on the
    path it takes in this process: fp32 at torch's float32 matmul precision now (IEEE, its default, or TF32) and
    MEMFIT_KERNELS choose between linear_ce's PyTorch path and its kernels (``linear_ce.takes_pytorch_path``)."""
    check_knobs_fit_job(job, knobs)
    check_device(job, knobs)
    check_blr(job, knobs)
    ledger = _cached_predict(job, knobs, _fused_loss_on_pytorch_path(job, knobs), _loop_chunk_budgets(job, knobs))
    return replace(ledger, peak=dict(ledger.peak), phases=dict(ledger.phases),
                   notes=_length_notes(job) + _window_notes(job, knobs) + list(ledger.notes))


def _length_notes(job: Job) -> list[str]:
    """A job longer than the model's configured length is counted as asked, and said in the ledger's notes: the model
    runs it (RoPE has no table to run out of) but was not set up for it."""
    if job.positions <= job.spec.max_position:
        return []
    return [f"{job.positions} positions pass the model's max_position_embeddings ({job.spec.max_position}): their "
            "memory is counted, but the model was not configured for that length"]


def _window_notes(job: Job, knobs: Knobs) -> list[str]:
    """A job whose keys reach the model's sliding window is counted as if it had none, and said once in the log and
    in the ledger's notes: transformers then builds an explicit attention mask and, for SDPA with a mask, repeats K/V
    to every query head (no enable_gqa); neither is modelled (CPU verify found such predictions 51-70% low)."""
    window = job.spec.sliding_window
    if window is None or job.positions < window or knobs.generator == "memfit":   # the loop runs within it, or refuses
        return []
    note = (f"attention over {job.positions} positions reaches {job.spec.name}'s sliding window of {window}: this "
            "prediction leaves out the attention mask and the repeated K/V that transformers builds there")
    warn_once(f"ledger:sliding-window:{job.spec.name}", note)
    return [note]


def _loop_chunk_budgets(job: Job, knobs: Knobs) -> tuple[int, int, int] | None:
    """The byte budgets memfit's decode loop sizes its prefill chunks by (memfit.infer.generate's module constants)
    and, on the CPU, the threads its attention's scratch is per (:func:`_cpu_flash_scratch`), for a job the loop runs:
    read now, so that a cached prediction follows a change of any (tests change them)."""
    if job.task != "infer" or knobs.generator != "memfit":
        return None
    import torch

    from memfit.infer import generate as loop

    return loop.PREFILL_ACTIVATION_BYTES, loop.PREFILL_MASK_BYTES, torch.get_num_threads() if job.device == "cpu" else 0


@lru_cache(maxsize=512)
def _cached_predict(job: Job, knobs: Knobs, ce_pytorch_path: bool, loop_budgets: tuple[int, int, int] | None) -> Ledger:
    """``loop_budgets`` is part of the cache's key only (:func:`_loop_chunk_budgets`)."""
    if job.task != "infer":
        return _predict_train(job, knobs, ce_pytorch_path)
    return _predict_memfit_loop(job, knobs) if knobs.generator == "memfit" else _predict_infer(job, knobs)


def _persistent(graph: ModelGraph) -> tuple[int, list[tuple[int, int]]]:
    seen, weights, trainable = set(), 0, []
    for p in graph.params:
        if p.uid in seen:
            continue
        seen.add(p.uid)
        weights += p.nbytes
        if p.requires_grad:
            trainable.append(p)
    return weights, [(p.nbytes // p.element_size, p.element_size) for p in trainable]


@dataclass(frozen=True)
class _TrainReplay:
    """A training step's replay without optimizer states: the peak bytes of each phase, the highest moment, and the
    persistent bytes the optimizer is sized from."""

    phases: dict[str, int]
    best: Event
    weights: int
    sizes: list[tuple[int, int]]


@lru_cache(maxsize=256)
def _train_replay(job: Job, knobs: Knobs, ce_pytorch_path: bool) -> _TrainReplay:
    """Replay one micro-batch's forward and backward, and where there are several a second one with the gradients
    already there. The optimizer's states are left out: they add the same bytes to every moment of the replay, so the
    peaks are the same moments for every optimizer, and the planner's candidates that differ only in the optimizer
    (half of them at large --batch) share one replay (``_predict_train`` adds the states)."""
    steps = job.batch // (knobs.micro_batch or job.batch)
    workspace = TRAINING_CUBLAS_WORKSPACES if job.device == "cuda" else 0
    phases: dict[str, int] = {}
    best = None
    graph, loss = _train_graph(job, knobs, ce_pytorch_path)   # replayed once per micro-batch; a replay changes no op
    weights, sizes = _persistent(graph)
    grads = sum(n * s for n, s in sizes)
    for index in range(min(steps, 2)):  # the first micro-batch, and one with gradients already there
        base = {"weights": weights, "optimizer": 0, "workspace": workspace}
        if index:
            base["gradients"] = grads
        memory = Memory(base)
        checkpointed = set(range(min(knobs.checkpoint_layers, job.spec.num_layers)))
        offloaded = set(range(knobs.offload_layers))
        saved = replay_forward(graph.ops, memory, "forward", keep={loss.uid}, checkpointed=checkpointed,
                               offloaded=offloaded)
        memory.alloc(loss)
        replay_backward(graph.ops, memory, saved, {loss.uid: loss}, checkpointed=checkpointed,
                        existing_param_grads=bool(index), offloaded=offloaded, memfit_checkpoints=knobs.patched)
        for phase, event in memory.phase_peaks.items():
            key = phase if index == 0 else f"{phase} (accumulating)"
            phases[key] = event.total
            if best is None or event.total > best.total:
                best = event
    return _TrainReplay(phases, best, weights, sizes)


def _with_optimizer(live: dict[str, int], optimizer: int) -> dict[str, int]:
    """A replayed moment's live bytes with the optimizer's states, in the place the replay keeps them (after the
    weights)."""
    out = {}
    for component, nbytes in live.items():
        out[component] = nbytes
        if component == "weights" and optimizer:
            out["optimizer"] = optimizer
    return out


def _predict_train(job: Job, knobs: Knobs, ce_pytorch_path: bool) -> Ledger:
    micro = knobs.micro_batch or job.batch
    if job.batch % micro:
        raise MemfitError(f"{field_flag('batch')} {job.batch} is not a multiple of {field_flag('micro_batch')} {micro}")
    workspace = TRAINING_CUBLAS_WORKSPACES if job.device == "cuda" else 0
    replay = _train_replay(job, knobs.with_(optimizer=OPTIMIZERS[0]), ce_pytorch_path)
    weights, sizes = replay.weights, replay.sizes
    grads = sum(n * s for n, s in sizes)
    trainable_numel = sum(n for n, _ in sizes)
    optimizer = _optimizer_bytes(sizes, knobs.optimizer)
    phases = {phase: nbytes + optimizer for phase, nbytes in replay.phases.items()}
    best = replay.best
    temp = _optimizer_temporary(sizes, knobs.optimizer, job.device)
    step = {"weights": weights, "optimizer": optimizer, "gradients": grads, "workspace": workspace + temp}
    phases["optimizer step"] = sum(step.values())
    if phases["optimizer step"] > best.total + optimizer:
        peak, phase, where = step, "optimizer step", knobs.optimizer
    else:
        peak, phase, where = _with_optimizer(best.live, optimizer), best.phase, best.where
    transient = sum(v for k, v in peak.items() if k not in ("weights", "optimizer", "gradients"))
    notes = []
    if knobs.optimizer == "adamw8bit":
        notes.append("8-bit AdamW needs bitsandbytes on CUDA")
    return Ledger(job, knobs, dict(peak), phase, where, phases, _allocator_overhead(job, transient),
                  CUDA_CONTEXT if job.device == "cuda" else 0, trainable_numel, notes)


def blr_dense_kinds(spec, knobs: Knobs) -> tuple[str, ...] | None:
    """The projection kinds a block-low-rank model (``knobs.blr_method``) keeps as nn.Linear, or None for a dense
    model."""
    if knobs.blr_method is None:
        return None
    from memfit.compress.plan import plan_kinds

    try:
        plans = plan_kinds(spec.linear_shapes(), knobs.blr_method, knobs.blr_ratio, knobs.blr_blocks, skip_option=None)
    except MemfitError as err:                         # name the options it came from
        blocks = "" if knobs.blr_method == "lowrank" else f" --blr-blocks {knobs.blr_blocks}"
        raise MemfitError(f"--blr {knobs.blr_method} --blr-ratio {knobs.blr_ratio:g}{blocks}: {err}") from None
    return tuple(kind for kind, p in plans.items() if p.rank is None)


def check_knobs_fit_job(job: Job, knobs: Knobs) -> None:
    """Refuse knobs this job cannot take, which would otherwise describe a run that cannot happen: more checkpointed
    layers than the model has (the ledger would count its layers), LoRA with no target, a frozen 4-bit base in full
    fine-tuning, memfit attention past the model's sliding window (it has none: memfit.train.attention_hf refuses
    the layer mid-forward), the fused SwiGLU for a model whose MLP activation is not SiLU, and a knob of the other
    kind of job set away from its default (the ledger would leave it out unsaid, as memfit plan refuses the option; a
    micro-batch of the whole batch is no change). A training job's micro-batch is checked where it is read, in
    ``_predict_train``."""
    default = Knobs()
    for name, (tasks, why) in TASK_ONLY_FIELDS.items():
        if job.task in tasks or not hasattr(default, name):                  # a Job field: the job's own task
            continue
        if getattr(knobs, name) not in (getattr(default, name), *((job.batch,) if name == "micro_batch" else ())):
            raise MemfitError(f"{field_flag(name)} does nothing with task {job.task}: {why}")
    layers = job.spec.num_layers
    if knobs.checkpoint_layers > layers:
        raise MemfitError(f"{field_flag('checkpoint_layers')} {knobs.checkpoint_layers} exceeds the model's {layers} "
                          "layers")
    if job.task == "lora" and not knobs.lora_targets and not knobs.blr_method:   # check_blr says it for a BLR model
        raise MemfitError(f"{field_flag('lora_targets')} names no module: LoRA would train nothing (peft refuses it)")
    if knobs.four_bit and job.task == "full":
        raise MemfitError(f"{field_flag('four_bit')} freezes the base weights: it goes with task lora or infer")
    if knobs.attention == "memfit" and (window := job.spec.sliding_window) is not None and job.seq > window:
        raise MemfitError(f"{field_flag('attention')} memfit has no sliding window: {job.spec.name} attends over the "
                          f"last {window} keys and {field_flag('seq')} {job.seq} passes them; use attention sdpa")
    if knobs.generator == "memfit":
        check_memfit_loop(job, knobs)
    if knobs.fused_swiglu and not job.spec.silu_mlp:
        raise MemfitError(f"{field_flag('fused_swiglu')} computes silu(gate) * up; {job.spec.name}'s MLP activation is "
                          f"{job.spec.activation!r}")
    if (knobs.partial_load, knobs.partial_compute) != (1.0, 1.0) and not ffn_partial_layers(job.spec):
        from memfit.infer.partial_load import PartialConfig

        whole = PartialConfig()
        raise MemfitError(f"{field_flag('partial_load')} and {field_flag('partial_compute')} do nothing for "
                          f"{job.spec.name}: partial loading keeps the first {whole.full_first} and last "
                          f"{whole.full_last} layers whole, and it has {layers}")


def check_memfit_loop(job: Job, knobs: Knobs) -> None:
    """Refuse what memfit's decode loop does not run, as ``Generator`` would refuse it: memfit's training attention
    (the loop runs SDPA for the prompt and its own kernel for each token), and a job past the model's positions or
    its sliding window (``memfit.infer.generate.check_decode_length``: the loop attends over every earlier key), and
    a 4-bit base, which ``memfit generate``'s loader does not load."""
    if knobs.four_bit:
        raise MemfitError(f"{field_flag('generator')} memfit runs models memfit's loader reads, and it loads no 4-bit "
                          f"base: drop {field_flag('four_bit')} or use generator hf")
    if knobs.attention != "sdpa":
        raise MemfitError(f"{field_flag('generator')} memfit runs its own attention (SDPA over the prompt, memfit's "
                          f"decode kernel for each new token): {field_flag('attention')} {knobs.attention} is for "
                          "transformers' forward")
    from memfit.infer.generate import decode_length_problem

    if problem := decode_length_problem(job.positions, job.spec.max_position, job.spec.sliding_window):
        raise MemfitError(f"{field_flag('generator')} memfit, {job.spec.name}: {problem} (or use generator hf)")


def check_device(job: Job, knobs: Knobs) -> None:
    """Refuse on the CPU what runs on CUDA only. The ledger models each as it runs there, so a CPU job's ledger would
    describe a run that cannot happen (the planner proposes none of them on the CPU; memfit verify runs none)."""
    if job.device == "cuda":
        return
    if knobs.four_bit:
        raise MemfitError(f"{field_flag('four_bit')}: the 4-bit NF4 base (bitsandbytes) runs on CUDA only; drop it "
                          "on cpu")
    if knobs.offload_layers and job.training:
        raise MemfitError(f"{field_flag('offload_layers')}: checkpoint inputs are offloaded from a GPU to pinned CPU "
                          "memory, which runs on CUDA only; drop it on cpu")
    if knobs.optimizer == "adamw8bit" and job.training:
        raise MemfitError(f"{field_flag('optimizer')} adamw8bit: 8-bit AdamW (bitsandbytes) runs on CUDA only; use "
                          "adamw on cpu")
    if knobs.attention == "memfit":
        raise MemfitError(f"{field_flag('attention')} memfit is modelled as its Triton kernel, which runs on CUDA only; "
                          "on cpu it falls back to a reference that holds the scores")


def check_blr(job: Job, knobs: Knobs) -> None:
    """Refuse what a block-low-rank model cannot run: partial FFN loading (it selects rows of dense FFN weights) and
    LoRA adapters on its BLR layers (peft wraps nn.Linear layers only; the CLI's default targets the kept-dense
    ones)."""
    dense = blr_dense_kinds(job.spec, knobs)
    if dense is None:
        return
    if (knobs.partial_load, knobs.partial_compute) != (1.0, 1.0):
        raise MemfitError("partial FFN loading (--partial-load/--partial-compute) selects rows of dense FFN weights: "
                          "it does not apply to a block-low-rank model (--blr)")
    if job.task != "lora":
        return
    if wrapped := [t for t in knobs.lora_targets if t not in dense]:
        raise MemfitError(f"LoRA targets (--lora-targets) {','.join(wrapped)} are block-low-rank in this --blr model, "
                          f"and peft wraps nn.Linear layers only; the ones kept dense are {', '.join(dense) or 'none'}")
    if not knobs.lora_targets:
        raise MemfitError("LoRA on this --blr model has no target: --lora-targets names none, or every projection is "
                          "block-low-rank (the plan keeps none dense) and peft wraps nn.Linear layers only; plan "
                          "--task full or --task infer for it")


def structured_kinds(spec, knobs: Knobs) -> dict[str, tuple[int, dict[bool, tuple[int, int]], bool]]:
    """Projection kind -> (parameters per layer, {bias: (forward, backward) transient elements per token}, whether
    its input's gradient is a view) of the block-low-rank model, or {} (the graph knows which projections have a
    bias). Low-rank's input gradient is a 3-D matrix product's reshape, a view, as a linear's; Monarch's and BLAST's
    are their ops' own tensors, into which autograd adds a second gradient in place (read off torch.profiler's add
    and add_ on the CPU, reference and interpreter paths)."""
    if knobs.blr_method is None:
        return {}
    from memfit.compress.plan import plan_kinds

    plans = plan_kinds(spec.linear_shapes(), knobs.blr_method, knobs.blr_ratio, knobs.blr_blocks)
    return {kind: (p.params, {bias: blr_transient_per_token(knobs.blr_method, p.rank, knobs.blr_blocks, p.in_features,
                                                            p.out_features, bias) for bias in (False, True)},
                   knobs.blr_method == "lowrank")
            for kind, p in plans.items() if p.rank is not None}


def blr_transient_per_token(method: str, rank: int, blocks: int, in_features: int, out_features: int,
                            bias: bool = False) -> tuple[int, int]:
    """Elements per token a block-low-rank op holds besides its input, output and gradients: (forward, backward).

    Forward, for its most demanding pipeline: the PyTorch reference, which runs where Triton does not and which
    the Monarch and BLAST picks may take (low-rank's GPU pipelines hold z alone). Low-rank holds z (r), or with a
    bias the larger of z and the product before the bias is added (out); Monarch z (b r) and either its P^T copy
    or the output before its layout copy; BLAST z and T (b r each) and the output before its layout copy.
    Backward, on every device the reference recomputed under autograd (recompute.recompute_backward): its
    intermediates and their gradients, or an input-sized copy (a transposed input gradient; x itself where the
    weights are frozen, an expanded zero the reference's reshape or matmul materialises) beside the output's
    gradient. Measured on CPU by tests/test_ledger.py (each bound holds at its shapes and is reached within 20% at
    one of them)."""
    if method == "lowrank":
        return max(rank, out_features) if bias else rank, rank + out_features + in_features
    zr = blocks * rank
    if method == "monarch":
        return zr + max(zr, out_features), max(2 * zr, in_features) + out_features
    return 2 * zr + out_features, max(3 * zr, in_features) + out_features


def ffn_partial_layers(spec) -> range:
    """The layers partial FFN loading makes partial (memfit.infer's default: the first and last layers stay whole)."""
    from memfit.infer.partial_load import PartialConfig

    return PartialConfig().partial_layers(spec.num_layers)


def ffn_widths(spec, knobs: Knobs) -> list[int]:
    """FFN neurons resident per layer under partial loading (memfit.infer's own counting rule)."""
    from memfit.infer.partial_load import PartialConfig

    config = PartialConfig(load=knobs.partial_load, compute=knobs.partial_compute)
    middle = ffn_partial_layers(spec)
    loaded = config.counts(spec.intermediate)[2]
    return [loaded if layer in middle else spec.intermediate for layer in range(spec.num_layers)]


def _loop_prefill_masked(job: Job, knobs: Knobs) -> bool:
    """Whether memfit's decode loop prefills this job's prompts (unpadded, as verify's are) under an additive mask:
    where SDPA has no fused kernel for the model (``graph.sdpa_fused_kernel``; the loop asks torch at run time,
    ``memfit.infer.generate.mask_free_causal_kernel``)."""
    return not sdpa_fused_kernel(job.spec, knobs.dtype, job.device)


def loop_prefill_chunk(job: Job, knobs: Knobs) -> tuple[int, int, bool]:
    """(queries a chunk, chunks, masked) of memfit's loop's prefill of this job's prompts, by the loop's own rule
    (``memfit.infer.generate.prefill_chunk_queries``)."""
    from memfit.infer import generate as loop

    s, size = job.spec, dtype_bytes(knobs.dtype)
    masked = _loop_prefill_masked(job, knobs)
    keys = loop.cache_slots(job.seq)                   # a masked chunk's keys: the last one's, the most
    row = loop.query_row_bytes(s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate, size)
    chunk = min(job.seq, loop.prefill_chunk_queries(job.batch, keys, masked, row, s.num_heads // s.num_kv_heads, size))
    return chunk, -(-job.seq // chunk), masked


def _loop_fused_layout(job: Job, knobs: Knobs, structured: dict) -> tuple[bool, list[bool]]:
    """Which of the loop's matmuls run in the loader's fused layout (``memfit.infer.fused``): q/k/v where all three
    are plain linears; per layer gate/up where both are plain, bias-free and SiLU-gated, or where the layer is a
    partial-FFN one (``PartialMLP``, always interleaved). 4-bit and block-low-rank layers are called as modules."""
    spec = job.spec

    def plain(names) -> bool:
        return not knobs.four_bit and not any(name in structured for name in names)

    dense_mlp = plain(("gate_proj", "up_proj")) and spec.silu_mlp and not {"gate_proj", "up_proj"} & set(
        spec.biased_projections())
    partial = ffn_partial_layers(spec) if (knobs.partial_load, knobs.partial_compute) != (1.0, 1.0) else range(0)
    return plain(("q_proj", "k_proj", "v_proj")), [dense_mlp or layer in partial for layer in range(spec.num_layers)]


def _predict_memfit_loop(job: Job, knobs: Knobs) -> Ledger:
    """memfit's decode loop (``memfit generate``: memfit.infer.generate.Generator). Its KV cache is allocated whole,
    ``seq + new_tokens`` slots rounded up to the loop's key alignment, before the prompt runs; the prompt runs in
    chunks of queries, each writing its K/V into that cache in place, so the prefill peaks in a chunk's forward
    (``ModelGraph.loop_prefill_chunk``: the loop's ops and lifetimes, in the loader's fused layout where ``memfit
    generate`` runs it) over the cache: the first chunk's (the largest) and, on the CPU, the later chunks whose
    attention builds the largest causal masks (:func:`_loop_chunk_cases`); where the prefill is masked, over the
    chunk's (B, 1, G x T, keys) additive mask too. A decode step holds one token's activations and its logits beside
    the cache: below the prefill's peak at any prompt."""
    from memfit.infer.generate import cache_slots

    spec = job.spec
    size = dtype_bytes(knobs.dtype)
    workspace = CUBLAS_WORKSPACE if job.device == "cuda" else 0
    chunk, chunks, masked = loop_prefill_chunk(job, knobs)
    structured = structured_kinds(spec, knobs)
    fused = _loop_fused_layout(job, knobs, structured)
    slots = cache_slots(job.positions)
    # K and V of every layer, and the loop's bookkeeping: a bool per slot and row, the slot indices, the tokens out
    kv_cache = 2 * spec.num_layers * job.batch * spec.kv_dim * slots * size + job.batch * slots + 8 * slots \
        + 8 * job.batch * job.positions
    keys = cache_slots(job.seq)                       # a masked chunk's keys, rounded up: the last one's the most
    mask = job.batch * (spec.num_heads // spec.num_kv_heads) * chunk * keys * size if masked else 0
    prompt = job.batch * job.seq * 9                  # the whole prompt's positions (int64) and padding mask (bool)
    prefill, where, weights = None, "", 0
    for index, queries, attention_workspace in _loop_chunk_cases(job, knobs, chunk, chunks, masked):
        graph = ModelGraph(spec, job.batch, queries, knobs.dtype, None, job.device, four_bit=knobs.four_bit,
                           ffn_widths=ffn_widths(spec, knobs), structured=structured)
        logits = graph.loop_prefill_chunk(*fused, attention_workspace=attention_workspace)
        weights, _ = _persistent(graph)
        memory = Memory({"weights": weights, "workspace": workspace, "kv_cache": kv_cache,
                         "temporaries": mask + prompt})
        replay_forward(graph.ops, memory, "prefill", keep={logits.uid}, save=False)
        event = memory.phase_peaks["prefill"]
        if prefill is None or event.total > prefill.total:
            prefill = event
            where = (f"{event.where} (prefill chunk {index} of {chunks}, {queries} queries"
                     f"{', masked' if masked else ''})")
    decode = {"weights": weights, "workspace": workspace, "kv_cache": kv_cache,
              "logits": job.batch * spec.vocab * size}
    phases = {"prefill": prefill.total, "decode": sum(decode.values())}
    peak, phase = (decode, "decode") if phases["decode"] > prefill.total else (prefill.live, "prefill")
    transient = sum(v for k, v in peak.items() if k != "weights")
    partial = (knobs.partial_load, knobs.partial_compute) != (1.0, 1.0)
    notes = [NO_PARTIAL_FFN] if partial else []
    if job.batch > 1:
        notes.append(_loop_padding_note())
    return Ledger(job, knobs, dict(peak), phase, where if phase == "prefill" else f"token {job.new_tokens}", phases,
                  _allocator_overhead(job, transient), CUDA_CONTEXT if job.device == "cuda" else 0, 0, notes)


def _loop_chunk_cases(job: Job, knobs: Knobs, chunk: int, chunks: int, masked: bool) -> list[tuple[int, int, int]]:
    """(chunk number, queries, bytes each layer's attention allocates and frees) of the prefill chunks whose peak may
    be the prefill's. On CUDA one chunk: the first, the largest (its attention allocates nothing that grows with the
    keys), or where the prefill is masked the last full one, whose mask (which the caller counts, at the prompt's
    keys) is the largest. On the CPU also the last full chunk and a shorter last one, whose attention builds the
    largest causal masks (``generate.cpu_causal_mask_bytes``: none for the first, whose queries are all its keys),
    each with torch's flash-attention scratch (:func:`_cpu_flash_scratch`)."""
    from memfit.infer.generate import cpu_causal_mask_bytes

    full = job.seq // chunk                             # chunks of ``chunk`` queries; the last may be shorter
    if job.device == "cuda":
        return [(full if masked else 1, chunk, 0)]
    spans = [(1, chunk, chunk)] + ([(full, chunk, full * chunk)] if full > 1 else [])
    if chunks > 1 and job.seq % chunk:
        spans.append((chunks, job.seq % chunk, job.seq))
    size = dtype_bytes(knobs.dtype)
    spec = job.spec
    return [(index, queries, cpu_causal_mask_bytes(queries, keys, size)
             + _cpu_flash_scratch(job.batch, spec.num_heads, spec.num_kv_heads, queries, keys, spec.head_dim,
                                  knobs.dtype, causal=queries == keys))
            for index, queries, keys in spans]


def _cpu_flash_scratch(batch: int, heads: int, kv_heads: int, queries: int, keys: int, head_dim: int, dtype: str,
                       causal: bool) -> int:
    """Bytes torch's CPU flash attention allocates for a call (``cpu_flash_attention`` in ATen's
    FlashAttentionKernel.cpp), beside its output and log-sum-exp: per thread, a float32 (query split x key split)
    score block, two query-split vectors and a (query split x head_dim) accumulator, and for 16-bit inputs the score
    block again in their dtype; the query split is 256, 64 or 32 queries by the call's count (at least 768, 192, or
    fewer), the key split 512, each at most what the call has. Per thread of this process (``torch.get_num_threads``):
    a CPU job is planned on the machine that runs it.

    Where the CPU's matrix unit takes the dtype (AMX: bfloat16 on its tile unit, float16 where it has AMX-FP16) and
    the call is large enough (:func:`_cpu_attention_packs`), torch also packs K and V for it: a copy of each
    ``(batch, kv_heads, keys, head_dim)``, the head dim (keys) padded to even for K (V), and a per-thread transpose
    buffer of (key split x head_dim): by this rule 1.56 of the 1.98 MB a 4-KV-head chunk of 244 queries over 2928 keys
    takes in bfloat16 at 2 threads (the first case of tests/test_ledger_memfit_loop.py's check, which holds the rule
    to the bytes torch's call allocates on the CPU it runs on). The rules are ATen's as of torch 2.13; older torch
    packed by other rules, into buffers its allocator did not see."""
    import torch

    itemsize = dtype_bytes(dtype)
    q, kv = min(_cpu_flash_query_split(queries), queries), min(512, keys)
    threads = torch.get_num_threads()
    pack = _cpu_attention_packs(batch, heads, kv_heads, queries, keys, head_dim, dtype, causal, q, threads)
    even_kv = kv + kv % 2 if pack else kv
    per_thread = 4 * (q * kv + 2 * q + q * head_dim) + (q * even_kv * itemsize if itemsize == 2 else 0)
    if not pack:
        return threads * per_thread
    even_head = head_dim + head_dim % 2
    tail = (keys - 1) % kv + 1
    padded_keys = (keys - 1) // kv * even_kv + tail + tail % 2
    packed = batch * kv_heads * (even_head * keys + padded_keys * head_dim) * itemsize
    per_thread += kv * head_dim * itemsize + (q * even_head * itemsize if head_dim % 2 else 0)
    return threads * per_thread + packed


def _cpu_flash_query_split(queries: int) -> int:
    """The queries torch's CPU flash attention takes at a time, by the call's count."""
    return 256 if queries >= 768 else 64 if queries >= 192 else 32


def _cpu_attention_packs(batch: int, heads: int, kv_heads: int, queries: int, keys: int, head_dim: int, dtype: str,
                         causal: bool, query_split: int, threads: int) -> bool:
    """Whether torch's CPU flash attention packs K and V for the CPU's matrix unit (its ``need_pack``): a 16-bit
    dtype the unit takes, at least 64 (bfloat16) or 16 (float16) queries and keys, and per thread at least 4
    (bfloat16) or 1 (float16) times as many multiply-adds as the pack copies elements."""
    import torch

    takes = {"bfloat16": "_is_amx_tile_supported", "float16": "_is_amx_fp16_supported"}.get(dtype)
    if takes is None or not getattr(torch.cpu, takes, lambda: False)():
        return False
    least, ratio = (64, 4) if dtype == "bfloat16" else (16, 1)
    if queries < least or keys < least:
        return False
    slices = -(-queries // query_split)
    per_thread = -(-(batch * heads * slices) // threads) * query_split * (min(queries, keys) if causal else keys) * head_dim
    return per_thread >= ratio * batch * kv_heads * keys * head_dim


def _predict_infer(job: Job, knobs: Knobs) -> Ledger:
    spec = job.spec
    workspace = CUBLAS_WORKSPACE if job.device == "cuda" else 0
    graph = ModelGraph(spec, job.batch, job.seq, knobs.dtype, None, job.device, four_bit=knobs.four_bit,
                       attention=knobs.attention, ffn_widths=ffn_widths(spec, knobs),
                       structured=structured_kinds(spec, knobs))
    cache: list = []
    x, embedding = graph.embed()
    for layer in range(spec.num_layers):
        x = graph.decoder_layer(x, layer, cache)
    logits = graph.head(x, embedding, logits_tokens=1)
    weights, _ = _persistent(graph)
    memory = Memory({"weights": weights, "workspace": workspace})
    replay_forward(graph.ops, memory, "prefill", keep={logits.uid} | {c.uid for c in cache}, save=False)
    phases = {"prefill": memory.phase_peaks["prefill"].total}
    # Decode: the cache grows to seq + new_tokens; each step's torch.cat holds one layer's old
    # and new key (or value) cache at once. One token's activations are negligible beside it.
    layer_kv = job.batch * spec.kv_dim * dtype_bytes(knobs.dtype)  # bytes per token, per layer, for K (or V)
    final = job.positions
    logits_bytes = job.batch * spec.vocab * dtype_bytes(knobs.dtype)
    decode = {"weights": weights, "workspace": workspace, "kv_cache": 2 * spec.num_layers * layer_kv * final,
              "temporaries": layer_kv * final, "logits": logits_bytes}
    phases["decode"] = sum(decode.values())
    prefill_peak = memory.phase_peaks["prefill"]
    if phases["decode"] > prefill_peak.total:
        peak, phase, where = decode, "decode", f"token {job.new_tokens}"
    else:
        peak, phase, where = prefill_peak.live, "prefill", prefill_peak.where
    transient = sum(v for k, v in peak.items() if k not in ("weights",))
    partial = (knobs.partial_load, knobs.partial_compute) != (1.0, 1.0)
    return Ledger(job, knobs, dict(peak), phase, where, phases, _allocator_overhead(job, transient),
                  CUDA_CONTEXT if job.device == "cuda" else 0, 0, [NO_PARTIAL_FFN] if partial else [])
