"""A host that answers a fan-out late (workers/nodes.py ask_all: more than PROBE_S after the first answer) is held
down SUSPECT_S as a suspect, and its answer, when it comes, lifts the hold: a fork that names that node then goes
there. A node the fleet has no host for is still refused.

NOTE: before, the hold stood for the whole 10 s while the host answered every call: a fork naming it was refused
"not an alive node" (a fresh-clone CI run: one late offer on a loaded machine, then a fork naming that node)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
from support.workers import SPEC

from fleet.core.errors import InvalidArgument
from workers import nodes
from workers.fleet import KernelFleet
from workers.nodes import SUSPECT_S


def test_a_late_answer_lifts_the_hold_and_a_fork_naming_that_node_goes_there(
    ray_cluster: None, tmp_path: Path, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # its node table never re-read (it would drop the second host, which Ray's table does not name)
    f = KernelFleet(f"sqlite:///{tmp_path / 'kvfleet.db'}", SPEC, call_timeout_s=120.0, node_refresh_s=1e9)
    try:
        f.create_session(tenant, "x", "You are agent x.")
        rec = f.registry.get(tenant, "x")
        assert rec is not None
        nid = rec.node
        late = nid + ":late"                                   # a second host of this node, still starting when asked
        f.nodes.specs[late] = f.nodes.specs[nid]
        f.nodes.hosts[late] = f.nodes._host(late, f.nodes.specs[nid], 1)
        monkeypatch.setattr(nodes, "PROBE_S", 0.0)            # every answer after the first is late
        f.nodes.ask_all("ping")
        assert late in f.nodes.down                            # control: the late host was held down
        ray.get(f.nodes.hosts[late].ping.remote(), timeout=60)  # it answers (the held call answered before this one)
        deadline = time.monotonic() + SUSPECT_S / 3      # well within the hold, which would otherwise stand
        while late in f.nodes.down and time.monotonic() < deadline:
            time.sleep(0.02)
        assert f.nodes.alive(late)                             # its late answer lifted the hold
        child = f.fork(tenant, "x", "c", node=late)
        assert child["node"] == late and f.digest(tenant, "c") == f.digest(tenant, "x")
    finally:
        f.shutdown()


def test_a_fork_naming_a_node_without_a_host_is_refused(kfleet: KernelFleet, tenant: str) -> None:
    f = kfleet
    f.create_session(tenant, "x", "You are agent x.")
    with pytest.raises(InvalidArgument, match="not an alive node"):
        f.fork(tenant, "x", "c", node="0" * 56)
    assert f.registry.get(tenant, "c") is None
