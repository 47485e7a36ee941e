"""memfit.measure.variants: a benchmark's variant sets module knobs and gets them back, even when it fails."""
import types

import pytest

from memfit.measure.variants import module_settings


def test_settings_are_set_within_and_restored_after_an_error():
    module = types.SimpleNamespace(TILE=64, LIBRARY="default")
    with pytest.raises(RuntimeError, match="variant failed"):
        with module_settings(module, {"TILE": 128, "LIBRARY": "magma"}):
            assert (module.TILE, module.LIBRARY) == (128, "magma")
            raise RuntimeError("variant failed")
    assert (module.TILE, module.LIBRARY) == (64, "default")
    with module_settings(module, {}):
        assert module.TILE == 64
