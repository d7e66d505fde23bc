"""Prometheus metrics of the kernel fleet (the kernel hosts holding sessions), exported by the controller.

    poller = FleetMetricsPoller(lambda: ctx.kernel_fleet, metrics, interval_s=15)
    await poller.start()          # every interval: list the fleet (as `session ls --fleet` does)
                                  # and the nodes' cache stats, off the event loop
    FleetCollector(poller)        # registered in Metrics.registry: a scrape reads the last snapshot

A scrape never waits on Ray: it renders the snapshot the poller took last. Until a fleet exists
(the first session call builds it) the fleet families are simply absent. Families (docs/metrics.md):

    kvfleet_fleet_sessions{node,state}              sessions per node and lifecycle state
    kvfleet_fleet_kv_bytes{node,kind}               KV bytes held: kind=alone (private) | shared (adopted)
    kvfleet_fleet_radix_hit_rate{node}              radix prefix cache: hit tokens / queried tokens
    kvfleet_fleet_radix_cached_tokens{node}         tokens cached in the node's radix tree
    kvfleet_fleet_radix_capacity_tokens{node}       its capacity
    kvfleet_fleet_radix_evicted_blocks_total{node}  blocks the tree evicted
    kvfleet_fleet_host_resident_bytes{node}         the node's kernel host process: resident memory
    kvfleet_fleet_host_session_bytes{node}          its growth since the weights were loaded, per session it holds
    kvfleet_fleet_regenerations_total               sessions rebuilt from their op log (their kernel lost)
    kvfleet_fleet_actor_restarts_total{kind}        kind=session (lost kernel rebuilt) | host (Ray restart seen)
    kvfleet_fleet_forks{mode}                       live forks: mode=shared (adopted the parent's blocks) | replayed
    kvfleet_fleet_fork_adopted_tokens               tokens those forks adopted instead of computing
    kvfleet_fleet_poll_errors_total                 polls that failed (the last snapshot stays)
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.metrics import Metrics
from controller.periodic import Periodic
from fleet.core.errors import InvalidArgument

log = logging.getLogger("kvfleet.controller.fleet_metrics")
DEFAULT_FLEET_METRICS_INTERVAL_S = 15.0


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """What one poll saw. Keys are label tuples; every count is exact for that instant."""

    sessions: dict[tuple[str, str], int] = field(default_factory=dict)       # (node, state)
    kv_bytes: dict[tuple[str, str], int] = field(default_factory=dict)       # (node, alone|shared)
    nodes: dict[str, dict[str, float]] = field(default_factory=dict)         # node -> radix stats
    regenerations: int = 0
    forks: dict[str, int] = field(default_factory=dict)                     # shared | replayed
    fork_adopted_tokens: int = 0


def snapshot(rows: Sequence[dict[str, Any]], node_stats: Sequence[dict[str, Any]]) -> FleetSnapshot:
    """Aggregate `KernelFleet.list_sessions(fleet=True)` rows and `node_stats()` (pure).

    A row's `regenerated` (kept in the session registry) counts the times its actor was rebuilt;
    `regenerations` sums it over the sessions listed (the exported counter is the poller's, which
    never falls). A fork is `shared` when it adopted blocks."""
    sessions: Counter[tuple[str, str]] = Counter()
    kv: Counter[tuple[str, str]] = Counter()
    forks: Counter[str] = Counter()
    regenerations = adopted = 0
    for r in rows:
        node = str(r.get("node") or "-")
        sessions[(node, str(r.get("state") or "unknown"))] += 1
        kv[(node, "alone")] += int(r.get("bytes_alone", 0) or 0)
        kv[(node, "shared")] += int(r.get("bytes_shared", 0) or 0)
        regenerations += int(r.get("regenerated", 0) or 0)
        if r.get("parent"):
            n = int(r.get("adopted_tokens", 0) or 0)
            forks["shared" if n > 0 else "replayed"] += 1
            adopted += n
    nodes = {str(s["node"]): {k: float(s.get(k, 0) or 0) for k in
                              ("hit_rate", "cached_tokens", "capacity_tokens", "evicted_blocks",
                               "resident_bytes", "session_bytes")}
             for s in node_stats}
    return FleetSnapshot(dict(sessions), dict(kv), nodes, regenerations, dict(forks), adopted)


class FleetMetricsPoller:
    """Polls the fleet every `interval_s` (0: never) and keeps the last snapshot."""

    def __init__(self, fleet: Callable[[], Any], metrics: Metrics,
                 interval_s: float = DEFAULT_FLEET_METRICS_INTERVAL_S) -> None:
        if not interval_s >= 0 or interval_s == float("inf"):
            raise InvalidArgument(f"--fleet-metrics-interval must be a finite number of seconds >= 0 (0: off), "
                                  f"got {interval_s}")
        self._fleet, self.metrics, self.interval_s = fleet, metrics, interval_s
        self.last: FleetSnapshot | None = None
        self.num_errors = 0
        self.host_restarts = 0
        self.regenerations = 0  # monotonic: a deleted session never takes its rebuilds back
        self._pids: dict[str, int] = {}
        self._regenerated: dict[tuple[str, str], int] = {}  # (tenant, session) -> its count last poll
        self._schedule = Periodic("kvfleet-fleet-metrics", interval_s, lambda: asyncio.to_thread(self.poll),
                                  self._failed)
        metrics.registry.register(FleetCollector(self))

    def poll(self) -> FleetSnapshot | None:
        """One poll (blocking: run it in a thread). None while no fleet exists."""
        fleet = self._fleet()
        if fleet is None:
            return None
        stats = fleet.node_stats()
        self._count_host_restarts(stats)
        rows = fleet.list_sessions(fleet=True)
        self._count_regenerations(rows)
        self.last = snapshot(rows, stats)
        return self.last

    def _count_regenerations(self, rows: Sequence[dict[str, Any]]) -> None:
        """Add each session's rebuilds since the last poll. The rows' own counts sum over live
        sessions only, so exporting that sum would make a counter fall when a session that was
        rebuilt is deleted (Prometheus reads a fall as a reset and rate() spikes)."""
        seen: dict[tuple[str, str], int] = {}
        for r in rows:
            key, n = (str(r.get("tenant", "")), str(r.get("session", ""))), int(r.get("regenerated", 0) or 0)
            self.regenerations += max(0, n - self._regenerated.get(key, 0))  # a new session of an old name: 0
            seen[key] = n
        self._regenerated = seen

    def _count_host_restarts(self, stats: Sequence[dict[str, Any]]) -> None:
        """A host answering from another process than last time was restarted by Ray."""
        for s in stats:
            node, pid = str(s["node"]), s.get("pid")
            if pid is None:
                continue
            if node in self._pids and self._pids[node] != pid:
                self.host_restarts += 1
            self._pids[node] = int(pid)

    def _failed(self, e: Exception) -> None:  # counted; the last snapshot stays
        self.num_errors += 1
        log.warning("fleet metrics poll failed: %s", e)

    async def start(self) -> None:
        await self._schedule.start()

    async def stop(self) -> None:
        await self._schedule.stop()


class FleetCollector(Collector):
    """Renders the poller's last snapshot at scrape time (never calls Ray)."""

    def __init__(self, poller: FleetMetricsPoller) -> None:
        self.poller = poller

    def collect(self) -> Iterator[Metric]:
        p = self.poller
        errors = CounterMetricFamily("kvfleet_fleet_poll_errors", "Fleet metric polls that failed.")
        errors.add_metric([], p.num_errors)
        yield errors
        s = p.last
        if s is None:
            return
        yield from _sessions(s, p.regenerations)
        yield from _nodes(s)
        restarts = CounterMetricFamily("kvfleet_fleet_actor_restarts",
                                       "Replaced: session (its kernel lost, rebuilt from its log), host "
                                       "(restarted by Ray, seen by the poller).", labels=["kind"])
        restarts.add_metric(["session"], p.regenerations)
        restarts.add_metric(["host"], p.host_restarts)
        yield restarts


def _sessions(s: FleetSnapshot, regenerations: int) -> Iterator[Metric]:
    g = GaugeMetricFamily("kvfleet_fleet_sessions", "Sessions per node and state.", labels=["node", "state"])
    for (node, state), n in sorted(s.sessions.items()):
        g.add_metric([node, state], n)
    yield g
    kv = GaugeMetricFamily("kvfleet_fleet_kv_bytes", "KV bytes held by sessions per node: alone (private) or "
                           "shared (adopted blocks).", labels=["node", "kind"])
    for (node, kind), n in sorted(s.kv_bytes.items()):
        kv.add_metric([node, kind], n)
    yield kv
    regen = CounterMetricFamily("kvfleet_fleet_regenerations", "Sessions rebuilt from their op log.")
    regen.add_metric([], regenerations)
    yield regen
    forks = GaugeMetricFamily("kvfleet_fleet_forks", "Live forks by how they were built: shared (adopted the "
                              "parent's blocks copy-on-write) or replayed (recomputed).", labels=["mode"])
    for mode in ("shared", "replayed"):
        forks.add_metric([mode], s.forks.get(mode, 0))
    yield forks
    adopted = GaugeMetricFamily("kvfleet_fleet_fork_adopted_tokens", "Tokens live forks adopted instead of "
                                "computing them.")
    adopted.add_metric([], s.fork_adopted_tokens)
    yield adopted


def _nodes(s: FleetSnapshot) -> Iterator[Metric]:
    fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "hit_rate": GaugeMetricFamily("kvfleet_fleet_radix_hit_rate", "Radix prefix cache hit tokens / "
                                      "queried tokens, per node.", labels=["node"]),
        "cached_tokens": GaugeMetricFamily("kvfleet_fleet_radix_cached_tokens", "Tokens cached in the node's "
                                           "radix tree.", labels=["node"]),
        "capacity_tokens": GaugeMetricFamily("kvfleet_fleet_radix_capacity_tokens", "Capacity of the node's "
                                             "radix tree, in tokens.", labels=["node"]),
        "evicted_blocks": CounterMetricFamily("kvfleet_fleet_radix_evicted_blocks", "Blocks the node's radix "
                                              "tree evicted.", labels=["node"]),
        "resident_bytes": GaugeMetricFamily("kvfleet_fleet_host_resident_bytes", "Resident memory of the node's "
                                            "kernel host process (every session it holds, the weights once).",
                                            labels=["node"]),
        "session_bytes": GaugeMetricFamily("kvfleet_fleet_host_session_bytes", "The host's resident memory growth "
                                           "since its weights were loaded, per session it holds (KV + bookkeeping).",
                                           labels=["node"]),
    }
    for node, stats in sorted(s.nodes.items()):
        for key, fam in fams.items():
            fam.add_metric([node], stats[key])
    yield from fams.values()
