"""Prometheus metrics of the controller (all `kvfleet_` prefixed), in one registry.

Every component imports its metric objects from here; `controller.main` serves `REGISTRY` on its
own port. A test may build a fresh `Metrics()` to read counters in isolation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

COST_BUCKETS = (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0)


class Metrics:
    """All controller metrics. One instance per controller process (tests may make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        # routing
        self.route_total = Counter(
            "kvfleet_route_total", "Route decisions by verdict.", ["verdict"], registry=r
        )
        self.route_latency = Histogram(
            "kvfleet_route_latency_seconds",
            "Time to answer one route request.",
            registry=r,
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5),
        )
        self.stale_route_guard = Counter(
            "kvfleet_stale_route_guard_total",
            "Chosen candidates refused at route time by the route-time probe (worker down, epoch changed, unregistered).",
            ["reason"],
            registry=r,
        )
        self.hit_rate = Gauge(
            "kvfleet_route_hit_rate", "Matched prompt tokens / routed prompt tokens.", registry=r
        )
        # placement by cost (controller/cost.py): the chosen cost and how close the runner-up came
        self.route_cost = Histogram(
            "kvfleet_route_cost_tokens",
            "Cost of the chosen candidate, in prefill-token units.",
            registry=r,
            buckets=COST_BUCKETS,
        )
        self.route_cost_margin = Histogram(
            "kvfleet_route_cost_margin_tokens",
            "Runner-up's cost minus the chosen candidate's, in prefill-token units (routes with a runner-up).",
            registry=r,
            buckets=COST_BUCKETS,
        )
        # NOTE: read when scraped (the router sets `inflight`), not set at every route and release: two labelled
        # gauges set per route were ~15 us of the controller's Route path (py-spy at 200 clients)
        self.inflight: Callable[[], Iterable[tuple[str, float, float]]] | None = None
        r.register(_Inflight(self))
        self.route_releases = Counter(
            "kvfleet_route_releases_total",
            "ReleaseRoute and MoveRoute calls by outcome (released, unknown; moved: MoveRoute took a route to another candidate).",
            ["outcome"],
            registry=r,
        )
        self.route_stream_messages = Counter(
            "kvfleet_route_stream_messages_total",
            "RouteStream messages received from callers and answers written to them (a message may carry releases).",
            ["direction"],
            registry=r,
        )
        self.kv_events_silent = Gauge(
            "kvfleet_kv_events_silent",
            "1 while a rank's worker computes prompts and none of its KV events arrive (its publisher is not where it "
            "was registered): its routes stay COLD.",
            ["worker", "dp_rank"],
            registry=r,
        )
        self.route_stream_writes = Counter(
            "kvfleet_route_stream_writes_total",
            "RouteStream writes received from callers and written to them (a write may carry several messages).",
            ["direction"],
            registry=r,
        )
        self.inflight_dropped = Counter(
            "kvfleet_route_inflight_dropped_total",
            "In-flight routes dropped without a release, by reason (ttl, reconcile, unregistered).",
            ["reason"],
            registry=r,
        )
        # lifecycle
        self.epoch_bumps = Counter(
            "kvfleet_epoch_bumps_total", "Epoch bumps by reason.", ["reason"], registry=r
        )
        self.lifecycle_actions = Counter(
            "kvfleet_lifecycle_actions_total", "Lifecycle verbs driven.", ["verb", "kv"], registry=r
        )
        self.lifecycle_settles = Counter(
            "kvfleet_lifecycle_settles_total",
            "Lifecycle verbs that waited (at most --route-reconcile-grace) for routes decided just before them to "
            "reach the worker.",
            registry=r,
        )
        self.reset_drains = Counter(
            "kvfleet_reset_drains_total",
            "Prefix-cache resets vLLM refused at first (requests held blocks), asked again while the worker "
            "drained, by outcome (reset, refused: still refused when --reset-drain-timeout ran out).",
            ["outcome"],
            registry=r,
        )
        # KV events
        self.kv_events = Counter(
            "kvfleet_kv_events_total", "KV events applied, by type.", ["type"], registry=r
        )
        self.kv_event_batches = Counter(
            "kvfleet_kv_event_batches_total", "KV event batches received.", registry=r
        )
        self.kv_event_gaps = Counter(
            "kvfleet_kv_event_gaps_total", "Sequence gaps seen on KV event streams.", registry=r
        )
        self.kv_event_replays = Counter(
            "kvfleet_kv_event_replays_total", "Replay requests sent, by outcome.", ["outcome"], registry=r
        )
        self.kv_event_replayed_batches = Counter(
            "kvfleet_kv_event_replayed_batches_total", "Batches recovered by replay.", registry=r
        )
        self.kv_event_decode_errors = Counter(
            "kvfleet_kv_event_decode_errors_total", "Undecodable KV event frames.", registry=r
        )
        self.kv_blocks_refused = Counter(
            "kvfleet_kv_blocks_refused_total",
            "Stored block hashes refused: the rank would hold more than its capacity bound.",
            registry=r,
        )
        self.worker_faulty = Gauge(
            "kvfleet_worker_faulty",
            "1 while a worker is faulty: over its KV-event budget, not routed to (--kv-max-events-per-s).",
            ["worker"],
            registry=r,
        )
        self.kv_events_over_budget = Counter(
            "kvfleet_kv_events_over_budget_total",
            "KV events refused because their worker was over its event budget.",
            registry=r,
        )
        self.worker_errors = Counter(
            "kvfleet_worker_errors_total",
            "Failures contained to one worker, by where (docs/metrics.md lists the places).",
            ["where"],
            registry=r,
        )
        # CAS
        self.cas_ops = Counter(
            "kvfleet_cas_ops_total", "Blob store operations.", ["op", "outcome"], registry=r
        )
        self.cas_bytes = Counter("kvfleet_cas_bytes_total", "Blob bytes moved.", ["direction"], registry=r)
        # quarantine / kernel witnesses
        self.quarantines = Counter("kvfleet_quarantines_total", "Tool results quarantined.", registry=r)
        self.quarantine_not_stored = Counter(
            "kvfleet_quarantine_not_stored_total",
            "Verdicts answered and not cached (kind=verdict), and quarantines not recorded (kind=record), by reason "
            "(tenant_bound: the tenant's space held --max-verdicts-per-tenant entries).",
            ["kind", "reason"],
            registry=r,
        )
        self.witness_max_delta = Gauge(
            "kvfleet_witness_max_abs_delta", "Last witness max|delta| by kind.", ["kind"], registry=r
        )
        # store GC (controller/store_gc.py; the leader runs it on a schedule)
        self.store_gc_runs = Counter(
            "kvfleet_store_gc_runs_total", "Store GC runs by outcome (ok, error).", ["outcome"], registry=r
        )
        self.store_gc_collected = Counter(
            "kvfleet_store_gc_collected_blobs_total",
            "Blobs deleted by GC (unpinned, unreferenced, lease run out).",
            registry=r,
        )
        self.store_gc_duration = Histogram(
            "kvfleet_store_gc_duration_seconds",
            "Time one store GC run took.",
            registry=r,
            buckets=(0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0),
        )
        self.store_gc_last_success = Gauge(
            "kvfleet_store_gc_last_success_timestamp_seconds",
            "Unix time of the last store GC run that succeeded (0: none yet).",
            registry=r,
        )
        # the store's own health (controller/store_probe.py)
        self.store_up = Gauge(
            "kvfleet_store_up",
            "1 while the last store probe (one read every 5 s by default) was answered within 2 s, else 0.",
            registry=r,
        )
        self.store_data_lost = Counter(
            "kvfleet_store_data_lost", "Times a store probe found the store had lost its data (its marker key gone).",
            registry=r,
        )
        self.rpc_errors = Counter(
            "kvfleet_rpc_errors_total", "RPCs answered with an error status.", ["method", "code"], registry=r
        )


class _Inflight(Collector):
    """kvfleet_route_inflight_requests and kvfleet_route_inflight_queued_tokens, per worker, read from the router's
    in-flight ledger when scraped (`Metrics.inflight`: (worker, routes, tokens) rows; none while not leading)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        requests = GaugeMetricFamily("kvfleet_route_inflight_requests",
                                     "Tracked routes not yet seen to end, per worker.", labels=["worker"])
        tokens = GaugeMetricFamily("kvfleet_route_inflight_queued_tokens",
                                   "Prefill tokens of tracked routes the worker has not been seen to schedule, per "
                                   "worker.", labels=["worker"])
        rows = self.metrics.inflight
        for worker, n, k in rows() if rows is not None else ():
            requests.add_metric([worker], n)
            tokens.add_metric([worker], k)
        yield requests
        yield tokens
