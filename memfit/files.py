"""Files memfit writes get the mode a plain ``open()`` gives a new file: 0o666 less the umask.

Two ways of writing leave a file at 0600 instead, readable by its owner only: a temporary file from
``tempfile`` (``mkstemp`` and ``NamedTemporaryFile`` create theirs 0600) renamed over the target, and
safetensors, which writes every file that way itself (0.8: a 0600 temporary beside the target, then a
rename). A model directory, an adapter or a rankings file made on a shared machine would then not be
readable by the others who should read it.
"""
from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file now: 0o666 less the process's umask.

    ``os`` has no umask getter, so the umask is set and put back at once; in between it is 0o077, so a file
    another thread creates in that moment is private rather than world-writable.
    """
    mask = os.umask(0o077)
    os.umask(mask)
    return 0o666 & ~mask


def follow_umask(*paths: str | Path) -> None:
    """Give each file the mode ``open()`` would have given it (for files a library wrote 0600, e.g. safetensors)."""
    mode = new_file_mode()
    for path in paths:
        os.chmod(path, mode)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh temporary path beside ``path`` to write to; renamed over ``path`` when the block ends, removed if it
    raises.

    A crash never leaves a truncated ``path`` nor a temporary file, and the file gets the mode ``open()`` gives a
    new file, whatever wrote the temporary.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        yield tmp
        follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
