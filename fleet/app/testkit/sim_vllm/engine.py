"""The stand-in engine: lifecycle verbs and hazards over the prefix cache (cache.py) and the clock (sched.py).

Hazards reproduced (DESIGN §3, reference §1): AllBlocksCleared is only *queued* by sleep,
reset, pause(clear_cache) and release, and published with the next engine step; requests to a
sleeping engine wait (hang) until wake; /pause abort|wait rejects with 503; /health stays 200;
restart empties the cache silently and the publisher's seq starts again at 0.

The clock (docs/sim_vllm.md): with `time_scale > 0` requests go through `sched.Scheduler` and the
shell in `loop.py` plays its steps out; with `time_scale == 0` each runs at once, alone (`run`), and
only its modelled TTFT is recorded. Requests in flight meet a pause as vLLM's modes say: abort ends
them, keep freezes them (a cache reset preempts them), wait drains the running ones before the pause takes
effect (waiting ones stay queued).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.cache import PrefixCache, StepResult
from fleet.app.testkit.sim_vllm.config import EnginePaused, EngineRestarted, SimEngineConfig
from fleet.app.testkit.sim_vllm.sched import Scheduler, Seq, Step
from fleet.app.testkit.sim_vllm.sleep_ops import SleepOps
from fleet.app.testkit.sim_vllm.step_cost import lone_ttft_s
from fleet.core.block_hash import HashConfig


class SimEngine(PrefixCache):
    """Lifecycle + scheduler + block pool of one DP rank. `publish(events)` sends one batch (sync).

    `clock` (wall seconds) is read only to carry a sleep's length into modelled time.
    """

    def __init__(
        self,
        cfg: SimEngineConfig,
        publish: Callable[[list[Any]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            HashConfig(cfg.hash_algo, cfg.hash_seed, cfg.block_size, cfg.hash_extra_keys), cfg.num_blocks, cfg.loras,
            publish, cfg.max_num_batched_tokens
        )
        self.cfg = cfg
        self.sleeping_tags: set[str] = set()
        # vLLM's one scheduler pause state, whoever set it (is_scheduler_paused): "sleep" | "pause" | None, the last
        # verb that paused it; /resume and a full wake clear it either way (EngineCore.resume_scheduler)
        self.paused_by: str | None = None
        self.reject_new = False  # vLLM's reject_new_requests: set by /pause abort|wait alone, cleared with the pause
        self.sleep_state = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        self.sched = Scheduler(cfg.cost_model(), cfg.max_num_seqs, cfg.max_num_batched_tokens, pool=self,
                               policy=cfg.scheduling_policy)
        self.kick = asyncio.Event()  # set on every change the shell must look at
        self._clock = clock
        self._asleep_since: float | None = None
        self._drain: set[int] = set()  # seq ids a pause(wait) lets finish: those running when it came
        self._drained_ev = asyncio.Event()  # set while no pause(wait) drains (`drained`)
        self._drained_ev.set()
        self._deferred_reset = False
        self._instant_running = self._instant_waiting = 0  # requests on the time_scale 0 path
        self.start_time = time.time()
        self.generation = 0
        self.ops = SleepOps()  # the sleep-mode operation series, kept by the HTTP handlers (app.py)
        self._slept_state: dict[str, int] | None = None  # the sleep state a /sleep still draining sets once done
        self._serving = asyncio.Event()
        self._serving.set()

    # state
    def is_sleeping(self) -> bool:
        return self.paused_by is not None or bool(self.sleeping_tags)

    @property
    def running(self) -> int:
        return len(self.sched.running) + self._instant_running

    @property
    def waiting(self) -> int:
        return len(self.sched.waiting) + self._instant_waiting

    def _update_serving(self) -> None:
        self.kick.set()
        if self.is_sleeping():
            self._serving.clear()
            if self._asleep_since is None:
                self._asleep_since = self._clock()
            return
        self._serving.set()
        if self._asleep_since is not None and self.cfg.time_scale > 0:
            # NOTE: the modelled clock does not tick while no step runs; a request that waited on a
            # sleeping engine must see the sleep in its TTFT.
            self.sched.advance((self._clock() - self._asleep_since) / self.cfg.time_scale)
        self._asleep_since = None
        self._drain.clear()
        self._drained_ev.set()  # a drain cut short (woken, resumed, restarted) ends too
        self._slept_state = None
        if self._deferred_reset:
            self._deferred_reset = False
            self._reset_cache()

    def _reset_cache(self) -> None:
        self.sched.preempt_all()  # NOTE: vLLM resets with reset_running_requests=True
        assert not self.ref_cnt and not self.num_reserved, "blocks still held after preemption"
        self.clear_blocks()
        self.pending.append(wire.VllmAllBlocksCleared())  # NOTE: queued, published with the next step

    def _hold_in_flight(self, mode: str, reset: bool) -> None:
        """What a pause does to requests in flight: abort ends them, keep freezes, wait drains the running ones
        first. NOTE: vLLM's wait (PAUSED_NEW) lets only the requests holding blocks finish: a waiting one stays
        queued, unscheduled, until resume or wake (Scheduler.get_num_unfinished_requests). The stand-in drained the
        waiting ones too, so a slept or paused worker's queue finished there, where vLLM's waits for the wake."""
        if mode == "abort":
            self.sched.abort_all("abort")
        elif mode == "wait" and self.sched.running:
            self._drain = {s.seq_id for s in self.sched.running}
            self._drained_ev.clear()
            self._deferred_reset = self._deferred_reset or reset
            return
        if reset:
            self._reset_cache()

    # lifecycle verbs
    def sleep(self, level: int, mode: str) -> None:
        """vLLM's EngineCore.sleep: pause (level >= 1: with the cache reset, AllBlocksCleared queued), then the
        executor's sleep, a no-op while its memory is asleep already. NOTE: a sleep while asleep was a no-op here
        as a whole: a level-1 sleep after a level-0 one kept the cache vLLM discards, and no clear came.

        The sleep state changes once the sleep has completed, as vLLM's frontend records it after the engine answered:
        at once, or, with mode=wait, when the drain is done (`_drained`). NOTE: set at the start, a draining sleep
        showed asleep where vLLM shows awake, with the operation in flight (`vllm:sleep_mode_operations_in_flight`)."""
        self.paused_by = "sleep"
        self._hold_in_flight(mode, reset=level >= 1)
        state = None
        if not self.sleeping_tags:
            if level >= 1:
                self.sleeping_tags = {"weights", "kv_cache"}
            state = {"awake": 0, "weights_offloaded": int(level == 1), "discard_all": int(level == 2)}
        self._update_serving()
        if state is not None and self._drain:
            self._slept_state = state
        elif state is not None:
            self.sleep_state = state

    def wake_up(self, tags: list[str] | None) -> bool:
        """Returns True when fully awake; partial wakes leave the engine asleep."""
        if tags is None:
            self.sleeping_tags.clear()
        else:
            self.sleeping_tags.difference_update(tags)
        if not self.sleeping_tags:
            # NOTE: vLLM resumes its scheduler once no memory is asleep, whoever paused it (a /pause, or a pause
            # before /release_kv_cache_memory, included); the stand-in resumed a sleep's pause alone and answered
            # "sleeping" to a wake of a paused or released worker that vLLM answers "awake" and serves
            self.paused_by, self.reject_new = None, False
            self.sleep_state = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        self._update_serving()
        return not self.is_sleeping()

    def pause(self, mode: str, clear_cache: bool) -> None:
        if self.paused_by is None:
            self.paused_by = "pause"
        self.reject_new = mode != "keep"  # vLLM's pause_generation; a sleep leaves the flag as it is
        # NOTE: vLLM's engine resets with clear_cache in every mode (EngineCoreProc.pause_scheduler), keep included,
        # whatever its /pause docstring says; the stand-in ignored it for keep, so a pause keep kept the cache here
        self._hold_in_flight(mode, reset=clear_cache)
        self._update_serving()

    def resume(self) -> None:
        """vLLM's resume_scheduler: clears the pause whoever set it (a level-0 sleep's too; memory asleep stays
        asleep). NOTE: the stand-in resumed a /pause alone."""
        self.paused_by, self.reject_new = None, False
        self._update_serving()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's reset: refused (success:false, nothing changed) while running requests hold blocks, unless
        `reset_running_requests`: then the running requests are preempted (their blocks freed, their work
        recomputed when they are scheduled again) and the cache is reset at once."""
        if self._instant_running or self._instant_waiting:
            return False  # the time_scale 0 path cannot preempt a request it is answering
        if self.running and not reset_running_requests:
            # blocks are held by the running requests: vLLM answers success:false. NOTE: waiting ones hold none (a
            # preempted request gave its back), and vLLM resets with them queued; refused, a drain here waited on
            # the whole queue, where vLLM's waits for the running requests alone (found by review)
            return False
        self._reset_cache()
        self.kick.set()
        return True

    def release_kv_cache_memory(self) -> bool:
        """vLLM's: needs a completed pause (a wait pause still draining is not) and all memory resident."""
        if self.paused_by is None or self.sleeping_tags or self._drain:
            return False
        self._reset_cache()
        self.sleeping_tags = {"kv_cache"}
        self.sleep_state = {"awake": 0, "weights_offloaded": 0, "discard_all": 0}
        self._update_serving()
        return True

    def restart(self) -> None:
        """A fast process restart: empty cache, no event, fresh start time (seq reset is the publisher's)."""
        self.sched.abort_all("restart")
        self._drain.clear()
        self._drained_ev.set()  # a drain cut short (woken, resumed, restarted) ends too
        self._deferred_reset = False
        self.clear_blocks()
        self.pending.clear()
        self.sleeping_tags.clear()
        self.paused_by, self.reject_new = None, False
        self.sleep_state = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        self.start_time = time.time()
        self.ops = SleepOps()  # a new process: its series are created again on its first sleep-mode call
        self.generation += 1
        self._update_serving()

    # requests: instant (time_scale 0)
    async def run(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int = 16,
        lora: str | None = None,
        cache_salt: str | None = None,
        report_full: bool = False,
        skip_cache: bool = False,
    ) -> StepResult:
        """Admit a request (waiting while asleep), then run its prompt at once, alone."""
        self._check_admit()
        gen = self.generation
        self._instant_waiting += 1
        try:
            await self._serving.wait()
        finally:
            self._instant_waiting -= 1
        if gen != self.generation:
            raise EngineRestarted("engine restarted while the request waited")
        self._instant_running += 1
        try:
            res = self._step(token_ids, lora, cache_salt, report_full, skip_cache)
        finally:
            self._instant_running -= 1
        st, c = self.sched.stats, self.cfg
        st.num_prompt_tokens += res.num_prompt_tokens
        st.num_generation_tokens += max_tokens
        uncached = max(res.num_prompt_tokens - res.num_cached_tokens, 1)
        st.ttft.observe(lone_ttft_s(self.sched.cost, c.max_num_batched_tokens, uncached))
        return res

    def _check_admit(self) -> None:
        if self.reject_new:
            raise EnginePaused("engine_paused")

    # requests: clocked (time_scale > 0), driven by loop.EngineLoop
    def submit(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        report_full: bool = False,
        priority: int = 0,
        skip_cache: bool = False,
    ) -> Seq:
        """Queue a request for the scheduler (it waits there while the engine sleeps)."""
        self._check_admit()
        seq = self.sched.add(
            token_ids,
            max_tokens,
            lora=lora,
            cache_salt=cache_salt,
            report_full=report_full,
            digests=self._digests(token_ids, lora, cache_salt),
            priority=priority,
            skip_cache=skip_cache,
        )
        self.kick.set()
        return seq

    def abort(self, seq: Seq) -> None:
        """The client went away: free the seq's slot and blocks."""
        self.sched.abort(seq, "abort")
        self._drained()
        self.kick.set()

    def plan(self) -> Step | None:
        """The next step to play out; None while asleep (unless a pause(wait) still drains) or idle."""
        if not self.is_sleeping():
            return self.sched.plan()
        if self._drain:
            return self.sched.plan(lambda s: s.seq_id in self._drain)
        return None

    def finish(self, step: Step) -> None:
        """Apply a played-out step and publish its events; a drained pause(wait) then resets."""
        self.sched.complete(step)
        self._flush()
        self._drained()

    async def drained(self) -> None:
        """Until the requests a pause(wait) lets finish have finished (at once when none is draining): vLLM answers
        /pause?mode=wait then (AsyncLLM.pause_generation awaits the engine's wait-for-idle)."""
        await self._drained_ev.wait()

    def _drained(self) -> None:
        if self._drain:
            self._drain &= {s.seq_id for s in self.sched.running}  # a preempted one holds no blocks: not drained
            if not self._drain:
                self._drained_ev.set()
            if not self._drain and self._slept_state is not None:
                self.sleep_state, self._slept_state = self._slept_state, None  # the draining sleep has completed
            if not self._drain and self._deferred_reset:
                self._deferred_reset = False
                self._reset_cache()  # NOTE: queued, published with the step after wake
