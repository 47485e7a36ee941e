"""memfit's logger and the say-it-once rule.

memfit never takes a slower or approximate path silently: each such choice is logged
once per process (per key) on the ``memfit`` logger, which the CLI shows on stderr.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("memfit")
_said: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key in _said:
        return
    _said.add(key)
    logger.warning(message)
