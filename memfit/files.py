"""Files memfit writes get the mode a plain ``open()`` gives a new file: 0o666 less the umask.

Two ways of writing leave a file at 0600 instead, readable by its owner only: a temporary file from
``tempfile`` (``mkstemp`` and ``NamedTemporaryFile`` create theirs 0600) renamed over the target, and
safetensors, which writes every file that way itself (0.8: a 0600 temporary beside the target, then a
rename). A model directory, an adapter or a rankings file made on a shared machine would then not be
readable by the others who should read it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from memfit.errors import MemfitError


def digest_files(paths) -> str:
    """A short sha1 of the files' bytes, in the order given: names a version of some source files (the autotune cache
    keys its picks by the kernels', a compress's kept layers by the projection code's)."""
    digest = hashlib.sha1()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:12]


PROC_STATUS = Path("/proc/self/status")   # Linux 4.7 on: the process's umask among its fields
_UMASK_LOCK = threading.Lock()


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file now: 0o666 less the process's umask.

    Linux reports the umask in /proc/self/status (4.7 on); elsewhere ``os`` has no getter, so it is set and put back
    at once, under a lock: two threads doing that together could each read the other's temporary 0o077.
    """
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return 0o666 & ~mask


def follow_umask(*paths: str | Path) -> None:
    """Give each file the mode ``open()`` would have given it (for files a library wrote 0600, e.g. safetensors)."""
    mode = new_file_mode()
    for path in paths:
        os.chmod(path, mode)


def files_written(directory: Path, before: dict[Path, int]) -> list[Path]:
    """The files under ``directory`` that are new or changed since ``before`` (:func:`snapshot`): what a library's
    save wrote there, and no file it left alone (another user's may not be ours to chmod)."""
    return [path for path, stamp in snapshot(directory).items() if before.get(path) != stamp]


def snapshot(directory: Path) -> dict[Path, int]:
    """Every file under ``directory`` (none where it does not exist) with its modification time in ns."""
    return {path: path.stat().st_mtime_ns for path in Path(directory).rglob("*") if path.is_file()}


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh temporary path beside ``path`` to write to; renamed over ``path`` when the block ends, removed if it
    raises.

    An interrupted write never leaves a truncated ``path`` nor a temporary file. The file keeps the mode of the one
    it replaces, or gets the mode ``open()`` gives a new file, whatever wrote the temporary.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        yield tmp
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


DISK_FULL = ("os error 28", "No space left", "unexpected pos")   # safetensors' and torch's stream writer's words


@contextmanager
def held_exclusively(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` while the block runs, for a read-modify-write of ``path`` that
    other processes do too: without it, two that read the file before either wrote it back each drop the other's
    change. An advisory lock (``flock``): it orders the processes that take it and nothing else."""
    import fcntl

    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def serializing(path: str | Path) -> Iterator[None]:
    """A library's write of ``path`` (safetensors, ``torch.save``), its failure to write as the ``OSError`` it is,
    naming the file: both raise their own types for a full disk (safetensors' SafetensorError "I/O error",
    torch's RuntimeError from its stream writer), which the command line showed as a traceback where an OSError is
    one line. Any other error passes as it is."""
    try:
        yield
    except Exception as err:
        text = str(err)
        if (type(err).__name__ == "SafetensorError" and "I/O error" in text) or \
                (isinstance(err, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container" in text)):
            if any(mark in text for mark in DISK_FULL):
                raise OSError(errno.ENOSPC, f"{path}: the write failed, the disk is full ({text.strip()})") from err
            raise OSError(f"{path}: the write failed ({text.strip()})") from err
        raise


SET_ASIDE_HEX = 16


def _set_aside_prefix(out: Path) -> str:
    return f".{out.name}.old-"


def set_aside_of(out: Path) -> list[Path]:
    """The old copies of ``out`` that :func:`atomic_dir` set aside and a process killed before it removed them left
    beside it (``.<out>.old-<16 hex>``; not those of another ``out`` whose name starts like this one's)."""
    if not out.parent.is_dir():
        return []
    return sorted(path for path in out.parent.iterdir() if named_prefix_hex(path, _set_aside_prefix(out), SET_ASIDE_HEX))


def named_prefix_hex(path: Path, prefix: str, digits: int) -> bool:
    """Whether ``path``'s name is ``prefix`` then exactly ``digits`` lower-case hex digits (a name memfit made)."""
    suffix = path.name[len(prefix):]
    return path.name.startswith(prefix) and len(suffix) == digits and all(c in "0123456789abcdef" for c in suffix)


@contextmanager
def atomic_dir(out: Path, tmp: Path, placed: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A new directory ``tmp`` (beside ``out``) to fill; put in ``out``'s place when the block ends, removed if it
    raises.

    A directory already at ``out`` is renamed aside first, put back if ``tmp`` cannot take its place, and removed
    only once ``tmp`` has: a failed save never leaves a half-written ``out`` nor loses the old one (a process killed
    between the two renames leaves it at ``.<out>.old-<hex>``). ``placed(out)`` runs right after the rename, before
    the old directory is removed. ``tmp`` is made with ``mkdir``, whose mode follows the umask (``mkdtemp``'s 0700
    would outlive the rename).
    """
    tmp.mkdir()
    old = None
    try:
        yield tmp
        if out.exists():
            old = out.with_name(_set_aside_prefix(out) + secrets.token_hex(SET_ASIDE_HEX // 2))
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            old.rename(out)
        raise
    if placed is not None:
        placed(out)
    if old is not None:
        shutil.rmtree(old)


def input_file(path: str | Path, role: str, expected: str) -> Path:
    """``path`` as a file memfit reads once: a one-line MemfitError naming its ``role`` (e.g. "data file") where it
    is a directory (``expected`` says what to pass) or does not exist. A pipe or a device is taken (``--data
    <(...)``): a regular-file test had called one "does not exist"."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise MemfitError(f"{role} {str(path)!r} is a directory; {expected}")
    if not path.exists():
        raise MemfitError(f"{role} {str(path)!r} does not exist; {expected}")
    return path


def read_input_text(path: Path, role: str, encoding: str = "utf-8", errors: str = "strict") -> str:
    """The text of :func:`input_file` ``path``; a file that cannot be read (permissions, an I/O error) is a one-line
    MemfitError naming its ``role``, where it had been a bare errno line."""
    try:
        return path.read_text(encoding=encoding, errors=errors)
    except OSError as err:
        raise MemfitError(f"{role} {str(path)!r} cannot be read ({err.strerror or err})") from None
