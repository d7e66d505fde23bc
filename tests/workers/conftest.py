"""A KernelFleet on the shared local Ray cluster, with a fresh SQLite store per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.workers import SPEC

from workers.fleet import KernelFleet


@pytest.fixture
def kfleet(ray_cluster: None, tmp_path: Path) -> Iterator[KernelFleet]:
    f = KernelFleet(f"sqlite:///{tmp_path / 'kvfleet.db'}", SPEC, call_timeout_s=120.0)
    yield f
    f.shutdown()


@pytest.fixture
def tenant() -> str:
    return "t" + uuid.uuid4().hex[:8]
