"""A vLLM worker's reconcile: the look at it (/is_sleeping, /metrics, /health, /version; /server_info at its start) folded
into its ranks' states, and the two loops that run beside its KV-event streams (Worker's part,
controller/vllm/watcher.py).

Health polling and tail replay run as two loops, so a slow or flooding replay endpoint cannot delay the look that
notices a worker put to sleep behind the controller's back. A reconcile or tail replay that raises marks the worker
down and is counted and logged once (controller/contain.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from controller.vllm.http import WorkerHttpError, WorkerMetrics, worker_hash_settings
from controller.vllm.loras import LoraLooks
from controller.vllm.tail_polls import TailPolls
from fleet.core.block_hash import HashConfig
from fleet.core.errors import FailedPrecondition
from fleet.core.rank_state import Look

if TYPE_CHECKING:
    from controller.contain import Contained
    from controller.index import IndexSink
    from controller.metrics import Metrics
    from controller.vllm.budget import FaultGuard
    from controller.vllm.silence import Silence
    from controller.vllm.subscriber import Subscriber
    from controller.vllm.watcher import WatchConfig
    from fleet.core.rank_state import RankState, Transition

log = logging.getLogger("controller.vllm.watcher")  # the worker's own log, as before the move


class Reconcile(LoraLooks):
    """The looks at one worker and its loops; Worker sets what is declared here in its __init__ and supplies `_apply`
    and `_persist_seqs`."""

    cfg: WatchConfig
    metrics: Metrics
    index: IndexSink
    errors: Contained
    guard: FaultGuard
    silence: Silence
    ranks: dict[int, RankState]
    lock: asyncio.Lock
    transitioning: bool
    sleep_ops: float | None
    hash_cfg: HashConfig | None
    calibrated: bool
    load: WorkerMetrics
    loads: tuple[WorkerMetrics, ...]
    load_at: float | None
    _look_at: float | None
    _subs: list[Subscriber]
    _reset_seen: dict[int, float | None]
    _tail_failing: set[int]
    _closing: bool

    if TYPE_CHECKING:
        def _apply(self, rank: int, t: Transition) -> None: ...

        def _persist_seqs(self) -> None: ...

    async def fetch(self) -> tuple[bool, tuple[WorkerMetrics, ...], bool, str] | None:
        """One look: /is_sleeping, every rank's engine's series of one /metrics (NOTE: engine 0's alone was read
        and charged to every rank, so a busy engine 0 priced an idle rank 1 out of its own warm prompts), /health,
        /version."""
        self._look_at = time.monotonic()
        try:
            s, m, h, v = await asyncio.gather(self.http.is_sleeping(), self.http.engine_metrics(tuple(self.ranks)),
                                              self.http.health(), self.http.version())
        except WorkerHttpError as e:
            log.info("worker %s unreachable or junk: %s", self.spec.name, e)
            return None
        return s, m, h, v

    def apply_observation(self, obs: tuple[bool, tuple[WorkerMetrics, ...], bool, str] | None) -> None:
        """Fold one look at the worker into the rank states (fail closed on anything odd)."""
        if obs is None or not obs[2]:
            self._mark_down("health")
            return
        sleeping, loads, _, version = obs
        m = loads[0]
        self.load, self.loads, self.load_at = m, loads, self._look_at or time.monotonic()
        if self._subs:
            self._check_silence(loads, self.load_at)
        self._check_algo(m.hash_algo, "/metrics")
        new_process = m.start_time is not None and any(
            st.start_time is not None and st.start_time != m.start_time for st in self.ranks.values())
        for r in self.ranks:
            self._apply(r, self.ranks[r].restarted(m.start_time, version, stream_reset_seen=r in self._reset_seen,
                                                   subscribed=bool(self._subs), reset_stamp=self._reset_seen.get(r)))
            self._reset_seen.pop(r, None)
        # NOTE: a new process counts its /sleep calls from 0: compared with the old one's count, the look read as
        # "slept between", and its invalidation replaced the restart's fence "reset" with none
        # NOTE: a restarted controller had no count to compare its first look with: a /sleep level 1 and /wake_up while
        # no controller ran (no step since, so the clear it queued unpublished) went unseen, and the catch-up replay
        # rebuilt the wiped blocks: WARM routes to an empty cache. The count is persisted now (RankState.sleep_ops)
        look = Look.of(sleeping, m.sleep_state, m.sleep_ops, None if new_process else self.sleep_ops,
                       unread=not self._subs, in_flight=m.in_flight)  # NOTE: parsed, and never read before
        self.sleep_ops = look.sleep_ops
        for r in list(self.ranks):
            self._apply(r, self.ranks[r].observed(look))
            self._apply(r, self.ranks[r].counted(look.sleep_ops))

    def _check_silence(self, loads: tuple[WorkerMetrics, ...], now: float) -> None:
        """A rank whose worker reused its cache while the index held none of its blocks and none of its KV events arrived
        for events_silent_s: said once (a warning, kvfleet_kv_events_silent) until its events arrive again. NOTE: a worker restarted on other event ports
        stayed COLD for every route, listed serving, and nothing said why (found by a new user's run)."""
        for r, m in zip(self.ranks, loads, strict=False):
            if self.silence.looked(r, m.prefix_hits, self.index.num_blocks((self.spec.name, r)), now):
                log.warning("worker %s rank %d reused its prefix cache for %gs and none of its KV events arrived at %s: "
                            "its publisher is not where it was registered (restarted on other --kv-events-config "
                            "ports?); its routes stay COLD until they do: register it again with its endpoints",
                            self.spec.name, r, self.silence.after_s, self.spec.kv_events)
                self.metrics.kv_events_silent.labels(self.spec.name, str(r)).set(1)

    def _mark_down(self, reason: str) -> None:
        for r in list(self.ranks):
            has_blocks = bool(self.index.num_blocks((self.spec.name, r)))
            self._apply(r, self.ranks[r].marked_down(reason, has_blocks=has_blocks))

    async def reconcile_once(self) -> None:
        """The reconcile loop's look: none where one is in progress."""
        if self.lock.locked():
            return
        await self.look()

    async def look(self) -> None:
        """One fresh look, begun after this call: a look in progress is waited for, then the worker looked at again,
        unless a look begun after this call came ended meanwhile (as fresh: the calls waiting share it).
        NOTE: a route that found no worker serving had every worker look with `reconcile_once`, which skipped a worker
        whose look was in progress; that look may have been fetched before the worker woke, and the route was refused
        "every candidate is asleep" with the worker awake (a fresh-clone CI run on a loaded machine). Each waiting
        call looking again in turn would have made a burst of such routes a queue of looks, each up to the HTTP
        timeout against a worker that does not answer."""
        asked = time.monotonic()
        async with self.lock:
            if self._look_at is not None and self._look_at >= asked:
                return
            self.apply_observation(await self.fetch())

    async def probe(self) -> bool:
        """Route-time probe: one fresh look (`look`); True when the worker is serving right now."""
        if self.transitioning:
            return False
        await self.look()
        return all(st.serving for st in self.ranks.values())

    async def discover(self) -> None:
        """Block size (/server_info, else first events) and LoRA adapter paths (/v1/models root)."""
        await self.refresh_loras(0.0)
        seen = await worker_hash_settings(self.http)
        bs = seen.get("block_size")
        if self.hash_cfg is None and isinstance(bs, int) and bs > 0:
            self.hash_cfg = HashConfig(self.spec.hash_algo or "sha256", self.spec.hash_seed, bs)
        self._check_algo(seen.get("hash_algo"), "the worker")

    def _check_algo(self, algo: str | None, where: str) -> None:
        """A worker that says it hashes otherwise than we compute is never warm (fail closed)."""
        if algo and self.hash_cfg is not None and algo != self.hash_cfg.algo and self.calibrated:
            self.calibrated = False
            self.errors.failed("hash_algo", FailedPrecondition(
                f"{where} says prefix_caching_hash_algo={algo!r}, the spec {self.hash_cfg.algo!r}"))

    async def _reconcile_loop(self) -> None:
        """Health, sleep state, restarts: never waits on the event stream or its replay."""
        while not self._closing:
            await asyncio.sleep(self.cfg.reconcile_interval_s)
            try:
                await asyncio.gather(self.reconcile_once(), self.refresh_loras(self.cfg.lora_refresh_s))
                self._persist_seqs()
                self.guard.settle()
            except Exception as e:
                self.errors.failed("reconcile", e)
                self.mark_down_contained("reconcile_error")
            else:
                self.errors.ok("reconcile")

    async def _tail_loop(self) -> None:
        """Replay of a lost final batch; bounded by StreamLimits, and off the reconcile path. The ranks' polls run
        side by side (controller/vllm/tail_polls.py): a rank whose replay does not answer holds no other rank's."""
        polls = TailPolls(self.cfg.stream.max_tail_polls, self._tail_polled)
        try:
            while not self._closing:
                await asyncio.sleep(self.cfg.reconcile_interval_s)
                polls.start(list(zip(self.ranks, self._subs, strict=False)))
        finally:
            await polls.stop()

    def _tail_polled(self, rank: int, error: Exception | None) -> None:
        """How one rank's tail poll ended: a raise marks the worker down; "works again" once no rank's last one raised."""
        if error is None:
            self._tail_failing.discard(rank)
            if not self._tail_failing:
                self.errors.ok("tail_replay")
            return
        self._tail_failing.add(rank)
        self.errors.failed("tail_replay", error)
        self.mark_down_contained("tail_replay_error")

    def mark_down_contained(self, reason: str) -> None:
        try:
            self._mark_down(reason)
        except Exception as e:  # NOTE: used to escape the except clause and end the loop for good
            self.errors.failed("mark_down", e)
