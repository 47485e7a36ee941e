"""One call that makes a Hugging Face Llama/Qwen2/Mistral model train in less memory.

``patch(model, checkpoint="layer", offload_layers="all", fused_ce=True, four_bit=True,
lora={"r": 16})`` applies, in this order:

1. **4-bit base** (``four_bit``): decoder linears become frozen bitsandbytes NF4 layers.
2. **checkpoints** (``checkpoint``/``offload_layers``/``offload_to``): every decoder
   layer's forward is wrapped (module names unchanged) by :mod:`memfit.train.checkpoint`.
3. **fused loss** (``fused_ce``): the ``*ForCausalLM`` forward, when given ``labels``,
   calls ``linear_cross_entropy`` on the final hidden states (labels shifted exactly as
   transformers does), so the tokens x vocabulary logits are never built and tokens
   without a loss are dropped before the output matmul. ``vocab_subset`` makes the
   softmax approximate (opt-in). Without labels the model returns logits as usual.
4. **fused SwiGLU** (``fused_swiglu``): every layer's gated MLP computes ``silu(gate) * up`` by
   :mod:`memfit.kernels.swiglu`, which keeps gate and up only and writes their gradients over them
   (the unfused pair keeps three intermediate-sized tensors and its backward allocates three more).
5. **LoRA** (``lora``): ``peft.get_peft_model`` (a LoraConfig, or a dict of its fields;
   default r=16, alpha=32, no dropout, all seven linears of each layer).
6. **attention** (``attention``): the transformers attention implementation every layer
   uses, ``"sdpa"`` (default) or ``"memfit"`` (:mod:`memfit.train.attention_hf`, O(N)
   memory in fp16, bf16 and fp32, the dtypes its kernels take). memfit matters for fp32 training: torch SDPA (2.11, CUDA) ran
   fp32 grouped-query attention on its math kernel, which materialises the scores,
   heads x N^2 x 4 bytes per layer (6.4 GB at 8K tokens with Llama-3.2-3B's 24 heads).

The returned model is the one to train (a ``PeftModel`` when LoRA is on). The switches
that act per call (checkpoint policy, fused loss, vocabulary subset, fused SwiGLU) live in a
:class:`PatchState` reachable with :func:`patch_state` and can be changed later, which is
how a planner's plan or a benchmark moves between technique sets on one model.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memfit.errors import MemfitError, is_count
from memfit.models.spec import PROJECTIONS
from memfit.train.checkpoint import CheckpointPolicy, OffloadRunner, install

SUPPORTED = ("llama", "qwen2", "mistral")
LORA_TARGETS = PROJECTIONS
LORA_DEFAULTS = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": list(LORA_TARGETS), "bias": "none",
                 "task_type": "CAUSAL_LM"}
IGNORE_INDEX = -100
ATTENTION = ("sdpa", "memfit")


@dataclass
class PatchState:
    """Per-call switches of a patched model (mutable: a plan or a benchmark may change them)."""

    runner: OffloadRunner
    fused_ce: bool = True
    vocab_subset: torch.Tensor | None = None
    ce_path: str | None = None
    four_bit: bool = False
    attention: str = "sdpa"
    fused_swiglu: bool = False

    @property
    def policy(self) -> CheckpointPolicy:
        return self.runner.policy

    @policy.setter
    def policy(self, policy: CheckpointPolicy) -> None:
        if len(policy.places) != len(self.runner.policy.places):
            raise MemfitError(f"policy has {len(policy.places)} places for {len(self.runner.policy.places)} layers")
        self.runner.policy = policy


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` inside ``model`` (itself, or the base of a PeftModel)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in SUPPORTED or not hasattr(getattr(base, "model", None), "layers"):
        raise MemfitError(f"memfit.patch supports Hugging Face {', '.join(SUPPORTED)} causal LMs; got "
                          f"{type(base).__name__} (model_type {model_type!r})")
    return base


def patch_state(model: torch.nn.Module) -> PatchState:
    state = getattr(causal_lm_of(model), "_memfit_patch", None)
    if state is None:
        raise MemfitError("this model has not been patched: call memfit.train.patch.patch(model, ...) first")
    return state


def lora_config(lora):
    """A peft LoraConfig from a LoraConfig or a dict of its fields (memfit's defaults filled in)."""
    from peft import LoraConfig

    if isinstance(lora, LoraConfig):
        return lora
    if not isinstance(lora, dict):
        raise MemfitError(f"lora must be a peft LoraConfig, a dict of its fields or None; got {type(lora).__name__}")
    fields = {**LORA_DEFAULTS, **lora}
    if "lora_alpha" not in lora and "r" in lora:
        fields["lora_alpha"] = 2 * lora["r"]
    rank, alpha = fields.get("r"), fields.get("lora_alpha")
    if not is_count(rank):
        raise MemfitError(f"LoRA rank r (--lora-r) must be a positive integer, got {rank!r}")
    if alpha is not None and (not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0):
        raise MemfitError(f"lora_alpha (--lora-alpha) must be a positive number, got {alpha!r}")
    try:
        return LoraConfig(**fields)
    except (TypeError, ValueError) as err:
        raise MemfitError(f"bad LoRA settings {lora}: {err}") from None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Token t predicts label t+1; the last position predicts nothing (as transformers shifts)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _fused_forward(original):
    """A ``*ForCausalLM.forward`` that computes the loss from hidden states when labels are given."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None,
                logits_to_keep=0, **kwargs):
        state: PatchState = self._memfit_patch
        if labels is not None:       # a training step fills no KV cache (a checkpointed layer refuses one)
            kwargs.setdefault("use_cache", False)
        if labels is None or not state.fused_ce:
            return original(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                            logits_to_keep=logits_to_keep, **({"num_items_in_batch": num_items_in_batch}
                                                              if num_items_in_batch is not None else {}), **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from memfit.kernels.linear_ce import linear_cross_entropy

        targets = kwargs.pop("shift_labels", None)
        targets = shift_labels(labels) if targets is None else targets
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = outputs.last_hidden_state
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if weight.requires_grad:  # a trained head's float32 master weights, read here, not called: cast as its forward is
            weight, bias = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
        loss = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).to(hidden.device),
            ignore_index=IGNORE_INDEX, reduction="mean" if num_items_in_batch is None else "sum",
            bias=bias, vocab_subset=state.vocab_subset, path=state.ce_path,
        )
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)

    return forward


def _swiglu_mlp_forward(self, x):
    """A gated MLP's forward that, while its patch's ``fused_swiglu`` is on, computes its product by
    :func:`memfit.kernels.swiglu.swiglu` (the projections are called as they are, LoRA-wrapped or 4-bit); otherwise
    the class's own forward. What it reads lives on the module, so a copy of the model runs its own."""
    if not self._memfit_swiglu_state.fused_swiglu:
        return type(self).forward(self, x)
    _check_silu(self, self._memfit_swiglu_silu)
    from memfit.kernels.swiglu import swiglu

    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _install_swiglu(base: torch.nn.Module, state: PatchState) -> None:
    """Every decoder layer's MLP computes ``silu(gate) * up`` by memfit's kernel while ``state.fused_swiglu`` is on;
    refused for a model whose MLP activation is not SiLU (the kernel computes SiLU)."""
    from memfit.infer.fused import silu_activation

    for layer in base.model.layers:
        mlp = layer.mlp
        mlp._memfit_swiglu_state, mlp._memfit_swiglu_silu = state, silu_activation(mlp)
        mlp.forward = types.MethodType(_swiglu_mlp_forward, mlp)


def _check_silu(mlp: torch.nn.Module, silu: bool) -> None:
    """Refuse the fused SwiGLU for an MLP whose activation is not SiLU (``silu``: read once, at patch time)."""
    if not silu:
        raise MemfitError(f"fused_swiglu computes silu(gate) * up; this model's MLP activation is "
                          f"{getattr(mlp, 'act_fn', None)!r}")


def _check_lora_targets(base: torch.nn.Module, config) -> None:
    """Refuse LoRA targets that name no module of ``base``, as peft would after the rest of the patch (by peft's
    own matching: names by suffix, a string as a regular expression; peft's defaults and "all-linear" pass)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = config.target_modules
    if targets is None or targets == "all-linear":
        return
    if not any(check_target_module_exists(config, name) for name, _ in base.named_modules()):
        linears = sorted({name.rsplit(".", 1)[-1] for name, module in base.named_modules()
                          if isinstance(module, torch.nn.Linear)})
        asked = repr(targets) if isinstance(targets, str) else ", ".join(sorted(targets))   # peft keeps a set
        raise MemfitError(f"LoRA target_modules {asked} match no module of this model; its linear layers are "
                          f"named {', '.join(linears)}")


def _check_patch(base: torch.nn.Module, attention: str, fused_swiglu: bool, ce_path: str | None, lora) -> object:
    """Every refusal of :func:`patch` that needs no change to the model, before it changes any: a LoRA setting peft
    refused had left the model patched, so that the corrected call was told it already was. Returns the LoRA
    config (None without LoRA). A ``ce_path`` that is not a kernel path had been refused only at the first forward."""
    from memfit.infer.fused import silu_activation
    from memfit.kernels.dispatch import kernel_mode

    if ce_path is not None:
        kernel_mode("linear_ce", ce_path)
    if attention not in ATTENTION:
        raise MemfitError(f"attention={attention!r} is not one of {', '.join(ATTENTION)}")
    if fused_swiglu:
        for layer in base.model.layers:
            _check_silu(layer.mlp, silu_activation(layer.mlp))
    if lora is None:
        return None
    config = lora_config(lora)
    _check_lora_targets(base, config)
    return config


def _set_attention(base: torch.nn.Module, attention: str) -> None:
    if attention == "memfit":
        from memfit.train.attention_hf import register

        attention = register()
    base.set_attn_implementation(attention)


def patch(model: torch.nn.Module, *, checkpoint: str = "none", offload_layers="none", offload_to: str = "cpu",
          prefetch: int = 1, fused_ce: bool = True, four_bit: bool = False, lora=None,
          vocab_subset: torch.Tensor | None = None, ce_path: str | None = None,
          attention: str = "sdpa", fused_swiglu: bool = False) -> torch.nn.Module:
    """Patch a HF Llama/Qwen2/Mistral ``*ForCausalLM`` for memory-lean training; return the model to train."""
    base = causal_lm_of(model)
    if getattr(base, "_memfit_patch", None) is not None:
        raise MemfitError("this model is already patched; change its switches through patch_state(model)")
    if lora is not None and base is not model:
        raise MemfitError("the model already carries peft adapters: pass lora=None to keep them")
    config = _check_patch(base, attention, fused_swiglu, ce_path, lora)
    layers = base.model.layers
    policy = CheckpointPolicy.build(len(layers), checkpoint, offload_layers, offload_to, prefetch)
    _set_attention(base, attention)
    if four_bit:
        from memfit.train.four_bit import quantize_layers_4bit

        quantize_layers_4bit(layers, next(p.dtype for p in base.parameters() if p.is_floating_point()))
        base.is_loaded_in_4bit = True  # tells peft to wrap the NF4 layers with its 4-bit LoRA layer
    runner = install(layers, policy)
    base._memfit_patch = PatchState(runner, fused_ce=fused_ce, vocab_subset=vocab_subset, ce_path=ce_path,
                                    four_bit=four_bit, attention=attention, fused_swiglu=fused_swiglu)
    _install_swiglu(base, base._memfit_patch)
    base.forward = types.MethodType(_fused_forward(base.forward), base)
    if config is None:
        return model
    from memfit.models.hf_calls import peft_model

    return peft_model(base, config)
