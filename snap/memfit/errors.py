"""User-facing errors.

A `MemfitError` is bad input or an impossible request, found before any work starts.
The CLI prints its message (no traceback) and exits with status 2; library callers
catch it like any exception. The message names the bad value and what is accepted.
"""


class MemfitError(ValueError):
    """Bad input or an impossible request, explained in plain words."""
