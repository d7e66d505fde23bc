"""The proxy's Prometheus metrics, in their own registry (served at GET /metrics)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ProxyMetrics:
    """requests, matched prefix tokens, added latency and retries, by worker and verdict."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvfleet_proxy_requests",
            "Requests answered, by serving worker, verdict and status",
            ["worker", "verdict", "status"],
            registry=r,
        )
        self.matched_tokens = Counter(
            "kvfleet_proxy_matched_prefix_tokens",
            "Prefix tokens the router matched on the serving worker",
            ["worker", "verdict"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvfleet_proxy_prompt_tokens", "Prompt tokens routed", ["worker", "verdict"], registry=r
        )
        self.added_latency = Histogram(
            "kvfleet_proxy_added_latency_seconds",
            "Time to first byte at the client minus the worker's own time to first byte",
            ["worker", "verdict"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvfleet_proxy_retries",
            "Failed first attempts retried on the next candidate",
            ["worker", "verdict", "reason"],
            registry=r,
        )
        self.reconnects = Counter(
            "kvfleet_proxy_reconnects",
            "Sends whose kept-alive connection the worker closed under them, sent again once on a fresh connection",
            ["worker"],
            registry=r,
        )
        self.broken = Counter(
            "kvfleet_proxy_broken_answers",
            "Answers a worker broke off after the client had begun to get them (ended with an error event, or cut)",
            ["worker"],
            registry=r,
        )
        self.skips = Counter(
            "kvfleet_proxy_skipped_workers",
            "Chosen workers skipped without sending (known not serving or found asleep)",
            ["worker", "reason"],
            registry=r,
        )
        self.probes = Counter(
            "kvfleet_proxy_sleep_probes",
            "GET /is_sleeping probes of a worker that sent no first byte in time or failed an attempt, by what "
            "they observed (asleep, awake, busy: no answer in time, unreachable); only asleep and unreachable "
            "fail over or mark the worker suspect",
            ["worker", "observed"],
            registry=r,
        )
        self.judged = Counter(
            "kvfleet_proxy_tool_results_judged",
            "Distinct tool results judged per request, by verdict and its source (detector, operator)",
            ["verdict", "source"],
            registry=r,
        )
        self.quarantined = Counter(
            "kvfleet_proxy_quarantined_tool_results",
            "Quarantined tool results kept from the workers, by action (placeholder, refuse) and source",
            ["action", "source"],
            registry=r,
        )
        self.tool_media = Counter(
            "kvfleet_proxy_tool_media_parts",
            "Media parts of tool results (no text detector can judge them), by type and what the proxy did "
            "(--tool-media: pass, withhold, refuse)",
            ["type", "action"],
            registry=r,
        )
        self.errors = Counter(
            "kvfleet_proxy_errors", "Requests the proxy answered with an error itself", ["status"], registry=r
        )
        self.releases = Counter(
            "kvfleet_proxy_route_releases",
            "Routes released to the controller when the answer ended, by outcome (released, unknown, failed)",
            ["outcome"],
            registry=r,
        )
        self.chains = Counter(
            "kvfleet_proxy_response_chains",
            "/v1/responses follow-ups checked for tool results quarantined since their chain was stored, by outcome "
            "(clean, quarantined: refused, unknown: the proxy has no record of the chain, answered)",
            ["outcome"],
            registry=r,
        )
        self.cancelled = Counter(
            "kvfleet_proxy_client_disconnects",
            "Client disconnects that cancelled the upstream request",
            ["worker"],
            registry=r,
        )

        # (requests, body bytes) holding the proxy's budget of bodies in flight now, read when scraped (the proxy sets
        # it to its BodyGate's totals): what a leak of that budget would show
        self.in_flight: Callable[[], tuple[int, int]] | None = None
        r.register(_InFlight(self))

    def forget_worker(self, worker: str) -> None:
        """Remove every series labelled with `worker` (the controller no longer lists it: unregistered)."""
        for m in vars(self).values():
            if isinstance(m, MetricWrapperBase):
                _remove_series(m, "worker", lambda w: w == worker)

    def keep_workers(self, listed: Collection[str]) -> None:
        """Remove every series labelled with a worker not in `listed` (the controller's listing, just taken).
        NOTE: forget_worker alone ran once, when the directory saw the worker gone; an answer it was still giving
        then counted under its name again (20 series) and nothing removed them: each pod that went away while
        serving left them on /metrics for good. The directory calls this at each refresh, so they go at the next."""
        for m in vars(self).values():
            if isinstance(m, MetricWrapperBase):
                _remove_series(m, "worker", lambda w: w not in listed)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove_series(metric: MetricWrapperBase, label: str, drop: Callable[[str], bool]) -> None:
    """Remove `metric`'s series whose `label` has a value `drop` says yes to: read off the metric's children by their
    label values (prometheus-client keeps no public accessor; `_labelnames` and `_metrics` are what `labels` and
    `remove` use). NOTE: read from `collect()`, every sample of every series was built on the event loop at each
    listing refresh: 5.3 ms a second with 64 workers' 640 series, where this takes 0.05 ms."""
    names = metric._labelnames  # noqa: SLF001
    if label not in names:
        return
    at = names.index(label)
    for values in [v for v in list(metric._metrics) if drop(v[at])]:  # noqa: SLF001
        with contextlib.suppress(KeyError):  # removed meanwhile (older prometheus-client raises)
            metric.remove(*values)


class _InFlight(Collector):
    """kvfleet_proxy_requests_in_flight and kvfleet_proxy_inflight_body_bytes, read from the proxy's budget of bodies
    in flight when scraped (`ProxyMetrics.in_flight`). NOTE: none was served, so a request that never gave back its
    reservation (its tenant refused 429 from then on) showed nowhere (found writing scripts/fuzz_proxy.py)."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        n, size = self.metrics.in_flight() if self.metrics.in_flight is not None else (0, 0)
        yield GaugeMetricFamily("kvfleet_proxy_requests_in_flight",
                                "Requests holding a reservation of the proxy's bodies in flight (admitted, answer not "
                                "ended)", value=n)
        yield GaugeMetricFamily("kvfleet_proxy_inflight_body_bytes",
                                "Request-body bytes those requests hold of --max-inflight-bytes", value=size)
