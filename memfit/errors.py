"""User-facing errors.

A `MemfitError` is bad input or an impossible request, found before any work starts.
The CLI prints its message (no traceback) and exits with status 2; library callers
catch it like any exception. The message names the bad value and what is accepted.
"""


class MemfitError(ValueError):
    """Bad input or an impossible request, explained in plain words."""


def is_count(value, least: int = 1) -> bool:
    """Whether ``value`` is an integer of at least ``least``, a bool not counting as one (``True`` is an int to
    Python): the test the argument checks share, each with its own message."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
