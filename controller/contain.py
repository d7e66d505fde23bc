"""Per-worker failure containment: count every failure, log it once, never let it spread.

One worker's bad state (a corrupt persisted record, a junk answer, a bug its data triggers) must
not abort `Router.start`, fail a fleet listing or stop another worker's reconcile. Each place
that runs per-worker code catches there, counts `kvfleet_worker_errors_total{where}` and logs
the first failure of a (worker, where) with its traceback; repeats are counted but not logged
until that place succeeds again (a reconcile failing every tick would otherwise flood the log).
"""

from __future__ import annotations

import logging

from controller.metrics import Metrics

log = logging.getLogger(__name__)


class Contained:
    """Failure bookkeeping for one worker: which places are failing now, each logged once."""

    def __init__(self, metrics: Metrics, worker: str) -> None:
        self.metrics, self.worker = metrics, worker
        self.failing: dict[str, str] = {}  # where -> first error text since it last worked

    def failed(self, where: str, exc: BaseException) -> None:
        """Count one failure at `where`; log it (with traceback) only if `where` was healthy."""
        self.metrics.worker_errors.labels(where).inc()
        if where in self.failing:
            return
        self.failing[where] = f"{type(exc).__name__}: {exc}"
        log.error("worker %s: %s failed (contained to this worker; logged once until it recovers)",
                  self.worker, where, exc_info=exc)

    def ok(self, where: str) -> None:
        """`where` worked: a later failure is news again."""
        if self.failing.pop(where, None) is not None:
            log.info("worker %s: %s works again", self.worker, where)
