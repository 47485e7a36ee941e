"""Byte sizes: parse what users type (``8GiB``, ``8GB``, ``8000MiB``, ``0.5TiB``) and print them."""
from __future__ import annotations

import math
import re

from memfit.errors import MemfitError

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")   # a sign: "not positive"

GiB = 2**30
MiB = 2**20


def parse_bytes(text: str | int | float) -> int:
    """Parse a memory size. A bare number is bytes, but a string one under 1 MiB ("24") is refused as a missing unit.
    Raises MemfitError when malformed or not positive."""
    if isinstance(text, (int, float)):
        value, unit = float(text), "b"
    else:
        match = _PATTERN.match(str(text))
        if not match:
            raise MemfitError(
                f"cannot read the memory size {text!r}: write a number and a unit, e.g. 8GiB, 8GB, 8000MiB, 0.5TiB"
            )
        value, unit = float(match.group(1)), (match.group(2) or "b").lower()
        if unit not in _UNITS:
            raise MemfitError(
                f"unknown unit {match.group(2)!r} in {text!r}: use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
    size = value * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise MemfitError(f"memory size must be a positive, finite number of bytes, got {text!r}")
    if isinstance(text, str) and not match.group(2) and size < MiB:       # "24": surely not 24 bytes of GPU
        raise MemfitError(f"memory size {text!r} has no unit, so it reads as {int(size)} bytes: write one, e.g. "
                          f"{text.strip()}GiB")
    return int(size)


def format_bytes(n: float) -> str:
    """Bytes as a short human string in binary units (``1.50 GiB``)."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, scale in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def format_count(n: int) -> str:
    """A parameter count with the unit that keeps it readable: 1.24B, 13.2M, 158.0K."""
    for scale, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if round(n / scale, digits) >= 1:             # the unit of the rounded value: 999,950 is 1.0M, not 1000.0K
            return f"{n / scale:.{digits}f}{unit}"
    return str(n)
