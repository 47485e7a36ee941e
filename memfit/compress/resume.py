"""Keep the layers an interrupted ``memfit compress`` projected, so that the same command run again continues there.

Projecting a large model (BLAST's descent above all: hundreds of matrices, each hundreds of solves) takes long enough
that a Ctrl-C, a lost session or an error late in the run should not cost what was done. As each group of layers is
projected, its structured layers' tensors, as they will be saved (in the model's dtype), go to a safetensors file in
``.<out>.memfit-progress`` beside the output, with a record (RECORD_NAME) of what they depend on: the method, blocks
and ranks, BLAST's steps, whether the projection is activation-aware and on which calibration tokens, a digest of the
source weights, and memfit's version. A later run whose record is the same takes those layers from there instead of
projecting them again (on any device); the directory is removed once the output is saved. A record that differs is
refused, naming what differs, unless ``force`` discards it. The directory takes about the disk the compressed layers
will take in the output.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.files import atomic_path, serializing
from memfit.log import logger

RECORD_NAME = "progress.json"
FORMAT = 1
GROUP_GLOB = "group-*.safetensors"


def progress_dir(out: Path) -> Path:
    """Where the layers projected for ``out`` are kept until it is saved: ``.<out>.memfit-progress`` beside it."""
    return out.with_name(f".{out.name}.memfit-progress")


def tokens_digest(batches: Iterable[torch.Tensor]) -> str:
    """A digest of the calibration token ids, batch by batch (an activation-aware projection fits these tokens)."""
    digest = hashlib.sha256()
    for ids in batches:
        digest.update(f"{tuple(ids.shape)}".encode())
        digest.update(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class KeptLayers:
    """The structured layers projected so far for one output, on disk (see the module's docstring).

    :meth:`open` checks an earlier run's record against this run's; :meth:`layers` gives a group's kept layers (or
    None: project them), :meth:`keep` writes a projected group, :meth:`remove` ends it all once the output is saved.
    """

    def __init__(self, directory: Path, record: dict):
        self.directory, self.record = directory, record
        self.files: dict[str, Path] = {}               # layer name -> the file holding its tensors

    @classmethod
    def open(cls, out: Path, record: dict, force: bool) -> KeptLayers:
        """The kept layers for ``out`` under ``record`` (JSON-able): an earlier run's where its record is the same;
        where it differs, a MemfitError naming the difference, or with ``force`` the earlier run's are removed (and
        that said)."""
        kept = cls(progress_dir(out), {"format": FORMAT, **record})
        if not kept.directory.is_dir():
            return kept
        try:
            earlier = json.loads((kept.directory / RECORD_NAME).read_text())
        except (OSError, ValueError):
            earlier = None                             # killed before its record was written: nothing is kept yet
        if earlier is not None and earlier != kept.record:
            if not force:
                raise MemfitError(f"{kept.directory} keeps the layers an interrupted memfit compress to {out} projected "
                                  f"with other settings ({_difference(earlier, kept.record)}): run that command again "
                                  "to continue it, or pass --force to discard them")
            shutil.rmtree(kept.directory)
            logger.warning(f"discarded {kept.directory}: the layers an interrupted memfit compress projected with "
                           f"other settings ({_difference(earlier, kept.record)})")
            return kept
        kept._index()
        return kept

    def _index(self) -> None:
        from safetensors import safe_open

        for path in sorted(self.directory.glob(GROUP_GLOB)):
            try:
                with safe_open(path, "pt") as f:
                    names = json.loads(f.metadata()["layers"])
            except Exception as err:  # noqa: BLE001 - safetensors' errors share no base; the group is projected again
                logger.warning(f"{path} cannot be read ({type(err).__name__}: {err}); its layers are projected again")
                continue
            self.files.update(dict.fromkeys(names, path))

    @property
    def count(self) -> int:
        """Layers kept."""
        return len(self.files)

    def layers(self, names: list[str], empty: Callable[[str], nn.Module]) -> list[nn.Module] | None:
        """The kept layers ``names``, each built by ``empty(name)`` and loaded with its tensors; None unless every one
        of them is kept (the group is then projected whole)."""
        from safetensors.torch import load_file

        if not all(name in self.files for name in names):
            return None
        loaded = {path: load_file(path) for path in {self.files[name] for name in names}}
        modules = []
        for name in names:
            module = empty(name)
            prefix = f"{name}."
            state = {key[len(prefix):]: value for key, value in loaded[self.files[name]].items() if key.startswith(prefix)}
            try:
                module.load_state_dict(state)
            except RuntimeError as err:                # a file changed since it was written: one line, not a traceback
                raise MemfitError(f"{self.files[name]}: {name}'s kept tensors do not fit its layer "
                                  f"({str(err).splitlines()[0]}); remove {self.directory} to project it again") from None
            modules.append(module)
        return modules

    def keep(self, names: list[str], modules: list[nn.Module]) -> None:
        """Write the projected layers ``names`` (one file, replacing none: a group is kept once)."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        record = self.directory / RECORD_NAME
        if not record.is_file():
            with atomic_path(record) as tmp:
                tmp.write_text(json.dumps(self.record, indent=1))
        tensors = {f"{name}.{key}": value.detach().to("cpu").contiguous()
                   for name, module in zip(names, modules) for key, value in module.state_dict().items()}
        path = self.directory / f"group-{names[0]}.safetensors"      # a layer is in one group: a name of its own
        with atomic_path(path) as tmp, serializing(path):
            save_file(tensors, str(tmp), metadata={"layers": json.dumps(names)})
        self.files.update(dict.fromkeys(names, path))

    def remove(self) -> None:
        """Remove the directory (the output is saved); one that cannot be removed is said, not raised."""
        if self.directory.is_dir():
            shutil.rmtree(self.directory, onerror=lambda *args: logger.warning(
                f"could not remove {args[1]} ({args[2][1]}); the compressed model is saved, remove it by hand"))


def _difference(earlier: dict, now: dict) -> str:
    """The first keys whose values differ, as 'key: earlier -> now'."""
    keys = [key for key in dict.fromkeys([*earlier, *now]) if earlier.get(key) != now.get(key)]
    return "; ".join(f"{key}: {earlier.get(key)!r} then, {now.get(key)!r} now" for key in keys[:3])
