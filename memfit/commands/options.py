"""argparse option types that more than one verb takes."""
from __future__ import annotations

import argparse

SEED_LIMIT = 2**32   # torch.manual_seed overflows at 2**64, and finetune seeds each epoch's order with seed * 100003


def seed(text: str) -> int:
    """A seed, 0 to SEED_LIMIT - 1: a larger one had ended finetune and generate in torch's ValueError traceback."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"a seed is from 0 to {SEED_LIMIT - 1}, got {value}")
    return value
