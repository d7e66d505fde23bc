"""Fixtures own infrastructure: one real redis-server and one local Ray cluster for the whole run (per pytest-xdist
worker: `./dev.sh test` runs three, each test file whole on one of them, so each worker has its own of each)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.short_dirs import remove_all, short_tmpdir

from fleet.app.redis_server import RedisServer


@pytest.fixture(scope="session", autouse=True)
def short_dirs_removed() -> Iterator[None]:
    """The short temp dirs the tests' own Rays used (support/short_dirs.py) go when the session ends."""
    yield
    remove_all()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server (AOF on) shared by the run; tests may kill() and start() it. Its data dir is under
    pytest's base temp dir (pytest keeps the last three), so a run killed before close() leaves no more."""
    with RedisServer(dir=str(tmp_path_factory.mktemp("redis"))) as srv:
        yield srv.start()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The shared server's URL, flushed before each test (restarted first if a test left it down)."""
    import redis

    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushdb()
    yield redis_server.url


@pytest.fixture(params=["sqlite", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A blob store URL, once per backend: SQLite in the test's tmp dir, and the shared Redis (flushed). The tests
    that run the same checks on both stores take it by this name."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return f"sqlite:///{tmp_path / 'kvfleet.db'}"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the run, with a fixed CPU count (starting one costs seconds)."""
    import ray

    if not ray.is_initialized():
        # address="local": always a fresh cluster of our own, never one another process left running
        # on this machine (ray.init() would join it and refuse num_cpus).
        # NOTE: _temp_dir: the session's Ray files in a dir removed at the end (by default /tmp/ray/session_*,
        # never removed: one per run)
        ray.init(address="local", num_cpus=4, namespace="kvfleet", include_dashboard=False, log_to_driver=False,
                 _temp_dir=short_tmpdir("kvr"),
                 configure_logging=False, runtime_env={"env_vars": {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}})
    yield None
    ray.shutdown()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _slow_files_first(items: list[pytest.Item]) -> None:
    """Order the test files for `./dev.sh test`'s xdist workers, which take one file at a time in this order
    (it passes --no-loadscope-reorder): files holding a `slow` test first, then by number of tests, most first
    (xdist's own order). Left to xdist, files of one slow test (a crash test, a multi-node cluster) came last, and
    one worker ran them alone at the end of the run. A file's tests keep their order (the sort is stable)."""
    files: dict[str, tuple[bool, int, int]] = {}
    for i, item in enumerate(items):
        name = item.nodeid.split("::", 1)[0]
        slow, n, first = files.get(name, (False, 0, i))
        files[name] = (slow or item.get_closest_marker("slow") is not None, n + 1, first)
    rank = {name: (not slow, -n, first) for name, (slow, n, first) in files.items()}
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slow_files_first(items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
