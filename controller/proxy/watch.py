"""What the requests waiting for one worker's first byte share: one /is_sleeping probe at a time, and the news
that the worker was found asleep (or gone), so that every one of them fails over at once.

    A, B, C sent to W ── each takes W's current Ticket before its send
    A: no first byte in time ──► probe(W) ─────────────┐  (B or C timing out meanwhile await that same probe)
                                                       │ asleep / unreachable / unresponsive
                                                       ▼
                                 lose(W): the Ticket's `wake` resolves ──► B and C fail over now, not at their
                                 own timeouts; requests sent to W after this take a new Ticket
    the controller stops listing W as serving ──► nudge(W): W's waiters probe now (one shared probe),
                                                  not at their own next timeout
    a Route for the same model names no rank of W ──► nudge(W), once a Ticket (routed): the controller knew
        (a KV event, its reconcile) before the proxy's next listing, up to --refresh later

NOTE: only a probe's finding (or the controller's word followed by a probe) fails the waiters over: a worker that
stops serving is first asked, as each request's own probe would ask it (docs/proxy.md, failover).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet

import aiohttp

ASLEEP, AWAKE, BUSY, GONE = "asleep", "awake", "busy", "unreachable"  # what a probe observed
Finding = tuple[str, str]  # (what a probe observed, a phrase saying so)


class Ticket:
    """One generation of a worker's waiters: `lost` says why they were given up (None: not given up), and
    `wake` resolves when they were given up or must probe now (then a fresh one replaces it)."""

    __slots__ = ("lost", "wake", "models", "routed", "__weakref__")

    def __init__(self) -> None:
        self.lost: str | None = None
        self.wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.models: set[str] = set()  # the model ids (or adapters) of the requests waiting under it
        self.routed = False  # nudged already because a Route named none of its worker's ranks

    def _wake(self) -> None:
        if not self.wake.done():
            self.wake.set_result(None)


class WorkerWatch:
    """Per worker: the current Ticket and the /is_sleeping probe in flight (at most one).

    NOTE: a Ticket is held by the attempts waiting under it, and kept here only while one does (weakly): a
    worker with no attempt waiting has no entry (before, every worker name ever sent to kept one for good).
    """

    def __init__(self) -> None:
        self._tickets: weakref.WeakValueDictionary[str, Ticket] = weakref.WeakValueDictionary()
        self._probes: dict[str, asyncio.Task[Finding]] = {}
        self.num_lost = 0  # lose() calls that gave up at least one waiting attempt's Ticket
        self.num_nudged = 0

    def ticket(self, worker: str, model: str | None = None) -> Ticket:
        """The Ticket an attempt sent to `worker` now waits under (shared by every such attempt); `model`: the
        request's model id (or adapter), for `routed`."""
        t = self._tickets.get(worker)
        if t is None:
            t = self._tickets[worker] = Ticket()
        if model is not None:
            t.models.add(model)
        return t

    def routed(self, model: str, workers: AbstractSet[str]) -> None:
        """A Route for `model` just named `workers` (every worker with a rank the controller calls serving for it): a
        worker with requests for `model` waiting on it that it does not name has stopped serving in the controller's
        view; its waiters probe now, once a Ticket (an awake one, still not routed to, is not asked again and again).
        NOTE: they waited for the proxy's next listing (--refresh, 1 s) or their own probe (up to
        --first-byte-timeout): three turns sent just as a worker was slept waited 0.25 s each before they failed over
        (the fleet-routing bench, agents16x8). Cost: nothing while no request waits; else a look at each worker with
        requests waiting."""
        if not self._tickets:
            return
        for worker, t in list(self._tickets.items()):
            if not t.routed and worker not in workers and model in t.models:
                t.routed = True
                self.nudge(worker)

    def lose(self, worker: str, why: str) -> None:
        """Every attempt sent to `worker` so far fails over (`why` is its reason); later sends get a new Ticket."""
        t = self._tickets.pop(worker, None)
        if t is not None:
            t.lost = why
            self.num_lost += 1
            t._wake()

    def nudge(self, worker: str) -> None:
        """`worker`'s waiters probe now (the controller stopped listing it as serving)."""
        t = self._tickets.get(worker)
        if t is not None and not t.wake.done():
            self.num_nudged += 1
            t._wake()
            t.wake = asyncio.get_running_loop().create_future()

    async def probe(self, worker: str, run: Callable[[], Awaitable[Finding]]) -> Finding:
        """`run()`'s finding for `worker`: a probe already in flight for it is joined, not repeated."""
        task = self._probes.get(worker)
        if task is None:
            task = self._probes[worker] = asyncio.ensure_future(run())
            task.add_done_callback(lambda done: self._forget(worker, done))
        # NOTE: shielded: a waiter that is cancelled (its client went away) leaves the probe to the others
        return await asyncio.shield(task)

    def _forget(self, worker: str, task: asyncio.Task[Finding]) -> None:
        if self._probes.get(worker) is task:
            del self._probes[worker]


class FirstBytes:
    """How soon a worker normally sends a first byte, so that a sleeper is probed after a few times that, not
    after a fixed timeout sized for slow prompts.

    Per worker, the waits of its last `window` answered attempts (send to first body byte). The first probe of
    an attempt comes `factor` x their 90th percentile after its send, within [floor_s, cap_s]; with fewer than
    `min_samples` waits seen (a new worker) it comes at cap_s. A sleeping worker answers nothing, so its window
    keeps its awake waits. NOTE: the probe's finding decides, not this wait: a worker that is only slower than
    usual answers "awake" and the attempt keeps waiting (one GET /is_sleeping spent).
    """

    def __init__(self, floor_s: float, cap_s: float, factor: float = 2.0, window: int = 64,
                 min_samples: int = 8) -> None:
        self.floor_s, self.cap_s, self.factor, self.min_samples = min(floor_s, cap_s), cap_s, factor, min_samples
        self._window = window
        self._waits: dict[str, deque[float]] = {}

    def seen(self, worker: str, wait_s: float) -> None:
        """An attempt on `worker` got its first byte `wait_s` after its send."""
        w = self._waits.get(worker)
        if w is None:
            w = self._waits[worker] = deque(maxlen=self._window)
        w.append(wait_s)

    def forget(self, worker: str) -> None:
        """`worker` is gone (unregistered): its waits go (a new worker of that name starts afresh)."""
        self._waits.pop(worker, None)

    def first_wait(self, worker: str) -> float:
        """Seconds after a send to `worker` before its first /is_sleeping probe."""
        w = self._waits.get(worker)
        if w is None or len(w) < self.min_samples or self.floor_s >= self.cap_s:
            return self.cap_s
        q = sorted(w)[(9 * len(w)) // 10]
        return min(self.cap_s, max(self.floor_s, self.factor * q))


async def ask_is_sleeping(http: aiohttp.ClientSession, url: str, timeout_s: float) -> Finding:
    """(what GET /is_sleeping observed, a phrase saying so): ASLEEP, AWAKE, BUSY or GONE.

    404 (vLLM without dev mode) means it cannot have been put to sleep: awake. No answer within
    timeout_s, or an answer that is not one, is BUSY (unknown): the worker may just be loaded.
    """
    try:
        async with http.get(url.rstrip("/") + "/is_sleeping", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status == 404:
                return AWAKE, "answered 404 (no dev mode: it cannot sleep)"
            doc = await r.json(content_type=None) if r.status == 200 else None
    except TimeoutError:
        return BUSY, f"did not answer within {timeout_s}s"
    except (aiohttp.ClientConnectionError, OSError) as e:
        if isinstance(e, aiohttp.ClientConnectorError):
            return GONE, f"could not connect ({e})"
        return BUSY, f"failed ({type(e).__name__}: {e})"
    except ValueError as e:
        return BUSY, f"answered something that is not JSON ({e})"
    if not isinstance(doc, dict) or not isinstance(doc.get("is_sleeping"), bool):
        return BUSY, f"answered {r.status} without an is_sleeping flag"
    return (ASLEEP, "says is_sleeping=true") if doc["is_sleeping"] else (AWAKE, "says is_sleeping=false")
