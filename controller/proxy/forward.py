"""Send a routed request to a worker and fail over once before the first byte (the answer is relayed by relay.py).

    chosen worker ──POST──► first byte in time (below)? ─────── yes ──► relay bytes as they come
         │                        │ no
         │                        ▼
         │                 GET /is_sleeping ── awake (busy, e.g. a long non-streaming answer) ──► keep waiting
         │                        │            no answer in probe_timeout_s (busy: unknown)  ──► keep waiting,
         │                        │                                                    probe again later
         │                        │ is_sleeping true, the probe's connection refused, or no answer
         │                        │ from a worker the controller no longer lists as serving
         ▼                        ▼
    connection error / 503 ─► one retry on the next serving candidate; the worker is marked suspect (later
                              requests skip it) only if a probe found it asleep or unreachable, or after
                              cfg.suspect_after_failures failed attempts in a row that no probe explained
    (a connection the worker closes under the send is first sent once more, fresh, to the same worker)

vLLM queues requests to a sleeping engine and they hang (reference §1.3), and a streaming vLLM
may send its headers before the engine runs, so "first byte" means the first body bytes. "In time" is
twice the worker's recent 90th-percentile first-byte wait, within [first_byte_min_s, first_byte_timeout_s]
(FirstBytes, controller/proxy/watch.py): a worker that answers short prompts in 20 ms and stops answering is
asked after 50 ms, not 250.
NOTE: only a sleeping answer, a refused connection, or silence from a worker the controller has stopped
listing as serving (a frozen process: its reconcile lost /health) fails an attempt over, and so does no
first byte within max_first_byte_wait_s (the overall bound per attempt) unless a probe found the worker awake:
then the request ends there with a 504 (Forwarder._past_deadline). A probe that
times out says the worker is busy or unknown, not asleep: a loaded vLLM answers /is_sleeping slowly, and
failing over every slow worker turned load into 503s (#13 finding 8).
The requests waiting on one worker share its probe and its finding (controller/proxy/watch.py): a probe that
gives the worker up fails every attempt waiting on it over at once, and a worker the controller stops listing
as serving is probed at once for all of them, unless it lists it draining: a pause with mode=wait, or a reset that
does not preempt, of its own runs there, and what runs there is answered there ("asleep" or "busy" gives nothing
up; Forwarder._drains); the drain's end (listed paused or sleeping) nudges the rest, queued there till the resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import aiohttp

from controller.proxy.config import ProxyConfig
from controller.proxy.directory import WorkerDirectory
from controller.proxy.errors import ProxyError
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.targets import Target, targets
from controller.proxy.upstream import AttemptFailed, Upstream, discard
from controller.proxy.watch import ASLEEP, AWAKE, BUSY, GONE, FirstBytes, Ticket, ask_is_sleeping
from fleet.sdk.types import RouteDecision

log = logging.getLogger("kvfleet.proxy")

FORWARDED = ("Accept", "Accept-Encoding", "X-Request-Id", "traceparent", "tracestate")  # client -> worker
MAX_SENDS = 2  # the chosen worker, then ONE retry
# what a client's 503 says of each worker tried or skipped, by the failure's kind (its metric reason); the worker's
# name, its address and the error's text go to the log (NOTE: they went to every tenant's client; found by review)
SAID = {"suspect": "a worker skipped: found asleep, unreachable or failing moments ago",
        "not_serving": "a worker skipped: not serving", "moved": "a worker skipped: not serving, the controller says",
        "asleep": "a worker asleep", "unreachable": "a worker unreachable",
        "unresponsive": "a worker unresponsive, and the controller no longer lists it as serving",
        "503": "a worker answered 503", "connect": "a worker's connection failed",
        "broken": "a worker's connection broke before its answer began",
        "timeout": "a worker sent no first byte within the proxy's limit"}
MAX_PROBE_GAP = 8  # re-probe a busy worker after first_byte_timeout_s x 1, 2, 4 .. 8 (then every 8) ..
MAX_PROBE_WAIT_S = 8.0  # .. or, past that, doubling up to 8 s apart: a long answer is not probed more often with
# a short first-byte timeout (0.25 s) than with the old default's (1 s)


@dataclass(slots=True)
class Opened:
    """An upstream response whose first body bytes arrived (t_sent/t_first: perf_counter seconds)."""

    target: Target
    resp: aiohttp.ClientResponse
    first: bytes
    t_sent: float
    t_first: float
    num_sends: int
    failures: tuple[str, ...]


def probe_waits(first_byte_timeout_s: float, first_s: float | None = None) -> Iterator[float]:
    """The waits for a first byte between /is_sleeping probes: `first_s` (default: the timeout), then doubling up
    to MAX_PROBE_GAP timeouts or MAX_PROBE_WAIT_S, whichever is longer, then that for ever."""
    wait = first_byte_timeout_s if first_s is None else first_s
    cap = max(first_byte_timeout_s * MAX_PROBE_GAP, MAX_PROBE_WAIT_S)
    while True:
        yield wait
        wait = min(wait * 2, cap)


class Forwarder:
    """`http` is the proxy's pooled session to the workers, `fresh` one that opens a new connection per request
    (TCPConnector(force_close=True)): a send the worker's closing of its connection cut off is repeated on it once
    (None: not repeated; the sends: controller/proxy/upstream.py)."""

    def __init__(self, cfg: ProxyConfig, directory: WorkerDirectory, http: aiohttp.ClientSession,
                 metrics: ProxyMetrics, fresh: aiohttp.ClientSession | None = None) -> None:
        self.cfg, self.directory, self.http, self.metrics = cfg, directory, http, metrics
        self.upstream = Upstream(http, fresh, cfg.connect_timeout_s, metrics)
        self.first_bytes = FirstBytes(cfg.first_byte_min_s, cfg.first_byte_timeout_s)

    async def open(self, path: str, body: bytes, d: RouteDecision, base: str, headers: dict[str, str],
                   on_send: Callable[[Target], Awaitable[bool]] | None = None, name: str | None = None) -> Opened:
        """Open the request on the chosen worker or, after one failure before the first byte, the next one.

        The chosen worker is skipped only if this proxy found it asleep or gone (suspect) since the controller
        last saw it begin a new life: the route was decided just now, so it is fresher than the directory's
        listing (polled every --refresh), which lags a verb's return to serving by up to that long. A runner-up
        is skipped when the listing says it is not serving, too. `on_send` is told each target before the
        request is sent to it (the proxy tells the controller that its route moves there) and answers whether
        it may go there: False (the controller says a runner-up is not serving now) skips it as not serving.
        `name`: the request's model id; a fallback must list it (`targets`).
        """
        failures: list[str] = []
        said: list[str] = []  # the same, as the client is told them: no worker names, addresses or errors
        sends = 0
        for t in targets(d, self.directory, base, name):
            if sends == MAX_SENDS:
                break
            chosen = t.worker == d.worker
            suspect = self.directory.is_suspect(t.worker, d.epoch if chosen else None, t.dp_rank)
            if suspect or (not chosen and t.worker in self.directory.workers and not self.directory.serving(t.worker)):
                reason = "suspect" if suspect else "not_serving"
                self.metrics.skips.labels(t.worker, reason).inc()
                failures.append(f"{t.worker}: skipped ({reason})")
                said.append(SAID[reason])
                continue
            if on_send is not None and not await on_send(t):
                self.metrics.skips.labels(t.worker, "not_serving").inc()
                failures.append(f"{t.worker}: skipped (not serving, the controller says)")
                said.append(SAID["moved"])
                continue
            sends += 1
            try:
                return await self._attempt(t, path, body, headers, sends, failures, name or base)
            except AttemptFailed as e:
                found = await self._judge(t, e)
                self.metrics.retries.labels(t.worker, t.verdict, str(e).split(":")[0]).inc()
                failures.append(f"{t.worker}: {e}" + (f", then {found}" if found else ""))
                said.append(SAID.get((found or str(e)).split(":")[0], "a worker failed"))
        log.warning("proxy: %s: no serving worker answered (%s)", path, "; ".join(failures or ["no candidate"]))
        raise ProxyError(503, "no serving worker answered (" + "; ".join(said or ["no candidate"]) + "); retry shortly")

    async def _attempt(self, t: Target, path: str, body: bytes, headers: dict[str, str], sends: int,
                       failures: list[str], model: str) -> Opened:
        ticket = self.directory.watch.ticket(t.worker, model)  # taken before the send: a finding after it covers it
        t_sent = time.perf_counter()
        task = asyncio.create_task(self.upstream.open(t, t.url.rstrip("/") + path, body, headers))
        try:
            await self._wait_first_byte(t, task, ticket)
            resp, first = await task
        except BaseException:
            await discard(task)
            raise
        t_first = time.perf_counter()
        self.first_bytes.seen(t.worker, t_first - t_sent)
        self.directory.answered(t.worker)
        return Opened(t, resp, first, t_sent, t_first, sends, tuple(failures))

    async def _wait_first_byte(self, t: Target, task: asyncio.Task[tuple[aiohttp.ClientResponse, bytes]],
                               ticket: Ticket) -> None:
        """Wait for `task`'s first byte; fail the attempt only if a probe finds the worker asleep or gone.

        The probe is shared with every request waiting on the same worker (WorkerWatch), and so is its finding:
        one request's probe that gives the worker up gives up all the attempts waiting on it (`ticket`).
        """
        start = time.monotonic()
        deadline = start + self.cfg.max_first_byte_wait_s
        waits = probe_waits(self.cfg.first_byte_timeout_s, self.first_bytes.first_wait(t.worker))
        wait, awake = next(waits), False
        while True:
            left, wake = deadline - time.monotonic(), ticket.wake  # NOTE: a nudge replaces ticket.wake
            either: set[asyncio.Future[Any]] = {task, wake}
            done, _ = await asyncio.wait(either, timeout=max(min(wait, left), 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return
            if ticket.lost is not None:
                raise AttemptFailed(ticket.lost, found=True)
            nudged = wake in done  # the controller stopped listing it: probe now, then keep the schedule
            at_deadline = not nudged and time.monotonic() >= deadline
            seen, detail = await self.directory.watch.probe(t.worker, lambda: self._probe_counted(t))
            drains = seen != GONE and await self._drains(t, seen)
            what = f"no first byte after {time.monotonic() - start:.2f}s"
            why = None if drains else self._verdict(t, seen, detail, what)
            if ticket.lost is not None:  # another waiter judged the same finding first
                raise AttemptFailed(ticket.lost, found=True)
            if why is not None:
                self.directory.watch.lose(t.worker, f"{why} (found for another request waiting on it)")
                raise AttemptFailed(why, found=True)
            awake = awake or seen == AWAKE or drains  # draining: it is working on the request
            if at_deadline:
                self._past_deadline(t, awake)
            if not nudged:
                wait = next(waits)

    def _past_deadline(self, t: Target, awake: bool) -> NoReturn:
        """No first byte within --max-first-byte-wait, and the last probe found the worker neither asleep nor gone.

        Raises:
            ProxyError(504): a probe of this attempt found the worker awake: it is working on the request (a long
                non-streamed answer sends no byte until it is complete). The request ends here, stopped on the
                worker, which is not marked: sent again elsewhere it would start from scratch.
            AttemptFailed: no probe found it awake (none answered in time): the overall bound on a worker that holds
                the connection but never answers (a dead engine behind a live socket) while the controller still
                lists it. It fails over, and counts toward the worker's failures in a row.
        NOTE: every attempt past the bound failed over and marked its worker suspect: a non-streamed answer longer
        than the bound was stopped on the worker nearly done with it, sent again from scratch to a second worker,
        stopped there too, and ended in a 503 after twice the bound, both workers then refused to everyone
        (found by review)."""
        limit = self.cfg.max_first_byte_wait_s
        if not awake:
            raise AttemptFailed(f"timeout: no first byte within {limit}s (the proxy's --max-first-byte-wait) and no "
                                "probe found the worker awake", found=False)
        log.warning("proxy: worker %s, awake, sent no first byte within %ss (--max-first-byte-wait): the request "
                    "ends in a 504", t.worker, limit)
        raise ProxyError(504, f"the worker did not begin its answer within {limit:g}s, the proxy's limit; it was "
                              "still working on it, and the request was stopped, not sent elsewhere. A long answer: "
                              "send it with \"stream\": true, or ask for fewer tokens")

    async def _drains(self, t: Target, seen: str) -> bool:
        """Whether the controller drains the worker (a pause with mode=wait, a reset that does not preempt): the
        request sent there is answered there, so a probe finding it "asleep" (what vLLM says during a pause) or too
        busy to answer gives nothing up. Found asleep while the listing says otherwise, the controller is asked now
        (drains_now)."""
        if self.directory.draining(t.worker):
            return True
        return seen == ASLEEP and await self.directory.drains_now(t.worker)

    def _verdict(self, t: Target, seen: str, detail: str, what: str) -> str | None:
        """Why a probe's finding gives the worker up (the attempt's failure reason), or None: keep waiting.
        `what` says what came before the probe (no first byte after some time, or a failed send). A worker the
        controller lists draining is not given up unless unreachable: the requests waiting on it are answered there
        (a failed send to it, a new request that met the pause, fails over alone)."""
        if seen != GONE and self.directory.draining(t.worker):
            return None
        if seen in (ASLEEP, GONE):
            return f"{seen}: {what} and GET /is_sleeping {detail}"
        if seen == BUSY and t.worker in self.directory.workers and not self.directory.serving(t.worker):
            # NOTE: busy is the benefit of the doubt; a worker the controller no longer calls serving (its
            # reconcile lost /health, or it was slept) and that does not answer a probe is given up on
            return (f"unresponsive: {what}, GET /is_sleeping {detail}, and the controller "
                    "no longer lists it as serving")
        return None

    async def _judge(self, t: Target, e: AttemptFailed) -> str | None:
        """Mark the failed worker suspect (later requests skip it until the controller catches up) only on evidence
        that it is asleep or gone: a probe's finding, before the failure or asked now (shared with the requests
        waiting on it, which fail over with it). A failure no probe explains (awake, or busy) counts toward
        cfg.suspect_after_failures in a row (WorkerDirectory.failed). Returns what the probe asked now found
        (asleep, unreachable ...: it says more than the failure did), or None.
        NOTE: every failure marked it, so one 503 or one lost connection from an awake worker refused every
        tenant's requests to it, unsent, for --suspect seconds: a model of two workers with one blip on each was
        down for 5 s (found by review)."""
        why = None
        if e.found is None:
            seen, detail = await self.directory.watch.probe(t.worker, lambda: self._probe_counted(t))
            why = self._verdict(t, seen, detail, f"a failed send ({str(e).split(':')[0]})")
            if why is not None:
                self.directory.watch.lose(t.worker, f"{why} (found for another request sent to it)")
        if e.found or why is not None:
            self.directory.suspect(t.worker, t.epoch, t.dp_rank)
        elif self.directory.failed(t.worker, t.epoch, t.dp_rank):
            log.warning("proxy: worker %s failed %d attempts in a row, no probe finding it asleep or gone; skipped "
                        "for %ss (last: %s)",
                        t.worker, self.cfg.suspect_after_failures, self.cfg.suspect_s, e)
        return why

    async def _probe_counted(self, t: Target) -> tuple[str, str]:
        seen, detail = await ask_is_sleeping(self.http, t.url, self.cfg.probe_timeout_s)
        self.metrics.probes.labels(t.worker, seen).inc()
        return seen, detail
