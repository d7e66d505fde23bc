"""One registered vLLM worker: its per-rank lifecycle state, event stream and reconcile loop.

State per (worker, dp_rank) is a `fleet.lifecycle.RankState`, persisted in the store (kv
namespace "epochs", key "<worker>/<rank>") on every epoch change. The index holds only what
BlockStored events of the current epoch proved; `fence` makes BlockStored wait for the
AllBlocksCleared a forgetting verb queued ("clear") or for the restarted publisher ("reset").

Failures stay with their worker (controller/contain.py): a store write that fails is retried on
the next tick, a reconcile or tail replay that raises marks this worker down and is counted and
logged once. Health polling and tail replay run as two loops, so a slow or flooding replay
endpoint cannot delay the look that notices a worker put to sleep behind the controller's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import Any

import aiohttp
import zmq.asyncio

from controller.contain import Contained
from controller.index import PrefixIndex, tier_of
from controller.metrics import Metrics
from controller.vllm.events import AllBlocksCleared, BlockStored, EventBatch
from controller.vllm.hashing import HashConfig, calibrates
from controller.vllm.http import VllmHttp, WorkerHttpError, WorkerMetrics, worker_hash_settings
from controller.vllm.subscriber import Subscriber
from fleet import lifecycle as lc
from fleet.errors import FailedPrecondition
from fleet.lifecycle import RankState, Witness

log = logging.getLogger(__name__)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's per-DP-rank endpoint: TCP port + rank (inproc/ipc get a _dp<rank> suffix)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class _Sink:
    def __init__(self, worker: Worker, rank: int) -> None:
        self.w, self.r = worker, rank

    def last_seq(self) -> int:
        return self.w.ranks[self.r].seq

    def on_batch(self, seq: int, batch: EventBatch) -> None:
        self.w.on_batch(self.r, seq, batch)

    def on_invalidate(self, reason: str, seq: int | None) -> None:
        self.w.on_stream_invalidate(self.r, reason, seq)


class Worker:
    """Runtime of one worker. All mutation happens on the event loop (no threads)."""

    def __init__(self, spec: Any, *, store: Any, metrics: Metrics, index: PrefixIndex, cfg: Any,
                 session: aiohttp.ClientSession, zctx: zmq.asyncio.Context,
                 ranks: dict[int, RankState] | None = None) -> None:
        self.spec, self.store, self.metrics, self.index, self.cfg = spec, store, metrics, index, cfg
        self.http = VllmHttp(spec.url, session, cfg.http_timeout_s)
        self.zctx = zctx
        self.ranks: dict[int, RankState] = ranks or {r: RankState() for r in range(spec.dp_ranks)}
        self.hash_cfg: HashConfig | None = (HashConfig(spec.hash_algo or "sha256", spec.hash_seed, spec.block_size)
                                            if spec.block_size else None)
        self.loras: dict[str, str] = {}
        self.load = WorkerMetrics()
        self.load_at: float | None = None  # time.monotonic() when the look that gave `load` began
        self._look_at: float | None = None
        self.calibrated = True
        self.lock = asyncio.Lock()
        self.transitioning = False  # a lifecycle verb is in flight: not serving, not warm
        self.sleep_ops: float | None = None
        self._reset_seen: set[int] = set()
        self._persisted_seq: dict[int, int] = {}
        self._unpersisted: set[int] = set()
        self._subs: list[Subscriber] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.errors = Contained(metrics, spec.name)

    # persistence
    def persist(self, rank: int) -> None:
        """Write the rank's state; a store that is down is counted and retried on the next tick."""
        try:
            self.store.kv_put("epochs", f"{self.spec.name}/{rank}", json.dumps(self.ranks[rank].to_json()).encode())
        except Exception as e:  # the in-memory state stays authoritative (and fails closed) meanwhile
            self._unpersisted.add(rank)
            self.errors.failed("persist", e)
            return
        self._unpersisted.discard(rank)
        self.errors.ok("persist")

    def _set(self, rank: int, st: RankState, *, persist: bool = True) -> None:
        self.ranks[rank] = st
        if persist:
            self.persist(rank)

    # invalidation
    def invalidate(self, rank: int, reason: str, *, fence: str = "", **changes: Any) -> None:
        """Epoch bump + index dropped for one rank; nothing is warm until new BlockStored events."""
        st = self.ranks[rank].invalidate(fence=fence)
        self.index.drop((self.spec.name, rank))
        self.metrics.epoch_bumps.labels(reason).inc()
        self._set(rank, dataclasses.replace(st, **changes))

    def on_stream_invalidate(self, rank: int, reason: str, seq: int | None) -> None:
        if reason == "seq_reset":
            self._reset_seen.add(rank)
            st = dataclasses.replace(self.ranks[rank], seq=-1)
            self.ranks[rank] = st
            self.invalidate(rank, reason, fence="")  # a new publisher: no old batch can follow
            return
        if seq is not None:
            self.ranks[rank] = dataclasses.replace(self.ranks[rank], seq=max(seq, self.ranks[rank].seq))
        self.invalidate(rank, reason, fence=self.ranks[rank].fence)

    # events
    def on_batch(self, rank: int, seq: int, batch: EventBatch) -> None:
        key = (self.spec.name, rank)
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != rank:
            self.ranks[rank] = dataclasses.replace(self.ranks[rank], seq=seq)
            self.invalidate(rank, "wrong_dp_rank")  # another rank's batch on this socket: fail closed
            return
        st = dataclasses.replace(self.ranks[rank], seq=seq)
        bumped = False
        for ev in batch.events:
            self.metrics.kv_events.labels(type(ev).__name__).inc()
            if isinstance(ev, AllBlocksCleared):
                st = dataclasses.replace(st, epoch=st.epoch + 1, epoch_seq=seq,
                                         fence="" if st.fence == "clear" else st.fence)
                self.metrics.epoch_bumps.labels("all_blocks_cleared").inc()
                self.index.apply(key, ev)
                bumped = True
            elif isinstance(ev, BlockStored):
                if st.fence or self._over_capacity(key, ev):
                    continue
                if not self._calibrate(ev):
                    self.ranks[rank] = st
                    self.invalidate(rank, "calibration")
                    return
                self.index.apply(key, ev)
            else:
                self.index.apply(key, ev)
        self._set(rank, st, persist=bumped)

    def _over_capacity(self, key: tuple[str, int], ev: BlockStored) -> bool:
        """A store that would take the rank past what it can hold is refused and counted.

        The bound is the pool's size from /metrics (vllm:cache_config_info num_gpu_blocks), else
        StreamLimits.max_resident_blocks. NOTE: vLLM announces an eviction (BlockRemoved) before
        the store that reuses the block, so an honest stream never passes it; one claiming
        millions of blocks used to grow the index (and the controller) without bound.
        """
        tier = tier_of(ev.group_idx, ev.medium)
        gpu = tier[1] == "GPU"
        bound = (self.load.num_gpu_blocks if gpu else None) or self.cfg.stream.max_resident_blocks
        rank = self.index.rank(key)
        held = rank.num_gpu_blocks() if gpu else len(rank.tiers.get(tier, ()))
        new = set(ev.block_hashes) - rank.tiers.get(tier, set())
        if held + len(new) <= bound:
            return False
        self.metrics.kv_blocks_refused.inc(len(new))
        return True

    def _calibrate(self, ev: BlockStored) -> bool:
        """Self-calibration: a parentless, extra-free block 0 must recompute with this worker's config."""
        if self.hash_cfg is None:
            self.hash_cfg = HashConfig(self.spec.hash_algo or "sha256", self.spec.hash_seed, ev.block_size)
        if ev.block_size != self.hash_cfg.block_size:
            self.calibrated = False
        elif ev.parent_block_hash is None and ev.lora_name is None and ev.block_hashes:
            salt = _block0_salt(ev.extra_keys)
            if salt is not False:
                self.calibrated = calibrates(self.hash_cfg, ev.token_ids, ev.block_hashes[0],
                                             cache_salt=salt if isinstance(salt, str) else None)
        return self.calibrated

    def _check_algo(self, algo: str | None, where: str) -> None:
        """A worker that says it hashes otherwise than we compute is never warm (fail closed)."""
        if algo and self.hash_cfg is not None and algo != self.hash_cfg.algo and self.calibrated:
            self.calibrated = False
            self.errors.failed("hash_algo", FailedPrecondition(
                f"{where} says prefix_caching_hash_algo={algo!r}, the spec {self.hash_cfg.algo!r}"))

    def warmable(self, rank: int) -> bool:
        st = self.ranks[rank]
        return st.serving and self.calibrated and self.hash_cfg is not None and not self.transitioning

    # lifecycle verbs
    async def lifecycle(self, call: lc.Call) -> Witness:
        """Demote (or stop serving) first, then call vLLM, then adopt and record the witness."""
        async with self.lock:
            self.transitioning = True
            try:
                return await self._lifecycle(call)
            finally:
                self.transitioning = False

    async def _lifecycle(self, call: lc.Call) -> Witness:
        for r in self.ranks:
            self._set(r, self.ranks[r].begin(call.before))
            if call.before.warm_demoted:
                self.index.drop((self.spec.name, r))
                self.metrics.epoch_bumps.labels(call.verb).inc()
        try:
            resp = await self.http.json(call.method, call.path, list(call.params), empty_ok=True)
            w = lc.witness(call, resp)
            if w.serving and await self.http.is_sleeping():
                w = dataclasses.replace(w, serving=False, phase="sleeping")
        except WorkerHttpError:
            for r in self.ranks:
                self.invalidate(r, "verb_failed", fence=self.ranks[r].fence, phase="error", kv="unknown",
                                serving=False)
            raise
        clear = lc.queues_clear(call, resp)
        for r in self.ranks:
            if w.warm_demoted:
                self.index.drop((self.spec.name, r))
            self._set(r, self.ranks[r].finish(w, clear_queued=clear))
        self.sleep_ops = None
        w = dataclasses.replace(w, epoch=self.ranks[0].epoch)
        self.store.kv_put("witness", self.spec.name, json.dumps(w.to_dict()).encode())
        self.metrics.lifecycle_actions.labels(call.verb, w.kv).inc()
        return w

    # reconcile
    async def fetch(self) -> tuple[bool, WorkerMetrics, bool, str] | None:
        self._look_at = time.monotonic()
        try:
            s, m, h, v = await asyncio.gather(self.http.is_sleeping(), self.http.metrics(), self.http.health(),
                                              self.http.version())
        except WorkerHttpError as e:
            log.info("worker %s unreachable or junk: %s", self.spec.name, e)
            return None
        return s, m, h, v

    def apply_observation(self, obs: tuple[bool, WorkerMetrics, bool, str] | None) -> None:
        """Fold one look at the worker into the rank states (fail closed on anything odd)."""
        if obs is None or not obs[2]:
            self._mark_down("health")
            return
        sleeping, m, _, version = obs
        self.load, self.load_at = m, self._look_at or time.monotonic()
        self._check_algo(m.hash_algo, "/metrics")
        for r in self.ranks:
            self._check_restart(r, m, version)
        ops = m.sleep_ops or 0.0
        slept_between = self.sleep_ops is not None and ops is not None and ops != self.sleep_ops
        self.sleep_ops = ops
        asleep = sleeping or m.awake == 0.0
        for r, st in list(self.ranks.items()):
            if asleep or slept_between:
                self._observe_asleep(r, m, asleep, slept_between)
            elif not st.serving:
                self._set(r, dataclasses.replace(self.ranks[r], serving=True, phase="serving"))

    def _check_restart(self, r: int, m: WorkerMetrics, version: str) -> None:
        st = self.ranks[r]
        restarted = (st.start_time is not None and m.start_time is not None and m.start_time != st.start_time) \
            or (st.version is not None and version != st.version)
        if restarted and r not in self._reset_seen:
            if self._subs:  # old batches may still sit in our SUB queue: wait for the new publisher's seq
                self.invalidate(r, "restart", fence="reset" if st.seq >= 0 else "", phase="serving", kv="forgotten")
            else:  # not subscribed yet (controller start): the stream we will read is the new publisher's
                self.invalidate(r, "restart", phase="serving", kv="forgotten")
                self._set(r, dataclasses.replace(self.ranks[r], seq=-1, epoch_seq=0, fence=""))
        self._reset_seen.discard(r)
        if (m.start_time, version) != (self.ranks[r].start_time, self.ranks[r].version):
            self._set(r, dataclasses.replace(self.ranks[r], start_time=m.start_time, version=version))

    def _observe_asleep(self, r: int, m: WorkerMetrics, asleep: bool, slept_between: bool) -> None:
        st = self.ranks[r]
        if asleep and st.phase == "paused" and st.kv == "preserved":
            return  # a preserving verb the controller drove: keep the index, do not serve
        if st.serving or st.phase in ("serving", "unknown") or slept_between:
            level = 2 if m.sleep_state.get("discard_all") else 1 if m.sleep_state.get("weights_offloaded") else 0
            self.invalidate(r, "is_sleeping" if asleep else "sleep_ops", fence="clear" if level else "",
                            phase="sleeping" if level else "paused", kv="unknown", serving=False)
        if not asleep and not self.ranks[r].serving:
            self._set(r, dataclasses.replace(self.ranks[r], serving=True, phase="serving"))

    def _mark_down(self, reason: str) -> None:
        for r, st in self.ranks.items():
            if st.serving or st.phase != "unknown" or self.index.num_blocks((self.spec.name, r)):
                self.invalidate(r, reason, fence=st.fence, phase="unknown", kv="unknown", serving=False)

    async def reconcile_once(self) -> None:
        if self.lock.locked():
            return
        async with self.lock:
            self.apply_observation(await self.fetch())

    async def probe(self) -> bool:
        """Route-time probe: one fresh look; True when the worker is serving right now."""
        if self.transitioning:
            return False
        async with self.lock:
            self.apply_observation(await self.fetch())
        return all(st.serving for st in self.ranks.values())

    async def discover(self) -> None:
        """Block size (/server_info, else first events) and LoRA adapter paths (/v1/models root)."""
        with contextlib.suppress(WorkerHttpError):
            self.loras = {k: v for k, v in (await self.http.models()).items() if k != self.spec.model}
        seen = await worker_hash_settings(self.http)
        bs = seen.get("block_size")
        if self.hash_cfg is None and isinstance(bs, int) and bs > 0:
            self.hash_cfg = HashConfig(self.spec.hash_algo or "sha256", self.spec.hash_seed, bs)
        self._check_algo(seen.get("hash_algo"), "the worker")

    async def start(self, *, catch_up: bool) -> None:
        await self.discover()
        await self.reconcile_once()
        for r in self.ranks:
            ep = rank_endpoint(self.spec.kv_events, r)
            rp = rank_endpoint(self.spec.replay, r) if self.spec.replay else None
            sub = Subscriber(self.zctx, ep, rp, _Sink(self, r), self.metrics, limits=self.cfg.stream)
            st = self.ranks[r]
            # a restarted controller rebuilds the current epoch from its first seq; a new worker
            # replays whatever its publisher still buffers (a suffix of the stream is sound)
            await sub.start(catch_up_from=st.epoch_seq if catch_up and st.seq >= 0 else 0)
            self._subs.append(sub)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reconcile_loop()), loop.create_task(self._tail_loop())]

    async def _reconcile_loop(self) -> None:
        """Health, sleep state, restarts: never waits on the event stream or its replay."""
        while not self._closing:
            await asyncio.sleep(self.cfg.reconcile_interval_s)
            try:
                await self.reconcile_once()
                self._persist_seqs()
            except Exception as e:
                self.errors.failed("reconcile", e)
                self.mark_down_contained("reconcile_error")
            else:
                self.errors.ok("reconcile")

    async def _tail_loop(self) -> None:
        """Replay of a lost final batch; bounded by StreamLimits, and off the reconcile path."""
        while not self._closing:
            await asyncio.sleep(self.cfg.reconcile_interval_s)
            try:
                for sub in self._subs:
                    await sub.poll_tail()
            except Exception as e:
                self.errors.failed("tail_replay", e)
                self.mark_down_contained("tail_replay_error")
            else:
                self.errors.ok("tail_replay")

    def mark_down_contained(self, reason: str) -> None:
        try:
            self._mark_down(reason)
        except Exception as e:  # NOTE: used to escape the except clause and end the loop for good
            self.errors.failed("mark_down", e)

    def _persist_seqs(self) -> None:
        """The last seq seen, persisted at most once per reconcile tick (epoch changes persist at once)."""
        for r, st in self.ranks.items():
            if self._persisted_seq.get(r) != st.seq or r in self._unpersisted:
                self.persist(r)
                if r not in self._unpersisted:
                    self._persisted_seq[r] = st.seq

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


def _block0_salt(extra_keys: tuple[Any, ...] | None) -> str | None | bool:
    """Block 0's cache salt from a parentless BlockStored's extra keys: None when block 0 has no
    extra key, the salt when its only key is one string (vLLM publishes ("cache_salt", s) as (s,)),
    False when its keys are anything else (multimodal, prompt embeds: not recomputable here)."""
    k = extra_keys[0] if extra_keys else None
    if k is None:
        return None
    if isinstance(k, list | tuple) and len(k) == 1 and isinstance(k[0], str):
        return str(k[0])
    return False
