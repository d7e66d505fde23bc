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
each rank's stream sink in controller/vllm/rank_sink.py, its LoRA looks in controller/vllm/loras.py.
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
from controller.index import MAX_TIERS, IndexSink, tier_of
from controller.metrics import Metrics
from controller.registry import EpochTable, KvStore, WorkerSpec
from controller.view import RankView, WorkerView
from controller.vllm import calibration
from controller.vllm.budget import STEP_COST, FaultGuard, Slicer, batch_cost
from controller.vllm.events import AllBlocksCleared, BlockStored, EventBatch
from controller.vllm.http import VllmHttp, WorkerMetrics
from controller.vllm.rank_sink import RankSink, rank_endpoint
from controller.vllm.ratelog import RateLog
from controller.vllm.reconcile import Reconcile
from controller.vllm.silence import Silence
from controller.vllm.subscriber import StreamLimits, Subscriber
from controller.vllm.verbs import Verbs
from fleet.core.block_hash import HashConfig
from fleet.core.rank_state import RankState, Transition

log = logging.getLogger(__name__)
AWAITED_CLEAR = AllBlocksCleared(awaited=True)  # the clear a forgetting verb queued (events.py)
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


class Worker(Verbs, Reconcile):
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
        self.lock = asyncio.Lock()
        self.transitioning = False  # a lifecycle verb is in flight: not serving, not warm
        self.draining = False  # .. one that lets the requests in flight finish (lc.drains): listed "draining"
        # the /sleep count of the last look; a restarted controller starts from the one its predecessor persisted
        first = self.ranks.get(spec.dp_rank_start)
        self.sleep_ops: float | None = first.sleep_ops if first is not None else None
        self._reset_seen: set[int] = set()
        self.fenced_at: dict[int, float] = {}  # when each rank's fence "clear" went up (monotonic)
        # ranks whose fence "clear" may await a clear already gone (lift_settled): back from a hold, a gap not
        # repaired, or a clear read while a verb's call was out
        self.resumed: set[int] = set()
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
    def on_stream_invalidate(self, rank: int, reason: str, seq: int | None) -> None:
        if reason == "seq_reset":
            self._reset_seen.add(rank)  # the next look's restart check must not count it again
        self._apply(rank, self.ranks[rank].stream_invalidated(reason, seq))
        if self.ranks[rank].fence == "clear":
            # NOTE: what was lost may have been the awaited clear: the fence stayed up for good, every store ignored,
            # and the worker served, always COLD, until some later clear
            self._clear_maybe_gone(rank)

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
        a batch that carries a clear to that clear)."""
        st = self.ranks[rank]
        if st.fence != "clear":
            self.resumed.discard(rank)
        elif time.monotonic() - self.fenced_at.get(rank, 0.0) >= CLEAR_SETTLE_S:
            self.resumed.discard(rank)
            self._apply(rank, Transition(dataclasses.replace(st, fence=""), persist=True))

    async def on_batch(self, rank: int, seq: int, batch: EventBatch) -> None:
        """Apply one batch in slices: each slice's state is adopted before yielding to the loop (a
        verb may run meanwhile), and the next slice starts from the rank's state as it then is. The
        store write, if the batch stepped the epoch, is one, at its end."""
        key = (self.spec.name, rank)
        if self._closing:  # a stopped worker touches no index (see _apply)
            return
        if self.silence.heard(rank):
            log.info("worker %s rank %d: its KV events arrive again", self.spec.name, rank)
            self.metrics.kv_events_silent.labels(self.spec.name, str(rank)).set(0)
        if seq > self.ranks[rank].seq + 1 and self.ranks[rank].fence == "clear":
            self._clear_maybe_gone(rank)  # the head of a fresh stream, never read (no replay held it) may hold it
        if rank in self.resumed and not any(isinstance(ev, AllBlocksCleared) for ev in batch.events):
            self.lift_settled(rank)
        st = self.ranks[rank].at_seq(seq)
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != rank:
            if not self.guard.admit(rank, STEP_COST, len(batch.events)):  # an epoch step, like any invalidation
                self._trip(rank, seq, len(batch.events), f"a batch of rank {batch.data_parallel_rank}")
                return
            self.lines.log(logging.WARNING, f"wrong_dp_rank{rank}", "KV events of worker %s rank %d: seq %d is a batch of "
                           "data_parallel_rank %d; the rank's index is dropped (is the registered endpoint, dp_ranks or "
                           "dp_rank_start wrong?)", self.spec.name, rank, seq, batch.data_parallel_rank)
            self._apply(rank, st.invalidated("wrong_dp_rank"))  # another rank's batch on this socket: fail closed
            return
        if not self.guard.admit(rank, batch_cost(batch), len(batch.events)):
            self._trip(rank, seq, len(batch.events))
            return
        t = st.stamped(batch.ts)
        st, persist = t.state, t.persist
        for ev in batch.events:
            if self.slicer.due():
                self.ranks[rank] = st
                await self.slicer.tick()
                st = self.ranks[rank]
                if self._closing:  # stopped meanwhile: the index may be a new registration's now
                    return
                if self.guard.faulty():  # another rank tripped the worker meanwhile
                    if persist:
                        self.persist(rank)
                    return
            self.metrics.kv_events.labels(type(ev).__name__).inc()
            if isinstance(ev, AllBlocksCleared):
                awaited = st.fence == "clear"
                if self._verb_clears is not None:
                    self._verb_clears.add(rank)
                t = st.cleared(seq)
                st, persist = t.state, persist or t.persist
                self.metrics.epoch_bumps.labels(t.reason).inc()
                self.index.apply(key, AWAITED_CLEAR if awaited else ev)
            elif isinstance(ev, BlockStored):
                if not st.accepts_stores:
                    continue
                if self.index.opens_tier(key, ev) > MAX_TIERS:
                    self.ranks[rank] = st
                    self.guard.trip(len(batch.events))
                    self._trip(rank, seq, len(batch.events), f"a BlockStored opening a tier (group_idx {ev.group_idx}, "
                               f"medium {ev.medium!r}) past {MAX_TIERS}")
                    return
                if self._over_capacity(key, ev):
                    continue
                if not self._calibrate(ev):
                    self._apply(rank, st.invalidated("calibration"))
                    return
                self.index.apply(key, ev)
            else:
                self.index.apply(key, ev)
        self._apply(rank, Transition(st, persist=persist))

    def _trip(self, rank: int, seq: int, n: int, what: str = "") -> None:
        """Over the event budget, or a message refused undecoded: faulty; every rank's index dropped
        (epoch step); seq kept. `what`: what the worker sent (default: a batch of `n` events)."""
        self.ranks[rank] = self.ranks[rank].at_seq(seq)
        log.warning("worker %s rank %d sent %s over its budget (--kv-max-events-per-s %d, --kv-max-event-burst %d, "
                    "--kv-event-max-message-bytes %d): faulty, not serving, for %g s", self.spec.name, rank,
                    what or f"a batch of {n} events", self.cfg.stream.max_events_per_s,
                    self.cfg.stream.max_event_burst, self.cfg.stream.max_msg_bytes, self.guard.hold_s)
        for r in self.ranks:
            self._apply(r, self.ranks[r].stream_invalidated("event_budget", None))

    def faulty(self) -> bool:
        """Over its event budget lately: not serving, whatever its ranks say (controller/vllm/budget.py)."""
        return self.guard.faulty()

    def _over_capacity(self, key: tuple[str, int], ev: BlockStored) -> bool:
        """A store that would take the rank past what it can hold is refused and counted.

        The bound is the pool's size from /metrics (vllm:cache_config_info num_gpu_blocks), else
        StreamLimits.max_resident_blocks; non-GPU tiers (offloaded copies, never matched) share one
        max_resident_blocks between them, whatever their count (index.MAX_TIERS); the pool's size never
        raises the bound past max_resident_blocks. NOTE: vLLM announces an eviction (BlockRemoved) before
        the store that reuses the block, so an honest stream never passes it; one claiming
        millions of blocks used to grow the index (and the controller) without bound, and a worker whose
        /metrics claimed a pool of 10^12 blocks still did (4.6M blocks indexed, +292 MiB in 7.5 s).
        """
        cap = self.cfg.stream.max_resident_blocks
        gpu = tier_of(ev.group_idx, ev.medium)[1] == "GPU"
        bound = min(self.loads[key[1] - self.spec.dp_rank_start].num_gpu_blocks or cap, cap) if gpu else cap
        held, new = self.index.held_and_new(key, ev)
        if held + new <= bound:
            return False
        self.metrics.kv_blocks_refused.inc(new)
        return True

    def _calibrate(self, ev: BlockStored) -> bool:
        """Self-calibration on one BlockStored (controller/vllm/calibration.py); False: the worker is not warm-able."""
        if self.hash_cfg is None:
            if not calibration.evidence(ev):
                # NOTE: a KV connector's (vLLM's OffloadingConnector: block size 0, or its own offloaded one) was
                # taken for the pool's block size: 0 raised out of the batch, 64 on a pool of 16 was never WARM
                return self.calibrated
            self.hash_cfg = HashConfig(self.spec.hash_algo or "sha256", self.spec.hash_seed, ev.block_size)
        cfg, proven = calibration.verdict(self.hash_cfg, ev)
        if cfg != self.hash_cfg:
            log.info("worker %s hashes a block's extra keys %s (its salted block 0 says so): predicted so from now on",
                     self.spec.name, cfg.extra_format)
            self.hash_cfg = cfg
        if proven is not None:
            self.calibrated = proven
        return self.calibrated

    def warmable(self, rank: int) -> bool:
        st = self.ranks[rank]
        return (st.serving and self.calibrated and self.hash_cfg is not None and not self.transitioning
                and not self.guard.faulty())

    # start and stop
    async def start(self, *, catch_up: bool) -> None:
        """Discover, look once, then start every rank's stream. NOTE: the ranks catch up side by side: one after
        another, a rank whose replay did not answer held back the next rank's stream for its whole replay."""
        await self.discover()
        await self.reconcile_once()
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
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reconcile_loop()), loop.create_task(self._tail_loop())]

    async def _start_rank(self, r: int, sub: Subscriber, catch_up: bool) -> None:
        # a restarted controller rebuilds the current epoch from its first seq; a new worker
        # replays whatever its publisher still buffers (a suffix of the stream is sound)
        st = self.ranks[r]
        caught_up = await sub.start(catch_up_from=st.epoch_seq if catch_up and st.seq >= 0 else 0)
        if catch_up and caught_up:
            self._apply(r, self.ranks[r].caught_up())

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
