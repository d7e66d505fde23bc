"""Fixtures for the kernel contract suite: shared behaviours run against every backend."""

from __future__ import annotations

import pytest
from support.kernels import BACKENDS


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
