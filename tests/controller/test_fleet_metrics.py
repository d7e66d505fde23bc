"""Prometheus metrics of the kernel fleet: exact aggregation of the fleet listing (pure), and the
same families on a real controller over a real local Ray fleet (sessions, KV bytes, radix hit
rate, a fork that shared its parent's blocks, a regeneration after an actor is killed)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from support.controller import start_controller
from support.workers import kill_host

from controller.fleet_metrics import FleetMetricsPoller, snapshot
from controller.metrics import Metrics
from controller.proxy.metrics import ProxyMetrics
from fleet.core.errors import InvalidArgument
from fleet.sdk import NO_RETRY, AsyncFleetClient

SYSTEM = "You are a fleet agent. Keep every answer short and exact."  # 57 bytes: 3 whole blocks

ROWS = [
    {"node": "n1", "state": "active", "bytes_alone": 100, "bytes_shared": 0, "regenerated": 1},
    {"node": "n1", "state": "active", "bytes_alone": 10, "bytes_shared": 300, "parent": "a",
     "adopted_tokens": 48},
    {"node": "n2", "state": "lost", "tokens": 0, "parent": "a", "adopted_tokens": 0, "regenerated": 2},
]
STATS = [{"node": "n1", "hit_rate": 0.5, "cached_tokens": 48, "capacity_tokens": 4096, "evicted_blocks": 3,
          "resident_bytes": 150_000_000, "session_bytes": 40_000}]


def test_snapshot_counts_exactly() -> None:
    s = snapshot(ROWS, STATS)
    assert s.sessions == {("n1", "active"): 2, ("n2", "lost"): 1}
    assert s.kv_bytes == {("n1", "alone"): 110, ("n1", "shared"): 300, ("n2", "alone"): 0, ("n2", "shared"): 0}
    assert (s.regenerations, s.forks, s.fork_adopted_tokens) == (3, {"shared": 1, "replayed": 1}, 48)
    assert s.nodes == {"n1": {"hit_rate": 0.5, "cached_tokens": 48.0, "capacity_tokens": 4096.0,
                              "evicted_blocks": 3.0, "resident_bytes": 150e6, "session_bytes": 40e3}}


class _Fleet:
    """A fleet listing that answers what it is given (the pure part; the real fleet is below)."""

    def __init__(self, stats: list[dict]) -> None:
        self.stats = stats

    def node_stats(self) -> list[dict]:
        return self.stats

    def list_sessions(self, fleet: bool = True) -> list[dict]:
        return ROWS


def test_collector_renders_the_last_poll_and_counts_host_restarts() -> None:
    m = Metrics()
    fleet: _Fleet | None = None
    poller = FleetMetricsPoller(lambda: fleet, m, interval_s=0)
    assert poller.poll() is None and m.registry.get_sample_value("kvfleet_fleet_sessions", {"node": "n1",
                                                                                              "state": "active"}) is None
    fleet = _Fleet([{**STATS[0], "pid": 11}])
    poller.poll()
    fleet.stats = [{**STATS[0], "pid": 12}]      # Ray restarted the host: another process answers
    poller.poll()
    get = m.registry.get_sample_value
    assert get("kvfleet_fleet_sessions", {"node": "n1", "state": "active"}) == 2
    assert get("kvfleet_fleet_kv_bytes", {"node": "n1", "kind": "shared"}) == 300
    assert get("kvfleet_fleet_radix_hit_rate", {"node": "n1"}) == 0.5
    assert get("kvfleet_fleet_host_resident_bytes", {"node": "n1"}) == 150e6
    assert get("kvfleet_fleet_host_session_bytes", {"node": "n1"}) == 40e3
    assert get("kvfleet_fleet_regenerations_total") == 3
    assert get("kvfleet_fleet_actor_restarts_total", {"kind": "host"}) == 1
    assert get("kvfleet_fleet_actor_restarts_total", {"kind": "session"}) == 3
    assert get("kvfleet_fleet_forks", {"mode": "shared"}) == 1 and get("kvfleet_fleet_forks", {"mode": "replayed"}) == 1
    with pytest.raises(InvalidArgument, match="--fleet-metrics-interval"):
        FleetMetricsPoller(lambda: None, Metrics(), interval_s=-1)


async def test_a_real_fleet_on_the_controllers_metrics(ray_cluster: None, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvfleet.db'}"
    ctl = await start_controller(url, None, fleet_metrics_interval_s=0)  # polled by hand below
    try:
        async with AsyncFleetClient(ctl.address, retry=NO_RETRY) as c:
            await c.create_session("a", SYSTEM)
            await c.create_session("b", SYSTEM)            # adopts a's 3 cached blocks
            await c.fork("a", "a-fork")                     # shares a's blocks copy-on-write
            [node] = {r.node for r in await c.sessions(fleet=True)}
            await asyncio.to_thread(ctl.ctx.fleet_metrics.poll)
            hit = ctl.ctx.metrics.registry.get_sample_value("kvfleet_fleet_radix_hit_rate", {"node": node})
            await asyncio.to_thread(kill_host, url, node)   # every kernel is lost with the host's process
            await c.append("b", " next turn")               # b is regenerated, then answered (a, a-fork: lost)
            await asyncio.to_thread(ctl.ctx.fleet_metrics.poll)
            rows = await c.sessions(fleet=True)
        get = ctl.ctx.metrics.registry.get_sample_value
        nodes = {r.node for r in rows}
        by_node = {n: sum(get("kvfleet_fleet_sessions", {"node": n, "state": s}) or 0
                          for s in ("active", "regenerated", "lost", "idle")) for n in nodes}
        print("sessions by node:", by_node, "| forks shared/replayed:",
              get("kvfleet_fleet_forks", {"mode": "shared"}), get("kvfleet_fleet_forks", {"mode": "replayed"}))
        assert sum(by_node.values()) == 3
        assert get("kvfleet_fleet_forks", {"mode": "shared"}) == 1
        assert get("kvfleet_fleet_forks", {"mode": "replayed"}) == 0
        assert get("kvfleet_fleet_regenerations_total") == 1
        assert get("kvfleet_fleet_actor_restarts_total", {"kind": "session"}) == 1
        assert sum(get("kvfleet_fleet_kv_bytes", {"node": n, "kind": "alone"}) for n in nodes) == \
            sum(r.bytes_alone for r in rows)
        rss = get("kvfleet_fleet_host_resident_bytes", {"node": next(iter(nodes))})
        assert rss and rss > 10 << 20                       # the host process's own /proc figure (numpy alone > 10 MiB)
        assert hit and hit > 0                              # b's create hit a's blocks (before the host died)
    finally:
        await ctl.stop(0)


def test_regenerations_never_fall_when_a_rebuilt_session_is_deleted() -> None:
    """The rebuild counters are Prometheus counters: deleting a session that was rebuilt (or
    creating a new one under its name) must not lower them (before: the live rows' sum, 3 -> 1)."""
    m = Metrics()
    rows = [{"tenant": "acme", "session": "a", "node": "n1", "state": "active", "regenerated": 2},
            {"tenant": "acme", "session": "b", "node": "n1", "state": "active", "regenerated": 1}]

    class Fleet(_Fleet):
        def list_sessions(self, fleet: bool = True) -> list[dict]:
            return rows

    poller = FleetMetricsPoller(lambda: Fleet(STATS), m, interval_s=0)
    get = m.registry.get_sample_value
    seen = []
    for now in ([rows[0], rows[1]],                                       # 2 + 1 rebuilds
                [rows[1]],                                                # a deleted: still 3
                [{**rows[0], "regenerated": 0}, {**rows[1], "regenerated": 2}],  # a again (new); b rebuilt once more
                [{**rows[0], "regenerated": 1}, {**rows[1], "regenerated": 2}]):  # the new a rebuilt once
        rows[:] = now
        poller.poll()
        seen.append((get("kvfleet_fleet_regenerations_total"),
                     get("kvfleet_fleet_actor_restarts_total", {"kind": "session"})))
    assert seen == [(3, 3), (3, 3), (4, 4), (5, 5)]


def test_docs_list_every_fleet_and_gc_family() -> None:
    """docs/metrics.md names every kernel-fleet and store-GC family the controller exports."""
    m = Metrics()
    poller = FleetMetricsPoller(lambda: _Fleet(STATS), m, interval_s=0)
    poller.poll()
    names = {s.name for fam in m.registry.collect() for s in fam.samples
             if s.name.startswith(("kvfleet_fleet_", "kvfleet_store_gc_")) and not s.name.endswith("_created")}
    names = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in names}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert len(names) == 16 and sorted(n for n in names if f"`{n}`" not in doc) == []


def _served(registry: CollectorRegistry) -> set[str]:
    """The family names a scrape of `registry` shows (a counter's with its _total)."""
    return {f"{fam.name}_total" if fam.type == "counter" else fam.name for fam in registry.collect()}


def _named(doc: str) -> set[str]:
    return set(re.findall(r"`(kvfleet_[a-z_]+)[`{]", doc))


def test_the_docs_name_every_family_the_controller_and_the_proxy_serve_and_no_other() -> None:
    """docs/metrics.md names every family of the controller's registry, docs/proxy.md every one of the proxy's, and
    neither names one that neither serves. NOTE: four were served and named nowhere (kvfleet_kv_blocks_refused_total,
    kvfleet_kv_events_over_budget_total, kvfleet_worker_errors_total, kvfleet_proxy_route_releases_total)."""
    m = Metrics()
    FleetMetricsPoller(lambda: _Fleet(STATS), m, interval_s=0).poll()  # the fleet families appear with a poll
    controller, proxy = _served(m.registry), _served(ProxyMetrics().registry)
    docs = Path(__file__).resolve().parents[2] / "docs"
    metrics_md, proxy_md = _named((docs / "metrics.md").read_text()), _named((docs / "proxy.md").read_text())
    assert (len(controller), len(proxy)) == (52, 18)  # control: both registries were read whole
    assert sorted(controller - metrics_md) == [] and sorted(proxy - proxy_md) == []
    assert sorted(metrics_md - controller - proxy) == [] and sorted(proxy_md - controller - proxy) == []
