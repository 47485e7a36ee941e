"""What a local run checks before any work: the model directory it was given, the device it was asked for.

Shared by the commands and by library entry points such as :func:`memfit.compress.compress`, so a bad
path or device fails with the same one-line :class:`~memfit.errors.MemfitError` before a model loads.
"""
from __future__ import annotations

from pathlib import Path


def resolve_device(name: str):
    """``name`` (auto, cpu, cuda or cuda:N) as a torch device; auto takes the GPU when there is one."""
    import torch

    from memfit.errors import MemfitError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MemfitError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MemfitError(f"device {name!r} asked for, but this machine has no CUDA GPU; use --device cpu")
    return device


def check_model_dir(model: str | Path) -> Path:
    """``model`` as a directory holding config.json and safetensors weights (checked before any work)."""
    from memfit.errors import MemfitError
    from memfit.infer.partial_load import check_weight_files
    from memfit.models import PRESETS

    model = str(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        if model in PRESETS:
            hint = " (a preset is a shape without weights; save one with memfit.models.save_model_dir)"
        elif path.is_file():
            hint = " (it is a file: pass the directory holding config.json and the weights)"
        else:
            hint = " (no such directory)"
        raise MemfitError(f"{model!r} is not a model directory{hint}")
    if not (path / "config.json").is_file():
        raise MemfitError(f"{model}: the directory has no config.json")
    from memfit.models.spec import refuse_compressed_dir

    refuse_compressed_dir(path)
    check_weight_files(path)
    return path
