"""What a local run checks before any work: the model directory it was given (its weights' headers read), the device
it was asked for, the directory its output will go into; the allocator setting it runs with (expandable segments);
and the one-line errors for a model directory whose weights or tokenizer cannot be read when they load.

Shared by the commands and by library entry points such as :func:`memfit.compress.compress`, so a bad
path or device fails with the same one-line :class:`~memfit.errors.MemfitError` before a model loads.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def resolve_device(name):
    """``name`` (auto, cpu, cuda or cuda:N, or a torch.device) as a torch device; auto takes the GPU when there is
    one. Any other device torch knows (mps, xpu, meta) is refused here: memfit's paths run on the CPU or CUDA, and
    there it had failed deep inside torch with a traceback."""
    import torch

    from memfit.errors import MemfitError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):   # mps, xpu, meta...: memfit runs on neither
        raise MemfitError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MemfitError(f"device {name!r} asked for, but this machine has no CUDA GPU; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
        raise MemfitError(f"device {name!r} asked for, but this machine has {count} CUDA GPU"
                          f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")
    return device


EXPANDABLE_SEGMENTS = "expandable_segments:True"
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")   # torch's newer name, and the older one


def use_expandable_segments() -> None:
    """Have torch's CUDA caching allocator grow its segments in place, as the ledger's allocator overhead assumes;
    call it before the first CUDA allocation (torch reads the setting then). benchmarks/plan_fits.py ran the planner's
    plans capped at their predicted share: with torch's default segments and the ledger without its slack, 6 of 8 ran
    out of memory, their reserved bytes up to 1.3 GiB above their peaks (run again under their budget); with expandable
    segments 4 of 8, the gap 0.05-0.26 GiB; with these and the slack, all 10 it reached ran. A setting of the user's
    (either variable, not empty) is kept, said once where it leaves expandable segments off; so is the running
    allocator's where CUDA has already started (a library caller's process), unless its setting has them: a setting
    found then is taken to be the one CUDA started with (torch reads it at that start; one set later is not read)."""
    import torch

    from memfit.log import warn_once

    given = {name: os.environ[name] for name in ALLOCATOR_VARIABLES if os.environ.get(name)}
    if any(EXPANDABLE_SEGMENTS in value.replace(" ", "") for value in given.values()):
        return
    if torch.cuda.is_initialized():
        warn_once("allocator", "CUDA has already started, so its allocator keeps its segments; the ledger's allocator "
                               f"overhead assumes {EXPANDABLE_SEGMENTS}")
    elif not given:
        for name in ALLOCATOR_VARIABLES:
            os.environ[name] = EXPANDABLE_SEGMENTS
    else:
        setting = ", ".join(f"{name}={value}" for name, value in given.items())
        warn_once("allocator", f"{setting} is kept; the ledger's allocator overhead assumes {EXPANDABLE_SEGMENTS}, so "
                               "a plan's headroom may not hold")


def check_model_dir(model: str | Path) -> Path:
    """``model`` as a directory holding config.json and readable safetensors weights (checked before any work)."""
    from memfit.errors import MemfitError
    from memfit.infer.partial_load import weight_files
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
    weight_files(path)                                 # its index or header read: a truncated file fails here
    return path


def unreadable_weights(model_dir: str | Path, err: Exception):
    """The one-line :class:`~memfit.errors.MemfitError` for weights that are there but cannot be read (a truncated or
    garbage safetensors file, an index that is no JSON or has no weight map). Loaders catch broadly for it: json's,
    safetensors' and transformers' errors share no base class."""
    from memfit.errors import MemfitError

    return MemfitError(f"{model_dir}: its weights cannot be read ({type(err).__name__}: {err})")


def load_hf_tokenizer(model_dir: str | Path):
    """The model directory's Hugging Face tokenizer; a one-line MemfitError where its files cannot be read (a garbage
    tokenizer.json), not the tokenizers library's traceback."""
    from transformers import AutoTokenizer

    from memfit.errors import MemfitError

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - tokenizers', json's and transformers' errors share no base
        raise MemfitError(f"{model_dir}: its tokenizer cannot be read ({type(err).__name__}: {err})") from None


def refuse_blank_out(out: str | Path, what: str) -> None:
    """A one-line MemfitError where ``--out`` was given blank (``Path("")`` is the current directory, so the verb
    would have written there or said "got '.'"), asking to name ``what``."""
    from memfit.errors import MemfitError

    if not str(out).strip():
        raise MemfitError(f"--out is empty: name {what}")


def output_dir_problem(path: str | Path) -> str | None:
    """Why no directory can be made and written at ``path``, or None: a symbolic link to nothing on the way, a file
    where a directory must be, a directory nothing can be written in, or a path the file system refuses (a name
    over NAME_MAX). Writing is probed (a directory made and removed in the nearest one that exists): os.access lets
    root through on /proc or a read-only mount, where the output would fail after the work."""
    path = Path(path).expanduser().absolute()
    try:
        dangling = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as err:                                        # e.g. a name over NAME_MAX
        return str(err.strerror or err)
    if dangling:
        return f"{dangling} is a symbolic link to nothing"
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".memfit-probe-", dir=existing))
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror or err})"
    return None
