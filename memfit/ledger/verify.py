"""Verify: run the job with the plan applied, measure its peak, hold it against the ledger.

A prediction nobody checks is a guess. ``verify`` builds a random-init model of the
job's shape with the knobs applied (dtype, block-low-rank layers of the planned ranks, LoRA
through peft, checkpointing of the first k decoder layers, the optimizer, micro-batches),
runs warm-up steps so lazily created state exists (optimizer states, cuBLAS workspace, the
BLR kernels' variant picks, whose timing copies are freed before the measured step), then
measures one step: on CUDA with the caching allocator's peak counters, on CPU with the
allocator's events read off ``torch.profiler`` (``memfit.measure.memory``).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memfit.errors import MemfitError
from memfit.ledger.job import Job, Knobs, field_flag
from memfit.ledger.predict import NO_PARTIAL_FFN, Ledger, check_device, check_knobs_fit_job, predict
from memfit.local import use_expandable_segments
from memfit.measure.memory import PeakMeter, storage_bytes
from memfit.models.build import build_model
from memfit.models.hf_calls import cache_keyword, enable_checkpointing, peft_model
from memfit.models.spec import dtype_of
from memfit.units import format_bytes


@dataclass
class Measurement:
    peak: int  # max allocated bytes over the measured step
    reserved: int  # max reserved (CUDA) bytes
    weights: int
    optimizer: int
    gradients: int


@dataclass
class VerifyResult:
    ledger: Ledger
    measured: Measurement
    tolerance: float

    @property
    def error(self) -> float:
        """Relative error of the predicted total peak."""
        return self.ledger.total / self.measured.peak - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.tolerance

    def __str__(self) -> str:
        """One line (the dataclass's repr is every field of the ledger and the job)."""
        verdict = "within" if self.ok else "beyond"
        return (f"{self.ledger.job.spec.name} {self.ledger.job.task}: predicted {format_bytes(self.ledger.total)}, "
                f"measured {format_bytes(self.measured.peak)}, {100 * self.error:+.2f}% ({verdict} the "
                f"{100 * self.tolerance:.4g}% tolerance)")

    def rows(self) -> list[tuple[str, int, int | None]]:
        """(component, predicted bytes at the peak, measured bytes where measurable)."""
        led, m = self.ledger, self.measured
        measurable = {"weights": m.weights, "optimizer": m.optimizer}
        rows = [(c, v, measurable.get(c)) for c, v in led.peak.items() if v]
        rows.append(("total peak", led.total, m.peak))
        return rows

    def to_dict(self) -> dict:
        m = self.measured
        return {**self.ledger.to_dict(), "measured": {"peak_bytes": m.peak, "reserved_bytes": m.reserved,
                                                      "weights": m.weights, "optimizer": m.optimizer,
                                                      "gradients": m.gradients},
                "relative_error": self.error, "tolerance": self.tolerance, "ok": self.ok}   # "error" means failure


def _prepare(job: Job, knobs: Knobs):
    attention = "sdpa"
    if knobs.attention == "memfit":
        from memfit.train.attention_hf import register

        attention = register()
    # a 4-bit base is built on the CPU and quantized on its way to the GPU, as memfit finetune loads one
    model = build_model(job.spec, dtype=knobs.dtype, device="cpu" if knobs.four_bit else job.device,
                        attn_implementation=attention)
    if knobs.blr_method:                               # random-init BLR layers: memory depends on shapes only
        from memfit.compress.convert import structure_model

        structure_model(model, knobs.blr_method, knobs.blr_ratio, knobs.blr_blocks)
    if knobs.four_bit:                                 # inference's too: the ledger predicts its NF4 weights
        from memfit.train.four_bit import to_device_4bit

        model = to_device_4bit(model, job.device, dtype_of(knobs.dtype))
    if job.training and knobs.patched:
        return _patched(job, knobs, model)
    if job.task == "lora":
        from peft import LoraConfig

        model = peft_model(model, LoraConfig(r=knobs.lora_rank, lora_alpha=2 * knobs.lora_rank, lora_dropout=0.0,
                                             target_modules=list(knobs.lora_targets)))
    if job.training and knobs.checkpoint_layers:
        enable_checkpointing(model)
        for index, layer in enumerate(model.get_decoder().layers):
            layer.gradient_checkpointing = index < knobs.checkpoint_layers
    model.train(job.training)
    return model




def _ledgers_allocator(job: Job) -> None:
    """For a CUDA job, the allocator the ledger's overhead assumes (a library caller's too), set before anything
    starts CUDA: check_runnable's bitsandbytes import reads the GPU's capability."""
    if job.device == "cuda":
        use_expandable_segments()


def _check_warmup(warmup) -> None:
    """Unmeasured steps first, at least one: optimizer state appears at the first step (0 measured it appearing)."""
    if not isinstance(warmup, numbers.Integral) or isinstance(warmup, bool) or warmup < 1:
        raise MemfitError(f"{field_flag('warmup')} must be an integer of at least 1 (optimizer state appears at "
                          f"the first step), got {warmup!r}")


def check_runnable(job: Job, knobs: Knobs) -> None:
    """Refuse, before any work, what no machine can run and what this one cannot."""
    check_knobs_fit_job(job, knobs)
    if job.device == "cuda" and not torch.cuda.is_available():
        raise MemfitError(f"verify on cuda needs a CUDA GPU; a job with {field_flag('device')} cpu runs here")
    check_device(job, knobs)
    if (knobs.partial_load, knobs.partial_compute) != (1.0, 1.0):
        raise MemfitError(NO_PARTIAL_FFN)
    if job.training and knobs.optimizer == "adamw8bit":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise MemfitError("8-bit AdamW needs bitsandbytes: pip install 'memfit[bnb]'") from None


def _patched(job: Job, knobs: Knobs, model):
    """The techniques of memfit.train.patch: fused loss, 4-bit base, checkpoints offloaded to CPU, fused SwiGLU."""
    from memfit.train.checkpoint import CheckpointPolicy
    from memfit.train.patch import patch, patch_state

    lora = {"r": knobs.lora_rank, "target_modules": list(knobs.lora_targets)} if job.task == "lora" else None
    model = patch(model, checkpoint="layer" if knobs.checkpoint_layers else "none", fused_ce=knobs.fused_ce,
                  four_bit=knobs.four_bit, lora=lora, attention=knobs.attention, fused_swiglu=knobs.fused_swiglu)
    if knobs.checkpoint_layers:
        patch_state(model).policy = CheckpointPolicy.first_layers(job.spec.num_layers, knobs.checkpoint_layers,
                                                                  knobs.offload_layers)
    return model.train()


def make_optimizer(name: str, params):
    """The optimizer a ledger knob names (adamw, sgd, adamw8bit: bitsandbytes), as verify and benchmarks run it."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-5)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-5)
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=1e-5)


def measure(job: Job, knobs: Knobs, warmup: int = 1, progress: Callable[[str], None] | None = None) -> Measurement:
    """Run ``warmup`` steps, then measure one step of ``job`` with ``knobs``; ``progress(phase)`` is told each phase
    as it starts (the model's build, each warm-up step, the measured step: seconds each on a CPU)."""
    say = progress or (lambda phase: None)
    _check_warmup(warmup)
    _ledgers_allocator(job)
    check_runnable(job, knobs)
    say("building the random-init model")
    model = _prepare(job, knobs)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, job.spec.vocab, (job.batch, job.seq), generator=generator, device="cpu").to(job.device)
    if job.task == "infer":
        return _measure_infer(job, model, ids, warmup, say,
                              _memfit_loop_run if knobs.generator == "memfit" else _transformers_run)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(knobs.optimizer, params)
    micro = knobs.micro_batch or job.batch
    labels = ids.clone()
    labels[:, :job.seq - max(1, round(job.loss_fraction * job.seq))] = -100  # prompt tokens carry no loss
    gradients = 0

    def step():
        nonlocal gradients
        for start in range(0, job.batch, micro):
            chunk = ids[start:start + micro]
            loss = model(input_ids=chunk, labels=labels[start:start + micro], use_cache=False).loss   # training: no cache
            loss.backward()
            del loss
        gradients = storage_bytes(p.grad for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for done in range(warmup):
        say(f"warm-up step {done + 1}/{warmup}")
        step()
    states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    baseline = tuple(model.parameters()) + tuple(model.buffers()) + tuple(states)
    say("measured step")
    with PeakMeter(job.device, baseline) as meter:
        step()
    return Measurement(meter.peak, meter.reserved, storage_bytes(list(model.parameters()) + list(model.buffers())),
                       storage_bytes(states), gradients)


def _transformers_run(job: Job, model, ids) -> Callable[[], None]:
    """An inference run as the ledger's ``generator="hf"`` models it: transformers' forward over the prompt (logits
    for the last token), then ``new_tokens`` greedy steps, each growing its DynamicCache."""
    name = cache_keyword(model)

    def generate():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, token = getattr(out, name), out.logits[:, -1:].argmax(-1)
        del out
        for _ in range(job.new_tokens):
            out = model(input_ids=token, **{name: cache}, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            del out

    return generate


def _memfit_loop_run(job: Job, model, ids) -> Callable[[], None]:
    """An inference run as ``memfit generate`` makes it (``generator="memfit"``): the model in the loader's fused layout
    (``memfit.infer.fused.fuse_layout``), a Generator built for the job (its static cache and, on CUDA, its kernel
    picks and CUDA graph), then ``new_tokens`` greedy tokens after the prompt. Built anew each run, as the command
    builds one."""
    from memfit.infer.fused import fuse_layout
    from memfit.infer.generate import Generator

    fuse_layout(model)

    def generate():
        Generator(model, job.positions, batch=job.batch).generate(ids, job.new_tokens)

    return generate


@torch.no_grad()
def _measure_infer(job: Job, model, ids, warmup: int, say: Callable[[str], None],
                   runner: Callable[[Job, object, torch.Tensor], Callable[[], None]]) -> Measurement:
    generate = runner(job, model, ids)
    for done in range(warmup):
        say(f"warm-up step {done + 1}/{warmup}")
        generate()
    baseline = tuple(model.parameters()) + tuple(model.buffers())
    say("measured step")
    with PeakMeter(job.device, baseline) as meter:
        generate()
    return Measurement(meter.peak, meter.reserved, storage_bytes(baseline), 0, 0)


def verify(job: Job, knobs: Knobs, tolerance: float = 0.05, warmup: int = 1,
           progress: Callable[[str], None] | None = None) -> VerifyResult:
    """Predict, measure, compare. ``result.ok`` is False when the total is off by more than ``tolerance``;
    ``progress`` is :func:`measure`'s."""
    if not isinstance(tolerance, numbers.Real) or isinstance(tolerance, bool) or not 0 < tolerance < math.inf:
        raise MemfitError(f"{field_flag('tolerance')} must be a positive, finite fraction (0.05 is 5%), got "
                          f"{tolerance!r}")
    if tolerance >= 1:                                 # --tolerance 5 meant 5%, not 500%
        raise MemfitError(f"{field_flag('tolerance')} is a fraction (0.05 is 5%), below 1; got {tolerance!r}")
    _check_warmup(warmup)
    _ledgers_allocator(job)
    check_runnable(job, knobs)
    ledger = predict(job, knobs)
    return VerifyResult(ledger, measure(job, knobs, warmup, progress), tolerance)
