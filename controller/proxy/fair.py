"""Tenant-fair order on the workers: each request's vLLM `priority` is the most requests its tenant has had in
flight through this proxy on the same worker since it last had none (`--fair-priority`).

vLLM runs its waiting requests in arrival order (--scheduling-policy fcfs, its default), so a tenant that sends
500 requests at once puts every other tenant's next request behind all 500. With --scheduling-policy priority it
runs the lowest `priority` first, ties in arrival order. So a tenant with one request at a time sends 0, and one
that floods a worker sends 0, 1, 2, ... up to its peak and then its peak: another tenant's request goes ahead of
the flood's backlog, while the flood's own requests keep their arrival order (the number never falls while the
tenant has requests in flight there: numbering by the count alone let a flood's new requests pass its older
ones as those ended, and its 90th-percentile latency rose from 4.2 s to 6.9 s in bench/tenant_fairness.py).
The client's own `priority` is replaced: left as sent, a tenant could put itself ahead of every other.

Counted per proxy process, and the numbers stay comparable between replicas (a tenant's peak on each). The
workers must run with --scheduling-policy priority. One that does not refuses a non-zero priority with a 400
("Priority scheduling is not enabled"): the proxy then sends that request again without it, logs it, and sends
that worker none for FCFS_RECHECK_S (`refused`), so a misconfigured worker loses the fairness, not requests.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

log = logging.getLogger("kvfleet.proxy")
FCFS_RECHECK_S = 300.0  # a worker found without the priority policy gets no priority this long (it may restart with it)
REFUSED = b"Priority scheduling is not enabled"  # vLLM's words (and the stand-in's)


class FairPriority:
    """Per (tenant, worker) with requests in flight: [how many, the priority its next request gets at least]."""

    def __init__(self) -> None:
        self.busy: dict[tuple[str, str], list[int]] = {}
        self.fcfs: dict[str, float] = {}  # worker -> when it refused a priority (monotonic)

    def refused(self, worker: str, answer: bytes) -> bool:
        """Whether `answer` (a 400's first bytes) is a worker refusing a priority; if so, it gets none for a while."""
        if REFUSED not in answer:
            return False
        if worker not in self.fcfs:
            log.warning("proxy: worker %s refuses request priorities (it runs without --scheduling-policy "
                        "priority): --fair-priority sends it none for %.0f s", worker, FCFS_RECHECK_S)
        self.fcfs[worker] = time.monotonic()
        return True

    @contextlib.contextmanager
    def claim(self, tenant: str, worker: str) -> Iterator[int | None]:
        """The request's priority (None: the worker refused one lately), counted in flight while the block runs."""
        since = self.fcfs.get(worker)
        if since is not None and time.monotonic() - since < FCFS_RECHECK_S:
            yield None
            return
        self.fcfs.pop(worker, None)
        key = (tenant, worker)
        st = self.busy.setdefault(key, [0, 0])
        priority = st[1] = max(st[0], st[1])
        st[0] += 1
        try:
            yield priority
        finally:
            st[0] -= 1
            if not st[0]:
                del self.busy[key]
