"""A vLLM worker's lifecycle verbs (sleep, wake, pause, resume, reset; Worker's part, controller/vllm/watcher.py).

A verb stops the worker serving (`transitioning`), lets the routes already decided reach it (`settle`), calls vLLM,
and adopts the witness of its answer (fleet/core/lifecycle.py) into every rank's state. A prefix-cache reset vLLM
refuses while requests hold blocks is asked again while the worker drains (`_drained_reset`). A verb the worker's
stop came before is not sent; one the stop overtook answers FailedPrecondition, its outcome not recorded. A verb
whose caller is cancelled once it was sent runs to its answer all the same (`_to_its_answer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from controller.vllm.http import CACHE_DROPPING_OPS, WorkerHttpError
from fleet.core import lifecycle as lc
from fleet.core.errors import FailedPrecondition
from fleet.core.lifecycle import Witness

if TYPE_CHECKING:
    from controller.metrics import Metrics
    from controller.registry import WorkerSpec
    from controller.vllm.http import VllmHttp
    from controller.vllm.watcher import WatchConfig
    from fleet.core.rank_state import RankState, Transition

log = logging.getLogger("controller.vllm.watcher")  # the worker's own log, as before the move
DRAIN_POLL_S = 0.02  # how often a refused prefix-cache reset is asked again while the worker drains


async def _to_its_answer(sent: Coroutine[Any, Any, Witness]) -> Witness:
    """Run a verb sent to vLLM to its answer, and adopt it, even when its caller is cancelled meanwhile (a client
    deadline, a client gone, the server's stop grace over); the caller's cancel is raised once it is adopted, and
    the worker's lock is held until then (no other verb overlaps it).

    NOTE: cancelled while vLLM ran it, a verb adopted nothing: its rank kept the state it got before the call (an
    index dropped but no fence), a pause with mode=wait went on draining in vLLM, the blocks its drained requests
    stored were indexed, then its cache reset, and the resume that followed routed WARM to blocks vLLM no longer
    held (found by review: a verb queued behind a draining reset passes the SDK's 10 s deadline)."""
    task = asyncio.ensure_future(sent)
    gone = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            gone = True
    if gone:
        raise asyncio.CancelledError
    return task.result()


def _refused(resp: Any) -> bool:
    """vLLM's /reset_prefix_cache answer says it did nothing (blocks still held): {"success": false}."""
    return isinstance(resp, dict) and resp.get("success") is False


class Verbs:
    """The lifecycle verbs of one worker; Worker sets what is declared here in its __init__ (`lock`, `transitioning`,
    `draining`, `sleep_ops`, `_verb_clears`, `_closing`) and supplies `_apply` and `_clear_maybe_gone`."""

    spec: WorkerSpec
    cfg: WatchConfig
    http: VllmHttp
    metrics: Metrics
    ranks: dict[int, RankState]
    lock: asyncio.Lock
    transitioning: bool
    draining: bool
    sleep_ops: float | None
    _verb_clears: set[int] | None
    _closing: bool

    if TYPE_CHECKING:
        def _apply(self, rank: int, t: Transition) -> None: ...

        def _clear_maybe_gone(self, rank: int) -> None: ...

    async def lifecycle(self, call: lc.Call, settle: Callable[[], Awaitable[None]] | None = None) -> Witness:
        """Demote (or stop serving) first, then let routes already decided for this worker reach it
        (`settle`: nothing new is routed here meanwhile), then call vLLM, then adopt and record the witness."""
        async with self.lock:
            self._unsent_if_stopped(call)
            self.transitioning, self.draining = True, lc.lists_draining(call)
            try:
                w = await self._lifecycle(call, settle)
            except WorkerHttpError as e:
                self._stopped_under(call, e)
                raise
            finally:
                self.transitioning = self.draining = False
            self._stopped_under(call)
            return w

    def _unsent_if_stopped(self, call: lc.Call) -> None:
        """A verb the worker's stop came before (it waited for the lock, or for `settle`) is not sent."""
        if self._closing:
            raise FailedPrecondition(f"worker {self.spec.name!r} was unregistered (or the controller stopped) before "
                                     f"its {call.verb} was sent; nothing was sent")

    def _stopped_under(self, call: lc.Call, cause: Exception | None = None) -> None:
        """A verb the worker's stop overtook (unregistered, or the controller stopping) answers FailedPrecondition:
        vLLM may have acted, but nothing of its answer was recorded (_apply), and the name may be another
        registration's by now."""
        if self._closing:
            raise FailedPrecondition(
                f"worker {self.spec.name!r} was unregistered (or the controller stopped) while its {call.verb} ran: "
                f"the verb may have reached {self.spec.url}, and its outcome was not recorded") from cause

    async def _lifecycle(self, call: lc.Call, settle: Callable[[], Awaitable[None]] | None) -> Witness:
        for r in self.ranks:
            self._apply(r, self.ranks[r].verb_started(call))
        if settle is not None:
            await settle()
        self._unsent_if_stopped(call)
        return await _to_its_answer(self._sent(call))

    async def _sent(self, call: lc.Call) -> Witness:
        self._verb_clears = set()
        try:
            return await self._called(call)
        finally:
            self._verb_clears = None

    async def _called(self, call: lc.Call) -> Witness:
        """Call vLLM and adopt its answer. A rank an AllBlocksCleared reached while the call was out may have read
        the one this verb queued before the fence went up for it (a request behind the controller's back ran a
        step first): that fence lifts once settled (`lift_settled`). NOTE: it waited for that clear for good, the
        worker served, always COLD, until some later clear."""
        try:
            resp = await self.http.json(call.method, call.path, list(call.params), empty_ok=True,
                                        timeout_s=self._verb_timeout(call))
            if call.verb == "reset_prefix_cache" and _refused(resp) and self.cfg.reset_drain_s > 0:
                resp = await self._drained_reset(call, resp)
                # NOTE: a drain its worker's stop ended went on to read /is_sleeping, on the router's closed HTTP
                # session when the router stopped: the caller got RuntimeError("Session is closed"), gRPC INTERNAL
                self._stopped_under(call)
            w = lc.witness(call, resp)
            if w.serving:
                w = lc.confirm_awake(w, await self.http.is_sleeping())
        except WorkerHttpError:
            maybe = lc.queues_clear(call, None)
            for r in self.ranks:
                self._apply(r, self.ranks[r].verb_failed(clear_maybe_queued=maybe))
                if maybe:
                    self._clear_maybe_gone(r)  # vLLM may never have acted: then no clear comes
            raise
        clear = lc.queues_clear(call, resp)
        for r in self.ranks:
            self._apply(r, self.ranks[r].verb_answered(w, clear_queued=clear))
            if self.ranks[r].fence == "clear" and r in (self._verb_clears or ()):
                self._clear_maybe_gone(r)
        if call.verb in CACHE_DROPPING_OPS:
            # its own /sleep (or release) moves the op count: the next look takes a fresh baseline. NOTE: every verb
            # dropped the baseline, so a /sleep and /wake_up behind the controller's back between a pause
            # (or a resume, wake or reset) and the next look went unseen, and the wake kept the old index
            self.sleep_ops = None
        self.metrics.lifecycle_actions.labels(call.verb, w.kv).inc()
        return dataclasses.replace(w, epoch=self.ranks[self.spec.dp_rank_start].epoch)

    def _verb_timeout(self, call: lc.Call) -> float | None:
        """The bound on the verb's call to vLLM (None: the usual http_timeout_s). vLLM answers a draining verb
        (lc.drains: a pause with mode=wait) once the requests in flight have finished, so it gets `reset_drain_s`
        more, the time a refused reset is asked again too. NOTE: bounded by http_timeout_s alone, a drain longer
        than 2 s failed the verb: the rank was invalidated (phase error, its index dropped, where the pause was to
        keep the cache) and the SDK's retry, once the drain ended, left the worker paused and COLD (found by review)."""
        return self.cfg.http_timeout_s + self.cfg.reset_drain_s if lc.drains(call) else None

    async def _drained_reset(self, call: lc.Call, resp: Any) -> Any:
        """vLLM refuses a prefix-cache reset while requests hold blocks (success:false, nothing changed). The
        worker is not serving while a verb runs (`transitioning`: the router sends it nothing new; listed "draining",
        lc.lists_draining: the proxy waits for what it sent there), so its requests drain; the reset is asked again
        every DRAIN_POLL_S until it succeeds or `reset_drain_s` passes, and the last answer is the witness (still
        refused: kv unknown, as before).

        NOTE: asking once and giving up left the rank's index dropped (a refused reset is "unknown") while the
        router went on sending the worker requests, cold, into a cache that was still whole, and the requests it
        sent kept the reset refused: through the controller, a busy worker's reset took up to 75 asks and 2 s
        (issue #27, agents16x4/very-tight), and the blocks prefilled meanwhile were wiped when it finally ran.
        """
        deadline = time.monotonic() + self.cfg.reset_drain_s
        asks = 1
        while _refused(resp) and time.monotonic() < deadline and not self._closing:
            await asyncio.sleep(min(DRAIN_POLL_S, max(deadline - time.monotonic(), 0.0)))
            if self._closing:  # stopped while it waited: ask nothing more (the router's session may be closed)
                break
            resp = await self.http.json(call.method, call.path, list(call.params), empty_ok=True)
            asks += 1
        self.metrics.reset_drains.labels("reset" if not _refused(resp) else "refused").inc()
        log.info("worker %s: prefix-cache reset %s after %d asks, draining %.2fs", self.spec.name,
                 "refused" if _refused(resp) else "done", asks, self.cfg.reset_drain_s - (deadline - time.monotonic()))
        return resp
