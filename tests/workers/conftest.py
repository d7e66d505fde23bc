"""A KernelFleet on the shared local Ray cluster, with a fresh SQLite store per test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from support.workers import SPEC

from fleet.cas import open_store
from workers.fleet import KernelFleet


@pytest.fixture
def kfleet(ray_cluster: None, tmp_path: Path) -> Iterator[KernelFleet]:
    f = KernelFleet(f"sqlite:///{tmp_path / 'kvfleet.db'}", SPEC, call_timeout_s=120.0)
    yield f
    f.shutdown()


@pytest.fixture
def two_hosts(ray_cluster: None, tmp_path: Path) -> Iterator[KernelFleet]:
    """A fleet of two hosts on this one Ray node (host ids `nid` and `nid:gpu1`, as a node's second GPU's), two
    sessions each at most, its node table never re-read (it would drop the second host)."""
    f = KernelFleet(f"sqlite:///{tmp_path / 'kvfleet.db'}", SPEC, call_timeout_s=120.0, node_max_sessions=2,
                    node_refresh_s=1e9)
    nid = next(iter(f.hosts))
    f.nodes.specs[nid + ":gpu1"] = f.nodes.specs[nid]
    f.nodes.hosts[nid + ":gpu1"] = f.nodes._host(nid + ":gpu1", f.nodes.specs[nid], 1)
    # Both hosts answer before the test's first fan-out: a host still starting 1 s after the other answered is held
    # down for 10 s (workers/nodes.py ask_all), and a test naming it then finds it "not an alive node".
    ray.get([h.ping.remote() for h in f.hosts.values()], timeout=120)
    yield f
    f.shutdown()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Any]:
    """A fresh SQLite blob store (for the tests of one SessionKernel, with no Ray)."""
    with open_store(f"sqlite:///{tmp_path / 's.db'}") as s:
        yield s


@pytest.fixture
def tenant() -> str:
    return "t" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def multinode(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario of multinode_scenarios.py (node_loss_scenario.py's last), run once in a child
    process with a timeout, on one cluster started once (starting raylets costs seconds on 2 cores):
    its JSON, by scenario name. Only test_multinode.py asserts on it: one file, so one xdist worker starts it."""
    out = tmp_path_factory.mktemp("multinode") / "out.json"
    script = Path(__file__).with_name("multinode_scenarios.py")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env={**env, "PYTHONPATH": str(root)}, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:    # its raylets and controller are in its process group: all go
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    if not out.exists():
        pytest.fail(f"the scenario script wrote nothing (rc {proc.returncode}):\n{err[-3000:]}")
    return dict(json.loads(out.read_text()))
