"""Keep the layers an interrupted ``memfit compress`` projected, so that the same command run again continues there.

Projecting a large model (BLAST's descent above all: hundreds of matrices, each hundreds of solves) takes long enough
that a Ctrl-C, a lost session or an error late in the run should not cost what was done. As each group of layers is
projected, its structured layers' tensors, as they will be saved (in the model's dtype), go to a safetensors file in
``.<out>.memfit-progress`` beside the output, each layer with a digest of what its projection read (:func:`source_digest`:
its weight and bias, every byte, and for an activation-aware projection its input covariance, which the calibration
tokens and the whole model before the layer make). A record (RECORD_NAME) holds the settings every layer shares: the
method, blocks and ranks, BLAST's steps, whether the projection is activation-aware, and a digest of the code that
projects and builds the layers. A later run with the same record takes a group from there where every layer's digest
is this run's (on the same device: another device's floating point makes other covariances, and those layers are
projected again); the directory is removed once the output is saved. A record of other settings is refused, naming
what differs, unless ``force`` discards it; one of other code (a memfit upgrade), or one that cannot be read, is
discarded, and that said. The directory takes about the disk the compressed layers take in the output.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.files import atomic_path, digest_files, serializing
from memfit.log import logger, warn_once

RECORD_NAME = "progress.json"
FORMAT = 1
GROUP_GLOB = "group-*.safetensors"


def progress_dir(out: Path) -> Path:
    """Where the layers projected for ``out`` are kept until it is saved: ``.<out>.memfit-progress`` beside it."""
    return out.with_name(f".{out.name}.memfit-progress")


def code_digest() -> str:
    """A digest of the code a kept layer comes from: the projections, the conversion and the layer modules (a fix to
    any of them makes layers kept before it stale)."""
    package = Path(__file__).resolve().parents[1]
    return digest_files([package / "compress" / "projection.py", package / "compress" / "convert.py",
                         *sorted((package / "layers").glob("*.py"))])


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and every byte."""
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def source_digest(linear: nn.Linear, cov_digest: str | None) -> str:
    """A digest of what one layer's projection reads: the weight and bias (:func:`tensor_digest`) and, for an
    activation-aware projection, the input covariance it fits (``cov_digest``, its tensor_digest: layers that share an
    input share the covariance, digested once)."""
    parts = [tensor_digest(t) for t in (linear.weight, linear.bias) if t is not None] + [cov_digest or ""]
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:16]


class KeptLayers:
    """The structured layers projected so far for one output, on disk (see the module's docstring).

    :meth:`open` checks an earlier run's record against this run's; :meth:`layers` gives a group's kept layers (or
    None: project them), :meth:`keep` writes a projected group, :meth:`remove` ends it all once the output is saved.
    """

    def __init__(self, directory: Path, record: dict):
        self.directory, self.record = directory, record
        self.files: dict[str, Path] = {}               # layer name -> the file holding its tensors
        self.sources: dict[str, str] = {}              # layer name -> source_digest of what it was projected from

    @classmethod
    def open(cls, out: Path, record: dict, force: bool) -> KeptLayers:
        """The kept layers for ``out`` under ``record`` (JSON-able settings): an earlier run's where its record is the
        same; where it differs, a MemfitError naming the difference, or with ``force`` the earlier run's are removed
        (and that said). A directory whose record cannot be read (removed, damaged) is removed, and that said: what
        its layers were projected with is unknown; so is one kept by other code (a memfit upgrade), which no run of
        this code could take."""
        kept = cls(progress_dir(out), {"format": FORMAT, **record})
        if not kept.directory.is_dir():
            return kept
        try:
            earlier = json.loads((kept.directory / RECORD_NAME).read_text())
        except (OSError, ValueError):
            earlier = None
        if not isinstance(earlier, dict):
            kept._discard("its record of their settings cannot be read")
        elif earlier.get("code") != kept.record["code"]:   # no run of this code can take them
            kept._discard("memfit's projection or layer code has changed since")
        elif earlier != kept.record:
            if not force:
                raise MemfitError(f"{kept.directory} keeps the layers an interrupted memfit compress to {out} projected "
                                  f"with other settings ({_difference(earlier, kept.record)}): run that command again "
                                  "to continue it, or pass --force to discard them")
            kept._discard(f"they were projected with other settings ({_difference(earlier, kept.record)})")
        else:
            kept._index()
        return kept

    def _discard(self, why: str) -> None:
        shutil.rmtree(self.directory)
        logger.warning(f"discarded {self.directory}, the layers an interrupted memfit compress projected: {why}")

    def _index(self) -> None:
        from safetensors import safe_open

        for path in sorted(self.directory.glob(GROUP_GLOB)):
            try:
                with safe_open(path, "pt") as f:
                    sources = json.loads(f.metadata()["sources"])
            except Exception as err:  # noqa: BLE001 - safetensors' errors share no base; the group is projected again
                logger.warning(f"{path} cannot be read ({type(err).__name__}: {err}); its layers are projected again")
                continue
            self.files.update(dict.fromkeys(sources, path))
            self.sources.update(sources)

    @property
    def count(self) -> int:
        """Layers kept."""
        return len(self.files)

    def layers(self, sources: dict[str, str], empty: Callable[[str], nn.Module]) -> list[nn.Module] | None:
        """The kept layers of a group (``sources``: each layer's name -> :func:`source_digest` now), each built by
        ``empty(name)`` and loaded with its tensors; None unless every one is kept from these sources (the group is
        then projected whole, and a layer kept from other sources said)."""
        from safetensors.torch import load_file

        if not all(name in self.files for name in sources):
            return None
        if changed := [name for name, digest in sources.items() if self.sources[name] != digest]:
            warn_once(f"compress:kept-sources:{self.directory}", f"{changed[0]} and maybe others were kept from other "
                      "weights or calibration inputs than this run's (another model, text, dtype or device); their "
                      "groups are projected again")
            return None
        loaded = {path: load_file(path) for path in {self.files[name] for name in sources}}
        modules = []
        for name in sources:
            module, prefix = empty(name), f"{name}."
            state = {key[len(prefix):]: value for key, value in loaded[self.files[name]].items() if key.startswith(prefix)}
            try:
                module.load_state_dict(state)
            except RuntimeError as err:                # a file changed since it was written
                detail = " ".join(line.strip() for line in str(err).splitlines()[1:2]).rstrip(".")
                logger.warning(f"{self.files[name]}: {name}'s kept tensors do not fit its layer ({detail}); its group "
                               "is projected again")
                return None
            modules.append(module)
        return modules

    def keep(self, sources: dict[str, str], modules: list[nn.Module]) -> None:
        """Write a projected group (``sources`` as :meth:`layers` takes it) to its file, replacing one a damaged
        earlier copy left."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        record = self.directory / RECORD_NAME
        if not record.is_file():
            with atomic_path(record) as tmp:
                tmp.write_text(json.dumps(self.record, indent=1))
        names = list(sources)
        tensors = {f"{name}.{key}": value.detach().to("cpu").contiguous()
                   for name, module in zip(names, modules) for key, value in module.state_dict().items()}
        path = self.directory / f"group-{names[0]}.safetensors"      # a layer is in one group: a name of its own
        with atomic_path(path) as tmp, serializing(path):
            save_file(tensors, str(tmp), metadata={"sources": json.dumps(sources)})
        self.files.update(dict.fromkeys(names, path))
        self.sources.update(sources)

    def remove(self) -> None:
        """Remove the directory (the output is saved); what cannot be removed is said once, not raised."""
        failed: list[str] = []
        if self.directory.is_dir():
            shutil.rmtree(self.directory, onerror=lambda *args: failed.append(str(args[1])))
        if failed:
            logger.warning(f"could not remove {', '.join(failed)}; the compressed model is saved, remove "
                           f"{self.directory} by hand")


def _difference(earlier: dict, now: dict) -> str:
    """The first keys whose values differ, as 'key: earlier then, now now'."""
    keys = [key for key in dict.fromkeys([*earlier, *now]) if earlier.get(key) != now.get(key)]
    return "; ".join(f"{key}: {earlier.get(key)!r} then, {now.get(key)!r} now" for key in keys[:3])
