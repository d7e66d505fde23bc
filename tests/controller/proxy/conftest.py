"""Fixtures of the proxy tests: one real fleet (controller, 3 sim-vllm workers, proxy) per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.proxy_fleet import Fleet, start_fleet


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await start_fleet(tmp_path)
    try:
        yield f
    finally:
        await f.stop()
