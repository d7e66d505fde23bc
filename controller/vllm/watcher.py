"""One registered vLLM worker: its per-rank lifecycle state, event stream and reconcile loop.

State per (worker, dp_rank) is a `fleet.core.rank_state.RankState`, persisted through the EpochTable
(controller/registry.py) on every epoch change. Every transition of it is a pure function in
fleet/core/rank_state.py that returns a `Transition`; this shell only does the I/O (ZMQ, HTTP, store),
calls them, and carries out what they ask (`_apply`). The index holds only what BlockStored
events of the current epoch proved; `fence` makes BlockStored wait for the AllBlocksCleared a
forgetting verb queued ("clear") or for the restarted publisher ("reset").

The router reads a worker only through `view()` (a frozen WorkerView, controller/view.py), and
the watcher touches the router's index only through `IndexSink` (controller/index.py).

Failures stay with their worker (controller/contain.py): a store write that fails is retried on
the next tick, a reconcile or tail replay that raises marks this worker down and is counted and
logged once. The Worker's parts live beside it: its lifecycle verbs in controller/vllm/verbs.py,
its reconcile look and its two loops (health polling, tail replay) in controller/vllm/reconcile.py,
each rank's stream sink in controller/vllm/rank_sink.py, its KV-event path in
controller/vllm/rank_events.py, its LoRA looks in controller/vllm/loras.py.
Events are applied in slices that yield to the loop, within a per-rank event budget; a worker
over its budget is faulty for a while (controller/vllm/budget.py): not serving, its index
dropped, its stream only counted, no replay asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from typing import Protocol

import aiohttp
import zmq.asyncio

from controller.contain import Contained
from controller.index import IndexSink
from controller.metrics import Metrics
from controller.registry import EpochTable, KvStore, WorkerSpec
from controller.view import RankView, WorkerView
from controller.vllm.budget import FaultGuard, Slicer
from controller.vllm.http import VllmHttp, WorkerMetrics
from controller.vllm.rank_events import RankEvents
from controller.vllm.rank_sink import RankSink, rank_endpoint
from controller.vllm.ratelog import RateLog
from controller.vllm.reconcile import Reconcile
from controller.vllm.silence import Silence
from controller.vllm.subscriber import StreamLimits, Subscriber
from controller.vllm.verbs import Verbs
from fleet.core.block_hash import HashConfig
from fleet.core.rank_state import RankState, Transition

log = logging.getLogger(__name__)
CLEAR_SETTLE_S = 2.0  # after a fence "clear" went up, a batch read this much later was produced after the clear


class WatchConfig(Protocol):
    """What a watcher reads of the router's configuration (controller.router.RouterConfig)."""

    @property
    def reconcile_interval_s(self) -> float: ...

    @property
    def http_timeout_s(self) -> float: ...

    @property
    def stream(self) -> StreamLimits: ...

    @property
    def events_silent_s(self) -> float: ...

    @property
    def reset_drain_s(self) -> float: ...

    @property
    def lora_refresh_s(self) -> float: ...


class Worker(RankEvents, Verbs, Reconcile):
    """Runtime of one worker. All mutation happens on the event loop (no threads)."""

    def __init__(self, spec: WorkerSpec, *, store: KvStore, metrics: Metrics, index: IndexSink, cfg: WatchConfig,
                 session: aiohttp.ClientSession, zctx: zmq.asyncio.Context,
                 ranks: dict[int, RankState] | None = None) -> None:
        self.spec, self.metrics, self.index, self.cfg = spec, metrics, index, cfg
        self.epochs = EpochTable(store)
        self.http = VllmHttp(spec.url, session, cfg.http_timeout_s)
        self.zctx = zctx
        # keyed by global DP rank (spec.dp_rank_ids): its endpoint's port offset, its batches' data_parallel_rank,
        # its engine label in /metrics and the dp_rank of its routes
        self.ranks: dict[int, RankState] = ranks or {r: RankState() for r in spec.dp_rank_ids}
        self.hash_cfg: HashConfig | None = (HashConfig(spec.hash_algo or "sha256", spec.hash_seed, spec.block_size)
                                            if spec.block_size else None)
        self.loras: dict[str, str] = {}  # its LoRA adapters: name -> path (LoraLooks.refresh_loras)
        self._loras_at = -math.inf  # when refresh_loras last looked (monotonic)
        self._loras_lock = asyncio.Lock()
        # each rank's engine's series at the last look (vLLM's `engine` label), in rank order; `load` is the first
        # rank's, which also carries what is read for the worker as a whole (sleep state, start time, hash settings)
        self.loads: tuple[WorkerMetrics, ...] = tuple(WorkerMetrics() for _ in self.ranks)
        self.load = self.loads[0]
        self.load_at: float | None = None  # time.monotonic() when the look that gave `loads` began
        self._look_at: float | None = None
        self.calibrated = True
        self.dropped_uncalibrated: set[int] = set()  # (RankEvents._apply_events)
        self.group_block_sizes: dict[int | None, int] = {}  # (RankEvents._calibrate)
        self.mixed_noted = False
        self.lock = asyncio.Lock()
        self.transitioning = False  # a lifecycle verb is in flight: not serving, not warm
        self.draining = False  # .. one whose requests in flight finish there (lc.lists_draining): listed "draining"
        # the /sleep count of the last look; a restarted controller starts from the one its predecessor persisted
        first = self.ranks.get(spec.dp_rank_start)
        self.sleep_ops: float | None = first.sleep_ops if first is not None else None
        # ranks whose stream saw a seq reset since the last look -> the stamp of the first batch read after it
        self._reset_seen: dict[int, float | None] = {}
        self.fenced_at: dict[int, float] = {}  # when each rank's fence "clear" went up (monotonic)
        # ranks whose fence "clear" may await a clear already gone (lift_settled): back from a hold, a gap not
        # repaired, or a clear read while a verb's call was out
        self.resumed: set[int] = set()
        self.applying: dict[int, int] = {}  # rank -> the seq applied before the batch it is applying in slices
        self._verb_clears: set[int] | None = None  # while a verb's call is out: ranks an AllBlocksCleared reached
        self._persisted_seq: dict[int, int] = {}
        self._unpersisted: set[int] = set()
        self._subs: list[Subscriber] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.errors = Contained(metrics, spec.name)
        self._tail_failing: set[int] = set()  # ranks whose last tail poll raised
        lim = cfg.stream
        self.silence = Silence(cfg.events_silent_s)  # KV events that stopped arriving (controller/vllm/silence.py)
        self.guard = FaultGuard(spec.name, spec.dp_rank_ids, rate=lim.max_events_per_s, depth=lim.max_event_burst,
                                hold_s=lim.faulty_hold_s, metrics=metrics)
        self.slicer = Slicer()
        self.lines = RateLog(log)  # the stream's failures it finds itself (a batch of another DP rank)

    # persistence
    def persist(self, rank: int) -> None:
        """Write the rank's state; a store that is down is counted and retried on the next tick.

        NOTE: synchronous, on the event loop, on purpose: it is called from the stream callbacks
        (on_batch, on_stream_invalidate), which are synchronous, and the store must see one rank's
        writes in the order the states were made. A write handed to a thread pool could land after a
        newer one (an older epoch persisted); making it async needs one ordered writer per worker and
        a flush before each vLLM verb, which changes what a crash loses: not in a no-behaviour-change step.
        """
        try:
            self.epochs.put(self.spec.name, rank, self.ranks[rank])
        except Exception as e:  # the in-memory state stays authoritative (and fails closed) meanwhile
            self._unpersisted.add(rank)
            self.errors.failed("persist", e)
            return
        self._unpersisted.discard(rank)
        self.errors.ok("persist")

    def _persist_seqs(self) -> None:
        """The last seq seen, persisted at most once per reconcile tick (epoch changes persist at once)."""
        for r, st in self.ranks.items():
            if self._persisted_seq.get(r) != st.seq or r in self._unpersisted:
                self.persist(r)
                if r not in self._unpersisted:
                    self._persisted_seq[r] = st.seq

    def _apply(self, rank: int, t: Transition) -> None:
        """Carry out one transition: adopt its state, drop the index, count the bump, persist. Nothing once
        the worker is stopping (`stop`).

        NOTE: the index and the store are keyed by the worker's name, which a new registration may hold as soon
        as this one is unregistered. A verb in flight outlived unregister_worker, and when its answer came this
        dropped the new registration's index (a warm prompt routed COLD for good: vLLM announces a block once)
        and wrote this worker's rank state over the new one's record."""
        if self._closing:
            return
        if t.state.fence == "clear" and self.ranks[rank].fence != "clear":
            self.fenced_at[rank] = time.monotonic()
        self.ranks[rank] = t.state
        if t.drop_index:
            self.index.drop((self.spec.name, rank))
        if t.reason:
            self.metrics.epoch_bumps.labels(t.reason).inc()
        if t.persist:
            self.persist(rank)

    def view(self) -> WorkerView:
        """What the router reads of this worker for one decision (see WorkerView)."""
        s, faulty = self.spec, self.guard.faulty()
        ranks = tuple(RankView(r, st.epoch, st.serving is True and not self.transitioning and not faulty,
                               self.warmable(r))
                      for r, st in self.ranks.items())
        return WorkerView(s.name, s.url, s.model, self.loras, self.hash_cfg, self.load, self.load_at, ranks, self.loads)

    # events
    def _clear_maybe_gone(self, rank: int) -> None:
        """The clear the rank's fence awaits may be gone (read already, or lost): `lift_settled` from now on, counting
        from when the fence went up (from now, if this process did not see it go up: a state read back from the store)."""
        self.fenced_at.setdefault(rank, time.monotonic())
        self.resumed.add(rank)

    def lift_settled(self, rank: int) -> None:
        """A rank (`resumed`) with fence "clear" up whose awaited AllBlocksCleared may be gone already: sent while
        nothing was read (a hold), lost (a gap not repaired), or read before the fence went up (while the verb's
        answer was on its way). vLLM publishes it with the step after the verb, so once CLEAR_SETTLE_S have passed
        since the fence went up, whatever is read now was produced after it, and the fence lifts (the caller leaves
        a batch that carries a clear to that clear). Only while the rank serves: a verb that failed while vLLM drained
        it (a pause or sleep with mode=wait) queues its clear at the drain's end and publishes it with the first step
        after the resume, and what the drain stores meanwhile, however late, is not proof."""
        st = self.ranks[rank]
        if st.fence != "clear":
            self.resumed.discard(rank)
        elif st.serving and time.monotonic() - self.fenced_at.get(rank, 0.0) >= CLEAR_SETTLE_S:
            self.resumed.discard(rank)
            self._apply(rank, Transition(dataclasses.replace(st, fence=""), persist=True))

    def faulty(self) -> bool:
        """Over its event budget lately: not serving, whatever its ranks say (controller/vllm/budget.py)."""
        return self.guard.faulty()

    def warmable(self, rank: int) -> bool:
        st = self.ranks[rank]
        return (st.serving and self.calibrated and self.hash_cfg is not None and not self.transitioning
                and not self.guard.faulty())

    def applied_seq(self, rank: int) -> int:
        """The seq of the last batch whose every event the rank has applied (its state carries a batch's seq from the
        batch's first slice: controller/vllm/rank_events.py on_batch)."""
        return self.applying.get(rank, self.ranks[rank].seq)

    # start and stop
    async def start(self, *, catch_up: bool) -> None:
        """Discover, look once, then start every rank's stream. NOTE: the ranks catch up side by side: one after
        another, a rank whose replay did not answer held back the next rank's stream for its whole replay."""
        await self.discover()
        await self.reconcile_once()
        if self._closing:
            # NOTE: stopped meanwhile (a router stopping while it resumed the workers the store holds): the streams
            # opened after stop() closed what it saw were never closed, and the router's ZMQ context then waited
            # for them for good (a CI run: a controller's stop hung)
            return
        for r in self.ranks:
            ep = rank_endpoint(self.spec.kv_events, r)
            rp = rank_endpoint(self.spec.replay, r) if self.spec.replay else None
            self._subs.append(Subscriber(self.zctx, ep, rp, RankSink(self, r), self.metrics, limits=self.cfg.stream,
                                         label=f"worker {self.spec.name} rank {r}"))
        # every stream is in _subs before any starts, so that stop() ends the ones started if another one fails
        done = await asyncio.gather(*(self._start_rank(r, sub, catch_up) for r, sub in zip(self.ranks, self._subs, strict=True)),
                                    return_exceptions=True)
        for e in done:
            if isinstance(e, BaseException):
                raise e
        if self._closing:  # stopped while the streams started (stop() ended them): no loop outlives it
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reconcile_loop()), loop.create_task(self._tail_loop())]

    async def _start_rank(self, r: int, sub: Subscriber, catch_up: bool) -> None:
        # a restarted controller rebuilds the current epoch from its first seq; a new worker
        # replays whatever its publisher still buffers (a suffix of the stream is sound)
        st = self.ranks[r]
        caught_up = await sub.start(catch_up_from=st.epoch_seq if catch_up and st.seq >= 0 else 0)
        if catch_up and caught_up:
            self._apply(r, self.ranks[r].caught_up())
        elif catch_up and self.ranks[r].fence == "clear":
            # NOTE: a catch-up replay that did not answer (past StreamLimits, or no replay endpoint) may have held the
            # awaited clear, or it was read before the fence went up: kept up, the worker served, always COLD, for good
            self._clear_maybe_gone(r)

    async def stop(self) -> None:
        # NOTE: on Python 3.11 asyncio.wait_for can swallow a cancel that lands as its inner
        # future completes; the flag ends the loops anyway (stop used to hang, now and then).
        self._closing = True
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        for s in self._subs:
            await s.stop()
        self._subs = []
        self._persist_seqs()  # a graceful stop leaves the last seq in the store
        self.guard.forget()
        for r in self.ranks:  # its series go with it
            with contextlib.suppress(KeyError):
                self.metrics.kv_events_silent.remove(self.spec.name, str(r))
