"""Random-init Hugging Face models from a ModelSpec, with no network, and a model directory's architecture on the
meta device.

Benchmarks and tests use these in place of downloaded weights: memory and speed depend
on shapes, not on values. ``save_model_dir`` writes a loadable local model directory.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.files import files_written, follow_umask, snapshot
from memfit.models.spec import ModelSpec, dtype_of, load_spec


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _no_init_weights():
    """transformers' context that builds a model's modules with their weights uninitialised (torch's own init and the
    model's ``_init_weights`` both skipped)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def build_model(spec: ModelSpec | str | Path, dtype: str | torch.dtype | None = None,
                device: str | torch.device = "cpu", attn_implementation: str = "sdpa",
                seed: int = 0) -> torch.nn.Module:
    """A random-init ``*ForCausalLM`` of ``spec``'s shape (a ModelSpec, a preset's name or a model directory, as
    :func:`~memfit.models.spec.load_spec` takes), created directly in ``dtype`` on ``device`` (auto, cpu, cuda or
    cuda:N: :func:`memfit.local.resolve_device`). The weights are drawn once, by the model's own ``init_weights``:
    built as ``from_config`` builds them, each linear's weights were drawn twice (torch's init, then the model's), and
    Llama-3.2-1B took 19.7 s on a 2-core CPU against 11.2 s at 17c1f8c
    (``benchmarks/results/probes/build_model_time_17c1f8c.json``)."""
    from transformers import AutoModelForCausalLM

    from memfit.local import resolve_device

    spec, device = load_spec(spec), resolve_device(device)
    torch_dtype = dtype_of(dtype or spec.dtype)
    config = spec.to_hf_config()
    config.dtype = str(torch_dtype).removeprefix("torch.")  # from_config builds in config.dtype
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with _default_dtype(torch_dtype), torch.device(device):
        with _no_init_weights():
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        model.init_weights()
    return model.eval()


def save_model_dir(spec: ModelSpec, directory: str | Path, dtype: str | torch.dtype | None = None) -> Path:
    """Build a random-init model and save it (safetensors + config.json) to ``directory``."""
    model = build_model(spec, dtype=dtype)
    directory = Path(directory)
    before = snapshot(directory)
    model.save_pretrained(directory)
    follow_umask(*files_written(directory, before))   # transformers' weights, which safetensors writes 0600
    return directory


def model_skeleton(directory: str | Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The architecture ``directory``'s ``config.json`` describes, on the meta device: its modules and attributes,
    no weight allocated or read (a memfit-compressed directory's config.json is its dense source's), in ``dtype`` or
    else the dtype the config records (the one the weights were saved in)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory).expanduser()
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        with torch.device("meta"), _no_init_weights():
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError, TypeError) as err:   # config.json missing, malformed, of an unknown model
        # type, or with a value the model's constructor cannot take (an unknown rope_scaling type: a KeyError)
        raise MemfitError(f"{directory / 'config.json'}: cannot build the model from it ({err})") from None
