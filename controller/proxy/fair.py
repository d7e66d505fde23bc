"""Tenant-fair order on the workers: each request's vLLM `priority` is its place in a start-time fair queue of its
worker (`--fair-priority`).

vLLM runs its waiting requests in arrival order (--scheduling-policy fcfs, its default), so a tenant that sends
500 requests at once puts every other tenant's next request behind all 500. With --scheduling-policy priority it
runs the lowest `priority` first, ties in arrival order. Start-time fair queuing, per worker: each request gets a
tag one past its tenant's previous one, but never below the worker's virtual time V, the smallest tag in flight
there (or the largest given, with none in flight). Tenants' tags advance one per request, so their requests
interleave round-robin; and a tenant that arrives starts at V, ahead of every backlog. What is sent is the tag
minus V at the send: how far behind the worker's service the request queues, a small number that means the same
on every proxy replica (absolute tags grow with each replica's own traffic and could not be compared). As V moves
on, that difference can fall for a tenant's later request, which would then pass its earlier ones still waiting
(by up to 323 of its own in a simulation of a 64-client flood); so while a tenant has requests in flight on the
worker, what it is sent never falls below what it was sent last. In that simulation (vLLM's order over closed-loop
tenants, the test below) two busy tenants share a worker about evenly, and no request passes an earlier one of
its own tenant.

NOTE: two numberings were tried first (bench/tenant_fairness.py, tests/controller/proxy/test_proxy_fair_priority.py):
- the tenant's count of requests in flight on the worker: its new requests passed its older ones as those ended
  (the flood's 90th-percentile latency 6.9 s against 4.2);
- the tenant's peak of that count: with two busy tenants, the one with fewer clients took every free slot and
  the other got 3 answers in 6 s against 43 (review finding); both starve the larger backlog by strict priority.

The client's own `priority` is replaced: left as sent, a tenant could put itself ahead of every other. The
workers must run with --scheduling-policy priority. vLLM's V0 engine refuses a non-zero priority otherwise with a
400 ("Got priority N but Priority scheduling is not enabled."): the proxy then sends that request again without
one and sends that worker none for FCFS_RECHECK_S (`refused`). Its V1 engine may take the field and ignore it.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controller.proxy.forward import Opened

log = logging.getLogger("kvfleet.proxy")
FCFS_RECHECK_S = 300.0  # a worker found without the priority policy gets no priority this long (it may restart with it)
REFUSAL = re.compile(r"Got priority -?\d+ but Priority scheduling is not enabled\.?")  # vLLM's words, whole
MAX_ERROR_BYTES = 65536  # of a worker's 400 read to tell a refusal of the priority
MAX_PRUNED = 1024  # tenants' last tags kept per busy worker before those behind its virtual time are dropped
COMPACT_SLACK = 64  # ended tags a busy worker's heap may hold past twice its requests in flight before it is rebuilt


class _Queue:
    """One worker's fair queue, as this proxy sends to it."""

    __slots__ = ("floor", "gone", "inflight", "last", "tags", "top")

    def __init__(self) -> None:
        self.tags: list[int] = []        # tags in flight (heap; ended ones removed lazily, via `gone`)
        self.gone: Counter[int] = Counter()  # ended tags still in `tags`, with how many times (no zero counts)
        self.inflight = 0                # requests in flight: `tags` less `gone`
        self.last: dict[str, int] = {}   # tenant -> its last tag
        self.floor: dict[str, list[int]] = {}  # tenant with requests in flight -> [how many, the last priority sent]
        self.top = -1                    # the largest tag given

    def virtual_time(self) -> int:
        while self.tags and self.tags[0] in self.gone:
            self._drop(heapq.heappop(self.tags))
        return self.tags[0] if self.tags else self.top + 1

    def _drop(self, tag: int) -> None:
        self.gone[tag] -= 1
        if not self.gone[tag]:
            del self.gone[tag]

    def end(self, tag: int) -> None:
        """`tag`'s request ended. NOTE: an ended tag leaves the heap only when it reaches the top, so a request
        that stays in flight (a slow reader's stream) would keep every later one's tag; past twice the requests in
        flight (and some slack), the heap is rebuilt from those in flight alone, so it stays their size."""
        self.inflight -= 1
        self.gone[tag] += 1
        if len(self.tags) > 2 * self.inflight + COMPACT_SLACK:
            left = Counter(self.tags)
            left.subtract(self.gone)
            self.tags = sorted(left.elements())   # a sorted list is a heap
            self.gone.clear()


class FairPriority:
    """Per worker with requests in flight through this proxy: its fair queue."""

    def __init__(self) -> None:
        self.queues: dict[str, _Queue] = {}
        self.fcfs: dict[str, float] = {}  # worker -> when it refused a priority (monotonic)

    @staticmethod
    def body(fwd: dict[str, Any], priority: int | None) -> dict[str, Any]:
        """`fwd` with the proxy's `priority` (none: a worker that refuses one), never the client's."""
        out = {k: v for k, v in fwd.items() if k != "priority"}
        if priority is not None:
            out["priority"] = priority
        return out

    async def refused(self, opened: Opened) -> bool:
        """Whether a worker's answer refuses the priority it was sent; if so, the worker gets none for a while. A
        400 is read whole into `opened.first` first (an error is small; it is relayed as read if not a refusal).
        NOTE: the message must be vLLM's refusal alone: its 400s for other errors echo the client's input, and a
        tenant could otherwise write the phrase into one and switch the fairness off for everyone."""
        if opened.resp.status != 400:
            return False
        content = opened.resp.content
        while not content.at_eof() and len(opened.first) < MAX_ERROR_BYTES:
            opened.first += await content.read(MAX_ERROR_BYTES - len(opened.first))
        return self.refused_by(opened.target.worker, opened.first)

    def refused_by(self, worker: str, answer: bytes) -> bool:
        """Whether `answer` (a 400's body) is vLLM's refusal of a priority; if so, `worker` gets none for a while."""
        try:
            message = json.loads(answer)["error"]["message"]
        except (ValueError, TypeError, KeyError):
            return False
        if not isinstance(message, str) or not REFUSAL.fullmatch(message.strip()):
            return False
        if worker not in self.fcfs:
            log.warning("proxy: worker %s refuses request priorities (it runs without --scheduling-policy "
                        "priority): --fair-priority sends it none for %.0f s", worker, FCFS_RECHECK_S)
        self.fcfs[worker] = time.monotonic()
        return True

    @contextlib.contextmanager
    def claim(self, tenant: str, worker: str) -> Iterator[int | None]:
        """The request's priority (None: the worker refused one lately), in flight while the block runs."""
        since = self.fcfs.get(worker)
        if since is not None and time.monotonic() - since < FCFS_RECHECK_S:
            yield None
            return
        self.fcfs.pop(worker, None)
        q = self.queues.setdefault(worker, _Queue())
        v = q.virtual_time()
        tag = max(q.last.get(tenant, v - 1) + 1, v)
        q.last[tenant], q.top = tag, max(q.top, tag)
        heapq.heappush(q.tags, tag)
        q.inflight += 1
        if len(q.last) > MAX_PRUNED:   # a tenant behind V would start at V anyway
            q.last = {t: last for t, last in q.last.items() if last >= v}
        mine = q.floor.setdefault(tenant, [0, 0])
        mine[0] += 1
        mine[1] = max(tag - v, mine[1])   # NOTE: never below its earlier ones still in flight: they keep their place
        try:
            yield mine[1]
        finally:
            mine[0] -= 1
            if not mine[0]:
                del q.floor[tenant]
            if not q.floor:
                del self.queues[worker]   # none in flight: no backlog to remember
            else:
                q.end(tag)
