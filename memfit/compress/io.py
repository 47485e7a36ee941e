"""Save a compressed model to a directory and load it back into a working model.

Layout of the directory: the Hugging Face ``config.json`` of the original model, the
weights in ``model.safetensors`` (structured factors under their module names, tied
weights stored once), ``memfit_compress.json`` recording each replaced module's structure
(method, shape, rank, blocks, bias) plus the per-layer error report, and the source
model's tokenizer and generation files (SOURCE_FILES) when it had any.

Writes go to a temporary sibling directory that is renamed into place at the end, so
an interrupted save never leaves a half-written output; an existing output is replaced
only with ``force=True``. The temporary directory is named after the output
(``.<out>.memfit-tmp-<random>``) and holds its owner's process id and host (OWNER_NAME): a
save killed before its rename leaves it behind, and the next save to the same output
removes it once that process is gone.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
from pathlib import Path

import torch
from torch import nn

from memfit.compress.plan import structure_class
from memfit.errors import MemfitError
from memfit.files import atomic_dir, follow_umask, named_prefix_hex, serializing, set_aside_of
from memfit.local import output_dir_problem, refuse_blank_out, resolve_device
from memfit.log import logger
from memfit.models.spec import COMPRESSED_MARKER as CONFIG_NAME
from memfit.models.spec import is_compressed_dir

WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 2        # 2: Monarch's w2 rows in (s, j) order (memfit.layers.monarch); 1 is read and converted
READABLE_FORMATS = (1, FORMAT_VERSION)
SOURCE_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                "memfit_tokenizer.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                "generation_config.json")
OWNER_NAME = ".memfit_owner"       # in a temporary save directory: "<pid> <host> <pid namespace>" of its writer


def check_output(out: str | Path, force: bool) -> Path:
    """``out`` as a directory this run can write (call before any work starts): it needs a name short enough for
    its temporary save directory beside it, and a parent it can create and write in; an existing ``out`` is replaced
    only with ``force``, and only if an earlier run wrote it (it holds memfit_compress.json), so a mistyped --out
    never deletes a source model or other data. An ``out`` that a save killed between its two renames left only as
    its set-aside old copy is put back first (:func:`_put_back_set_aside`), so that rule holds for it too. What the
    file system refuses is a MemfitError too (e.g. a name too long), as on the command line."""
    refuse_blank_out(out, "the directory the compressed model goes to")
    try:
        return _checked_output(Path(out).expanduser(), force)
    except OSError as err:
        raise MemfitError(f"--out {out}: {err.strerror or err}") from None


def _checked_output(out: Path, force: bool) -> Path:
    if not out.name.strip() or out.name in (".", ".."):
        raise MemfitError(f"--out needs a directory name, got {str(out)!r}")
    if out.is_symlink():
        raise MemfitError(f"--out {out} is a symbolic link: name the directory itself")
    _put_back_set_aside(out)
    if out.exists():
        if not out.is_dir():
            raise MemfitError(f"{out} exists and is not a directory; choose another --out")
        if not is_compressed_dir(out):
            raise MemfitError(f"{out} exists and is not the output of an earlier memfit compress (it has no "
                              f"{CONFIG_NAME}), so it is never replaced; remove it yourself or choose another --out")
        if not force:
            raise MemfitError(f"{out} already holds a compressed model; pass --force to replace it, or choose "
                              "another --out")
    if problem := output_dir_problem(out.parent):
        raise MemfitError(f"--out {out}: {problem}")
    parent = next(p for p in out.absolute().parents if p.exists())
    longest, name_max = len(os.fsencode(_temp_prefix(out))) + TEMP_HEX, _name_max(parent)
    if longest > name_max:
        raise MemfitError(f"--out {out}: the name is too long for its temporary save directory beside it ({longest} "
                          f"bytes; {parent} takes names of up to {name_max})")
    return out


def _name_max(directory: Path) -> int:
    """The longest name (bytes) ``directory``'s file system takes: its PC_NAME_MAX, or 255 (the common limit) where
    the platform or file system does not say (no os.pathconf on Windows; -1 or an error from some file systems)."""
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):
        return 255
    return limit if limit > 0 else 255


def _put_back_set_aside(out: Path) -> None:
    """Where ``out`` is missing and its one set-aside copy (``.<out>.old-<hex>``, files.atomic_dir) is an earlier
    compress output, rename it back and say so: a save killed between the two renames left the old model there, and
    the next run must not take ``out``'s absence for leave to write it without --force."""
    if out.exists():
        return
    olds = [path for path in set_aside_of(out) if path.is_dir() and not path.is_symlink() and is_compressed_dir(path)]
    if len(olds) > 1:                                  # memfit leaves one at most: which to keep is the user's call
        raise MemfitError(f"--out {out} is missing and {len(olds)} earlier outputs were set aside by interrupted saves "
                          f"({', '.join(map(str, olds))}): rename the one to keep to {out.name}, or remove them")
    if olds:
        olds[0].rename(out)
        logger.warning(f"put back {out}, which an interrupted memfit compress had set aside as {olds[0]}")


def _temp_prefix(out: Path) -> str:
    """The name prefix of ``out``'s temporary save directories, beside it (then TEMP_HEX hex digits)."""
    return f".{out.name}.memfit-tmp-"


TEMP_HEX = 16


def _is_temp_of(path: Path, out: Path) -> bool:
    """Whether ``path`` is named as one of ``out``'s temporary save directories (not another --out's whose name
    starts like it: the prefix, then exactly TEMP_HEX hex digits)."""
    return named_prefix_hex(path, _temp_prefix(out), TEMP_HEX)


def _owner() -> str:
    """This process as an owner record: pid, host and pid namespace (containers sharing a host name and a volume
    number their processes apart)."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "-"
    return f"{os.getpid()} {socket.gethostname()} {namespace}"


def _owner_gone(directory: Path) -> bool:
    """Whether ``directory`` records an owner (OWNER_NAME) that was a process of this host and pid namespace no
    longer alive. Anything else -- no or unreadable record, another host or namespace, a live process or one of
    another user -- counts as in use."""
    try:
        pid, host, namespace = (directory / OWNER_NAME).read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return False
    if pid <= 0 or [host, namespace] != _owner().split()[1:] or os.name != "posix":   # (Windows' os.kill is a Ctrl-C)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):                   # PermissionError: alive, another user's; a pid out of range
        pass
    return False


def remove_leftovers(out: Path) -> None:
    """Remove what a killed save left beside ``out`` (a SIGKILL skips the cleanup), and say what was removed (a warning
    on the memfit logger: stderr): the temporary save directories named with ``out``'s prefix whose recorded owner is
    gone, and, where ``out`` exists (check_output let this run replace it), old copies of ``out`` that a save set aside
    (files.atomic_dir) and was killed before removing, once its new ``out`` was in place (one killed before that had
    it put back by check_output). Two saves into one ``out`` at once are not supported: this could remove the other's
    set-aside copy while it swaps."""
    temporary = [path for path in sorted(out.parent.iterdir())
                 if _is_temp_of(path, out) and path.is_dir() and not path.is_symlink() and _owner_gone(path)]
    set_aside = [path for path in set_aside_of(out) if path.is_dir() and not path.is_symlink()] if out.exists() else []
    for paths, what in ((temporary, "{} temporary director{} left by"),
                        (set_aside, "{} old output director{} set aside by")):
        removed, failed = [], []
        for path in paths:
            errors = []
            shutil.rmtree(path, onerror=lambda *args, found=errors: found.append(args[2]))
            (failed if errors else removed).append(path)
        if removed:
            logger.warning(f"removed {what.format(len(removed), 'y' if len(removed) == 1 else 'ies')} an interrupted "
                           f"memfit compress: {', '.join(map(str, removed))}")
        if failed:                                     # the save goes on: only leftovers are at stake
            logger.warning(f"could not remove all of {', '.join(map(str, failed))}, left by an interrupted memfit "
                           "compress; remove it by hand")


def save_compressed(model: nn.Module, out: str | Path, layers: dict[str, dict], info: dict | None = None,
                    source_dir: str | Path | None = None, force: bool = False) -> Path:
    """Write ``model`` (whose ``layers`` -- module name -> structure config -- are structured) to ``out``."""
    from safetensors.torch import save_model

    out = check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)
    # the owner record goes right after the rename: a temporary directory is never unowned
    with atomic_dir(out, out.with_name(f"{_temp_prefix(out)}{secrets.token_hex(TEMP_HEX // 2)}"),
                    placed=lambda done: (done / OWNER_NAME).unlink()) as tmp:
        (tmp / OWNER_NAME).write_text(_owner())
        model.config.save_pretrained(tmp)
        with serializing(out / WEIGHTS_NAME):
            save_model(model, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "memfit": "compressed"})
        follow_umask(tmp / WEIGHTS_NAME)               # safetensors writes it 0600
        meta = {"format": FORMAT_VERSION, "layers": layers, **(info or {})}
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=1))
        if source_dir is not None:
            for name in SOURCE_FILES:
                if (Path(source_dir) / name).is_file():
                    shutil.copy2(Path(source_dir) / name, tmp / name)
    return out


def _materialize(model: nn.Module) -> None:
    """Give a meta-device model (its structured layers in place) uninitialised CPU storage for the weights the file
    fills and tie them again. A module with non-persistent state (the rotary embedding's ``inv_freq``, and under
    transformers 4 its ``original_inv_freq`` attribute), which no file holds, is built again from its config on the
    CPU and put in its place: it has no weights. Anything left on the meta device is refused."""
    from memfit.compress.convert import replace_module

    rebuilt = {}
    for name, module in model.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        config = getattr(module, "config", None)
        if config is None or next(module.parameters(), None) is not None:
            raise MemfitError(f"cannot compute the non-persistent buffers of {name} ({type(module).__name__}: "
                              + ("no config to build it from)" if config is None else "it holds weights)"))
        try:
            with torch.device("cpu"):
                rebuilt[name] = type(module)(config=config)
        except TypeError as err:
            raise MemfitError(f"cannot compute the non-persistent buffers of {name} ({type(module).__name__} is "
                              f"not built from its config alone: {err})") from None
    model.to_empty(device="cpu")
    for name, fresh in rebuilt.items():
        replace_module(model, name, fresh)
    model.tie_weights()
    left = [f"{name}.{key}" for name, module in model.named_modules() for key, value in vars(module).items()
            if isinstance(value, torch.Tensor) and value.is_meta]
    if left:
        raise MemfitError(f"cannot load: {', '.join(left[:3])} would be left without a value (on the meta device)")


def read_compressed_dir(directory: str | Path) -> tuple[Path, dict]:
    """(the directory, its layer records) of a directory ``save_compressed`` wrote, after the checks that need no
    tensor: it exists, is one, holds its weights file, and its record is JSON of a format this memfit reads (a
    ``config.json`` or record path is taken as its directory, as load_spec takes a config.json)."""
    directory = Path(directory).expanduser()
    if directory.is_file() and directory.name in ("config.json", CONFIG_NAME):
        directory = directory.parent
    if not directory.is_dir():
        raise MemfitError(f"{directory}: no such directory")
    if not is_compressed_dir(directory):
        raise MemfitError(f"{directory} has no {CONFIG_NAME}: not a memfit-compressed model directory")
    if not (directory / WEIGHTS_NAME).is_file():
        raise MemfitError(f"{directory}: its weights file {WEIGHTS_NAME} is missing")
    try:
        meta = json.loads((directory / CONFIG_NAME).read_text())
    except json.JSONDecodeError as err:
        raise MemfitError(f"{directory / CONFIG_NAME}: malformed JSON ({err})") from None
    if not isinstance(meta, dict) or type(meta.get("format")) is not int or meta["format"] not in READABLE_FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise MemfitError(f"{directory}: compressed format {found!r}; this memfit reads formats "
                          f"{', '.join(map(str, READABLE_FORMATS))}")
    return directory, meta


def load_compressed(directory: str | Path, device: str | torch.device = "cpu",
                    dtype: str | torch.dtype | None = None) -> nn.Module:
    """A working ``*ForCausalLM`` from a directory written by ``save_compressed``, in ``dtype`` (None or "auto": the
    dtype it was saved in)."""
    from safetensors.torch import load_model

    from memfit.compress.convert import replace_module
    from memfit.models import dtype_of, model_skeleton

    directory, meta = read_compressed_dir(directory)
    device = resolve_device(device)
    torch_dtype = dtype_of(dtype) if dtype not in (None, "auto") else None      # None / "auto": the saved dtype
    model = model_skeleton(directory, torch_dtype)
    try:
        for name, cfg in meta["layers"].items():
            old = model.get_submodule(name)
            kwargs = {k: cfg[k] for k in ("blocks", "permute_output") if k in cfg}
            layer = structure_class(cfg["structure"])(cfg["in_features"], cfg["out_features"], cfg["rank"],
                                                      bias=cfg["bias"], device="meta", dtype=old.weight.dtype, **kwargs)
            replace_module(model, name, layer)
    except (KeyError, TypeError, AttributeError) as err:   # a field missing or of the wrong kind, a module it lacks
        raise MemfitError(f"{directory / CONFIG_NAME}: its layer records do not describe this model "
                          f"({type(err).__name__}: {err})") from None
    _materialize(model)
    try:
        missing, unexpected = load_model(model, str(directory / WEIGHTS_NAME), strict=False)
    except Exception as err:  # noqa: BLE001 - safetensors' errors (a truncated or foreign file) have no common base
        raise MemfitError(f"{directory / WEIGHTS_NAME}: unreadable ({type(err).__name__}: {err})") from None
    missing, unexpected = sorted(_untied(model, missing, directory / WEIGHTS_NAME)), sorted(unexpected)
    if missing or unexpected:
        raise MemfitError(f"{directory}: weights do not match the recorded structure "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if meta["format"] == 1:
        _monarch_w2_from_format_1(model)
    return model.to(device).eval()


@torch.no_grad()
def _monarch_w2_from_format_1(model: nn.Module) -> None:
    """Format 1 stored each Monarch w2[i]'s rows in (j, s) order (row j t + s); reorder them to (s, j), in place."""
    from memfit.layers.monarch import MonarchLinear

    for layer in model.modules():
        if isinstance(layer, MonarchLinear):
            b, r, p = layer.w2.shape
            layer.w2.copy_(layer.w2.reshape(b, b, r // b, p).transpose(1, 2).reshape(b, r, p))


def _untied(model: nn.Module, missing, weights: Path) -> list[str]:
    """The ``missing`` keys whose storage no tensor in ``weights`` filled (tied weights are stored once, under one of
    their names). Counted from the file's own keys: where it lacked a tied pair's tensor, safetensors named one of the
    pair missing and the other, counted as loaded, had hidden it (the model loaded with uninitialised embeddings)."""
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as stored:
        names = set(stored.keys())
    state = model.state_dict()
    loaded = {state[k].data_ptr() for k in names if k in state}
    return [k for k in missing if state[k].data_ptr() not in loaded]
