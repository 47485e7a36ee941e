"""Module settings set for one variant of a measurement and restored after, so that a benchmark times variants of
memfit's knobs (a kernel's tile, a solver's choice) against each other in one run."""
from __future__ import annotations

import contextlib
from types import ModuleType


@contextlib.contextmanager
def module_settings(module: ModuleType, settings: dict):
    """Within: each ``module.<name>`` set to ``settings[name]``; every one restored after, whatever the block raises."""
    before = {name: getattr(module, name) for name in settings}
    changed = []
    try:
        for name, value in settings.items():
            setattr(module, name, value)
            changed.append(name)
        yield
    finally:
        for name in changed:
            setattr(module, name, before[name])
