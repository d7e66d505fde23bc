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
workers must run with --scheduling-policy priority (vLLM refuses a non-zero priority otherwise: 400).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class FairPriority:
    """Per (tenant, worker) with requests in flight: [how many, the priority its next request gets at least]."""

    def __init__(self) -> None:
        self.busy: dict[tuple[str, str], list[int]] = {}

    @contextlib.contextmanager
    def claim(self, tenant: str, worker: str) -> Iterator[int]:
        """The request's priority, its request counted in flight while the block runs."""
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
