"""A vLLM worker's KV events, applied to its ranks' states and the router's index (Worker's part,
controller/vllm/watcher.py).

Events are applied in slices that yield to the loop, within a per-rank event budget; a worker over its budget is
faulty for a while (controller/vllm/budget.py): not serving, its index dropped. A BlockStored is indexed only while
the rank's fence lets stores in, within the rank's capacity and tier bound, and once the worker's hashing is
calibrated (controller/vllm/calibration.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from controller.index import MAX_TIERS, tier_of
from controller.vllm import calibration
from controller.vllm.budget import STEP_COST, batch_cost
from controller.vllm.events import AllBlocksCleared, BlockStored, EventBatch
from fleet.core.block_hash import HashConfig
from fleet.core.rank_state import Transition

if TYPE_CHECKING:
    from controller.index import IndexSink
    from controller.metrics import Metrics
    from controller.registry import WorkerSpec
    from controller.vllm.budget import FaultGuard, Slicer
    from controller.vllm.http import WorkerMetrics
    from controller.vllm.ratelog import RateLog
    from controller.vllm.silence import Silence
    from controller.vllm.watcher import WatchConfig
    from fleet.core.rank_state import RankState

log = logging.getLogger("controller.vllm.watcher")  # the worker's own log, as before the move
AWAITED_CLEAR = AllBlocksCleared(awaited=True)  # the clear a forgetting verb queued (events.py)


class RankEvents:
    """The KV-event path of one worker; Worker sets what is declared here in its __init__ and supplies `_apply`,
    `persist`, `_clear_maybe_gone` and `lift_settled`."""

    spec: WorkerSpec
    cfg: WatchConfig
    metrics: Metrics
    index: IndexSink
    guard: FaultGuard
    slicer: Slicer
    lines: RateLog
    silence: Silence
    ranks: dict[int, RankState]
    loads: tuple[WorkerMetrics, ...]
    hash_cfg: HashConfig | None
    calibrated: bool
    dropped_uncalibrated: set[int]  # ranks whose index a failed calibration dropped, while it stays failed
    group_block_sizes: dict[int | None, int]  # each KV group's block size, as the GPU pool's events give it
    mixed_noted: bool  # its groups' different block sizes were logged
    resumed: set[int]
    applying: dict[int, int]
    _reset_seen: dict[int, float | None]
    _verb_clears: set[int] | None
    _closing: bool

    if TYPE_CHECKING:
        def _apply(self, rank: int, t: Transition) -> None: ...

        def persist(self, rank: int) -> None: ...

        def _clear_maybe_gone(self, rank: int) -> None: ...

        def lift_settled(self, rank: int) -> None: ...

    def on_stream_invalidate(self, rank: int, reason: str, seq: int | None) -> None:
        if reason == "seq_reset":
            self._reset_seen[rank] = None  # the next look's restart check: the stamp of the batch after it tells whose
        self._apply(rank, self.ranks[rank].stream_invalidated(reason, seq))
        if self.ranks[rank].fence == "clear":
            # NOTE: what was lost may have been the awaited clear: the fence stayed up for good, every store ignored,
            # and the worker served, always COLD, until some later clear
            self._clear_maybe_gone(rank)

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
        if rank in self._reset_seen and self._reset_seen[rank] is None:
            self._reset_seen[rank] = batch.ts  # the first batch of the new publisher (RankState.restarted)
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
        try:
            await self._apply_events(rank, key, seq, batch, st, persist)
        finally:
            self.applying.pop(rank, None)

    async def _apply_events(self, rank: int, key: tuple[str, int], seq: int, batch: EventBatch, st: RankState,
                            persist: bool) -> None:
        """on_batch's slices. Until the batch's last event is applied, `applying` holds the seq applied before it:
        the rank's state carries `seq` from the first slice on (a verb meanwhile reads it), while what the router
        reports as read (WorkerStatus.last_seq) is only what is applied."""
        for ev in batch.events:
            if self.slicer.due():
                self.applying.setdefault(rank, self.ranks[rank].seq)
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
                    if rank in self.dropped_uncalibrated:
                        # NOTE: the rank's index was dropped when calibration failed, and no store is indexed until a
                        # block 0 proves the worker's hashing again: every batch with a store used to drop it again,
                        # stepping its epoch and writing its state at each engine step of a worker whose hashing differs
                        # (another PYTHONHASHSEED: 20 epoch steps and store writes for 20 steps)
                        continue
                    self.dropped_uncalibrated.add(rank)
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
        sizes = self.group_block_sizes
        if not calibration.evidence(ev):
            pass  # a KV connector's: calibration.verdict says it is no evidence
        elif sizes.setdefault(ev.group_idx, ev.block_size) != ev.block_size:
            sizes[ev.group_idx] = ev.block_size  # a group's own size changed (a restart): a failure as ever, below
        elif ev.block_size != self.hash_cfg.block_size and len(set(sizes.values())) > 1:
            # NOTE: a hybrid model whose KV groups have different block sizes (vLLM stores each group's blocks at its
            # own size) failed calibration at every event of the other group's: its index dropped and its state
            # written at every step. Such a rank is matched by no route (controller/index.py: groups of different
            # block sizes fail closed), so the other size is no evidence about the hash config, and no failure.
            if not self.mixed_noted:
                self.mixed_noted = True
                log.warning("worker %s has KV groups of different block sizes %s: its prompts route COLD (no hit is "
                            "predicted across block sizes)", self.spec.name, sorted(set(sizes.values())))
            return self.calibrated
        cfg, proven = calibration.verdict(self.hash_cfg, ev)
        if cfg != self.hash_cfg:
            log.info("worker %s hashes a block's extra keys %s (its salted block 0 says so): predicted so from now on",
                     self.spec.name, cfg.extra_format)
            self.hash_cfg = cfg
        if proven is not None:
            self.calibrated = proven
        if self.calibrated:
            self.dropped_uncalibrated.clear()
        return self.calibrated
