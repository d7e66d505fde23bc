"""A fork that names a node held down only on suspicion (its host answered a fan-out late: workers/nodes.py
ask_all holds it down SUSPECT_S) asks that host once more before refusing the node as not alive: a host that
answers now is up again, and the fork goes there. A node the fleet has no host for is still refused.

NOTE: before, the fork was refused "not an alive node" for the rest of the hold while its host answered every
call (a fresh-clone CI run: one late offer on a loaded machine, then a fork naming that node)."""

from __future__ import annotations

import pytest

from fleet.core.errors import InvalidArgument
from workers.fleet import KernelFleet
from workers.nodes import SUSPECT_S


def test_a_fork_naming_a_suspect_node_that_answers_goes_there(kfleet: KernelFleet, tenant: str) -> None:
    f = kfleet
    f.create_session(tenant, "x", "You are agent x.")
    nid = f.registry.get(tenant, "x").node
    f.nodes.hold_down(nid, SUSPECT_S)                    # a late answer in a fan-out
    assert not f.nodes.alive(nid)                        # control: the hold is in force
    child = f.fork(tenant, "x", "c", node=nid)
    assert child["node"] == nid and f.nodes.alive(nid)   # asked again, it answered: the hold is lifted
    assert f.digest(tenant, "c") == f.digest(tenant, "x")


def test_a_fork_naming_a_node_without_a_host_is_refused(kfleet: KernelFleet, tenant: str) -> None:
    f = kfleet
    f.create_session(tenant, "x", "You are agent x.")
    with pytest.raises(InvalidArgument, match="not an alive node"):
        f.fork(tenant, "x", "c", node="0" * 56)
    assert f.registry.get(tenant, "c") is None
