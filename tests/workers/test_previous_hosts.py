"""A controller of a new host API version stops its fleet's kernel hosts of previous versions when it starts: it
never calls them (their names carry their version, workers/placement.py HOST_API_VERSION), their sessions are
rebuilt from their logs on its own hosts, and, detached, they held their memory (a GPU node's whole GPU) forever.
Its own version's hosts, and another fleet's (another store), stay.

The previous version's host is a real one: a fleet started with HOST_API_VERSION one lower names its hosts so."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from support.workers import SPEC, host_of, wait_dead

from workers import placement
from workers.fleet import KernelFleet
from workers.placement import RAY_NAMESPACE, fleet_scope


@ray.remote(num_cpus=0)
class _Named:
    """An actor under a host's name (for names only: the ones before versions, another fleet's)."""

    def ping(self) -> str:
        return "ok"


def _named(name: str) -> ray.actor.ActorHandle:
    actor = _Named.options(name=name, namespace=RAY_NAMESPACE, lifetime="detached").remote()  # type: ignore[attr-defined]
    ray.get(actor.ping.remote(), timeout=60)
    return actor


@pytest.mark.slow
def test_a_new_fleet_stops_its_previous_versions_hosts(ray_cluster: None, tmp_path: Path, tenant: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE: before, the previous version's detached host ran on, holding its session, after the new fleet had
    rebuilt that session on its own host."""
    url, version = f"sqlite:///{tmp_path / 'kvfleet.db'}", placement.HOST_API_VERSION
    monkeypatch.setattr(placement, "HOST_API_VERSION", version - 1)
    old = KernelFleet(url, SPEC, detached=True, call_timeout_s=120.0)   # the previous version's controller
    [nid] = old.hosts
    old.create_session(tenant, "s", "You are agent s.")
    digest, previous = old.digest(tenant, "s"), host_of(url, nid)
    old.release()
    monkeypatch.undo()
    now = KernelFleet(url, SPEC, detached=True, call_timeout_s=120.0)   # this version's, then its restart
    now.create_session(tenant, "warm", "You are agent warm.")
    pid = ray.get(host_of(url, nid).stats.remote(), timeout=60)["pid"]
    now.release()
    scope, other = fleet_scope(url), fleet_scope(url + "-another-store")
    unversioned, elsewhere = _named(f"host:{scope}:{nid}"), _named(f"host:{other}-v{version - 1}:{nid}")
    f = KernelFleet(url, SPEC, detached=True, call_timeout_s=120.0)
    try:
        wait_dead(previous, timeout_s=30)                       # NOTE: before, alive (AssertionError)
        wait_dead(unversioned, timeout_s=30)
        stats = ray.get(host_of(url, nid).stats.remote(), timeout=60)
        print(f"the previous version's hosts stopped; this version's host kept (pid {pid} -> {stats['pid']})")
        assert stats["pid"] == pid and ray.get(elsewhere.ping.remote(), timeout=60) == "ok"   # controls: they stay
        assert f.digest(tenant, "s") == digest and f.num_regenerations == 1   # rebuilt from its log
        f.info(tenant, "warm")
        assert f.num_regenerations == 1                         # this version's host kept its session warm
    finally:
        f.shutdown()
        ray.kill(elsewhere, no_restart=True)
        for actor in (previous, unversioned):
            ray.kill(actor, no_restart=True)
