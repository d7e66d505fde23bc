"""A rebuild whose host turns out full is placed again, on a host with room, as a create or fork is
(tests/workers/test_place_again.py): the host refuses a rebuild that would take a slot it does not have
(ResourceExhausted), and the fleet asks another host, the refused one skipped. With no host left with room the
rebuild fails with ResourceExhausted and no host holds more than its budget.

Two hosts on this one Ray node (host ids `nid` and `nid:gpu1`, as a node's second GPU's), two sessions each at
most (the `two_hosts` fixture, conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from fleet.core.errors import ResourceExhausted
from workers.fleet import KernelFleet


def _num_sessions(f: KernelFleet) -> dict[str, int]:
    return {nid: int(ray.get(h.stats.remote(), timeout=60)["sessions"]) for nid, h in f.hosts.items()}


def _fill(f: KernelFleet, tenant: str, parent: str, node: str) -> list[str]:
    """Forks of `parent` that name `node` until its host holds its most sessions; their ids."""
    made: list[str] = []
    while _num_sessions(f)[node] < 2:
        made.append(f.fork(tenant, parent, f"{node[-4:]}-{len(made)}", node=node)["session"])
    return made


def _record(f: KernelFleet, tenant: str, sid: str) -> Any:
    rec = f.registry.get(tenant, sid)
    assert rec is not None
    return rec


def test_a_rebuild_on_a_full_host_is_placed_again(two_hosts: KernelFleet, tenant: str) -> None:
    """A released session's host is filled by other sessions before its next call rebuilds it there. NOTE: before,
    the rebuild went to its own host all the same, which then held 3 sessions against its budget of 2."""
    f = two_hosts
    f.create_session(tenant, "s", "You are agent s.")
    digest, own = f.digest(tenant, "s"), _record(f, tenant, "s").node
    f.release_session(tenant, "s")                            # the idle reaper: its next call rebuilds it
    f.create_session(tenant, "x", "You are agent x.")
    filled = _fill(f, tenant, "x", own)
    assert _num_sessions(f)[own] == 2                         # control: its host is full before the rebuild
    assert f.digest(tenant, "s") == digest                    # rebuilt, bit-identical
    rec = _record(f, tenant, "s")
    print(f"filled {own[-8:]} with {filled}; s rebuilt on {rec.node[-8:]}; sessions {_num_sessions(f)}")
    assert rec.node != own and (rec.state, rec.epoch) == ("regenerated", 1)
    counts = _num_sessions(f)
    assert counts[own] == 2 and sum(counts.values()) == 2 + len(filled)    # s, x and x's forks, each held once


def test_a_rebuild_with_no_host_with_room_fails_and_overfills_none(two_hosts: KernelFleet, tenant: str) -> None:
    """Both hosts full: the rebuild is refused (ResourceExhausted), no host holds past its budget, and once a slot
    is freed the next call rebuilds it. NOTE: before, the rebuild went to its own host, which then held 3."""
    f = two_hosts
    f.create_session(tenant, "s", "You are agent s.")
    digest, own = f.digest(tenant, "s"), _record(f, tenant, "s").node
    f.release_session(tenant, "s")
    f.create_session(tenant, "x", "You are agent x.")
    forks = [sid for node in sorted(f.hosts) for sid in _fill(f, tenant, "x", node)]
    with pytest.raises(ResourceExhausted):
        f.digest(tenant, "s")
    print(f"every host full: sessions {_num_sessions(f)}; s is {_record(f, tenant, 's').state}")
    assert set(_num_sessions(f).values()) == {2} and _record(f, tenant, "s").state == "lost"
    f.close(tenant, forks[0])                                 # a slot frees: the next call rebuilds it
    assert f.digest(tenant, "s") == digest and _record(f, tenant, "s").state == "regenerated"
    assert set(_num_sessions(f).values()) == {2} and own in f.hosts
