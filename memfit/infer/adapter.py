"""A LoRA adapter in peft's saved format (what ``memfit finetune`` writes to OUT/adapter) merged into a loaded model's
weights, so that generation runs the fine-tuned model through plain linear layers: W += scale B A with
scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), and the modules peft saved whole (``modules_to_save``: the
final norm under ``--train-norm``) copied in.

Ours rather than peft's ``merge_and_unload``: that needs peft's wrapper around Hugging Face's separate tensors, where
memfit's loader lays q/k/v and gate/up out in shared buffers; a merge into those views writes the buffers, so the fused
model keeps its layout. The arithmetic is peft's (tested against its merge)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from memfit.errors import MemfitError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."          # peft's prefix on every saved name
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def read_adapter_config(path: str | Path) -> dict:
    """``path``'s adapter_config.json, checked to be a plain LoRA adapter this merge reproduces (of the decoder layers
    and the final norm: no trained embeddings or output head, which tied models share; no DoRA, trained biases or
    per-module ranks); a one-line MemfitError otherwise. Reads no weight: a caller checks it first."""
    path = Path(path).expanduser()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise MemfitError(f"--adapter {path}: not a LoRA adapter directory (it needs {CONFIG_FILE} and {WEIGHTS_FILE}, "
                          "as memfit finetune writes to OUT/adapter)")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise MemfitError(f"--adapter {path}: {CONFIG_FILE} cannot be read ({err})") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or config["r"] < 1 \
            or not isinstance(config.get("lora_alpha"), (int, float)):
        raise MemfitError(f"--adapter {path}: {CONFIG_FILE} does not give a LoRA rank r and lora_alpha")
    heads = sorted({str(name).rsplit(".", 1)[-1] for name in (*_names(config.get("target_modules")),
                                                              *_names(config.get("modules_to_save")))}
                   & {"embed_tokens", "lm_head"})
    unsupported = [what for what, present in (
        (f"{' and '.join(heads)} trained (this merge takes the decoder layers and the final norm)", heads),
        (f"peft_type {config.get('peft_type')!r}", config.get("peft_type") != "LORA"),
        ("DoRA", config.get("use_dora")), (f"bias {config.get('bias')!r}", config.get("bias", "none") != "none"),
        ("per-module ranks or alphas", config.get("rank_pattern") or config.get("alpha_pattern")),
        ("fan_in_fan_out weights", config.get("fan_in_fan_out"))) if present]
    if unsupported:
        raise MemfitError(f"--adapter {path}: only plain LoRA adapters merge here, this one has "
                          f"{', '.join(unsupported)}")
    return config


def _names(value) -> list:
    """A config's module list (None, one name, or several) as a list."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Merge the adapter at ``path`` into ``model`` in place (:func:`read_adapter_config` first). Every saved tensor
    must name a weight of ``model`` of the right shape: an adapter trained on another model is a MemfitError naming
    the first that does not fit, raised before any weight changes. Each update is computed in fp32 on the weight's
    device and added in the weight's dtype, as peft merges (equal to its merge in fp32, within a rounding in 16-bit);
    one fp32 update of one weight is the merge's only transient memory."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    config = read_adapter_config(path)
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    params = dict(model.named_parameters())
    tensors = {key.removeprefix(KEY_PREFIX): value for key, value in load_file(str(path / WEIGHTS_FILE)).items()}
    merges = []                                        # (weight, LoRA (A, B) or the saved module's tensor)
    for name, value in tensors.items():
        if name.endswith(LORA_B):
            continue
        if name.endswith(LORA_A):
            target = name.removesuffix(LORA_A) + ".weight"
            pair = tensors.get(name.removesuffix(LORA_A) + LORA_B)
            if pair is None:
                raise MemfitError(f"--adapter {path}: {name} has no {LORA_B.lstrip('.')} beside it")
            shape, merge = (pair.shape[0], value.shape[1]), (value, pair)
        else:                                          # a module saved whole (modules_to_save)
            target, shape, merge = name, value.shape, value
        weight = params.get(target)
        if weight is None or weight.shape != shape:
            here = "absent" if weight is None else f"{tuple(weight.shape)}"
            raise MemfitError(f"--adapter {path}: it holds {target} as {tuple(shape)}, this model's is {here} "
                              "(an adapter of another model?)")
        merges.append((weight, merge))
    for weight, merge in merges:
        if isinstance(merge, tuple):
            a, b = (t.to(weight.device, torch.float32) for t in merge)
            weight.add_((scale * (b @ a)).to(weight.dtype))
        else:
            weight.copy_(merge)
