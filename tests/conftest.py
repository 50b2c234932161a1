import numpy as np
import pytest

import fastxfer as fx
from fastxfer import _core


@pytest.fixture(params=fx.supported_simd_levels())
def simd(request):
    """Runs a test once on every kernel path this CPU supports, then restores the best one."""
    before = fx.simd_level()
    _core._set_simd_level(request.param)
    try:
        yield request.param
    finally:
        _core._set_simd_level(before)


@pytest.fixture
def rng():
    return np.random.default_rng(20261202)
