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
    """``path``'s adapter_config.json, checked to be a plain LoRA adapter this merge reproduces (no DoRA, no trained
    biases, no per-module ranks); a one-line MemfitError otherwise. Reads no weight: a caller checks it first."""
    path = Path(path).expanduser()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise MemfitError(f"--adapter {path}: not a LoRA adapter directory (it needs {CONFIG_FILE} and {WEIGHTS_FILE}, "
                          "as memfit finetune writes to OUT/adapter)")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise MemfitError(f"--adapter {path}: {CONFIG_FILE} cannot be read ({err})") from None
    unsupported = [what for what, present in (
        (f"peft_type {config.get('peft_type')!r}", config.get("peft_type") != "LORA"),
        ("DoRA", config.get("use_dora")), (f"bias {config.get('bias')!r}", config.get("bias", "none") != "none"),
        ("per-module ranks or alphas", config.get("rank_pattern") or config.get("alpha_pattern")),
        ("fan_in_fan_out weights", config.get("fan_in_fan_out"))) if present]
    if unsupported:
        raise MemfitError(f"--adapter {path}: only plain LoRA adapters merge here, this one has "
                          f"{', '.join(unsupported)}")
    return config


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Merge the adapter at ``path`` into ``model`` in place (:func:`read_adapter_config` first). Every saved tensor
    must name a weight of ``model`` of the right shape: an adapter trained on another model is a MemfitError naming
    the first that does not fit."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    config = read_adapter_config(path)
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    params = dict(model.named_parameters())
    tensors = {key.removeprefix(KEY_PREFIX): value for key, value in load_file(str(path / WEIGHTS_FILE)).items()}
    for name, value in tensors.items():
        if name.endswith(LORA_B):
            continue
        if name.endswith(LORA_A):
            target = name.removesuffix(LORA_A) + ".weight"
            pair = tensors.get(name.removesuffix(LORA_A) + LORA_B)
            if pair is None:
                raise MemfitError(f"--adapter {path}: {name} has no {LORA_B.lstrip('.')} beside it")
            update = scale * (pair.double() @ value.double())
        else:                                          # a module saved whole (modules_to_save)
            target, update = name, None
        weight = params.get(target)
        expected = (update if update is not None else value).shape
        if weight is None or weight.shape != expected:
            here = "absent" if weight is None else f"{tuple(weight.shape)}"
            raise MemfitError(f"--adapter {path}: it holds {target} as {tuple(expected)}, this model's is {here} "
                              "(an adapter of another model?)")
        if update is None:
            weight.copy_(value)
        else:
            weight.copy_((weight.double() + update.to(weight.device)).to(weight.dtype))
