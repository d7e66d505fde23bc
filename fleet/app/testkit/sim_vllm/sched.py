"""The stand-in's clock: a continuous-batching scheduler in modelled time (pure: no I/O, no wall clock).

One engine step, scheduled as vLLM v1 does it (FCFS, one token budget shared by every sequence):

    running, in order   each decode seq takes 1 token, each prefilling seq its next chunk
    waiting, FIFO       admitted while len(running) < max_num_seqs, budget is left and its
                        blocks fit; the first that does not fit blocks those behind it
                        (policy "priority", vLLM's --scheduling-policy priority: ordered by
                        (priority, arrival) instead, lower first)
    each chunk          the full blocks it completes are cached as it is scheduled (pool.cache_blocks)
    duration            step_s(prefill tokens of the step, decode seqs of the step)

Modelled time is data: `plan` stamps a step at `now` and moves `now` to its end, `complete` applies
it. The shell sleeps `duration_s * time_scale` in between; a test calls the two back to back.
Arrivals are stamped with `now`. Outputs go out as events (`take_outputs`), never callbacks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from fleet.app.testkit.sim_vllm.metrics import TTFT_BUCKETS, Histogram
from fleet.app.testkit.sim_vllm.step_cost import CostModel

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy


@dataclass(slots=True, eq=False)
class Seq:
    """One request. The tokens one admission computes (a preempted request recomputes its output too):

        |<------------------- prompt ------------------->|<-- output so far -->|
        |<-- hit (cached blocks) -->|<------------- num_prefill_tokens -------------->|

    num_prefill_tokens >= 1: the hit stops short of the last token (vLLM computes it for the logits; pool.allocate).
    """

    seq_id: int
    token_ids: Sequence[int]
    max_tokens: int
    arrival_s: float
    lora: str | None = None
    cache_salt: str | None = None
    report_full: bool = False
    priority: int = 0  # the request's `priority` (policy "priority": lower runs first)
    digests: list[bytes] = field(default_factory=list)  # full prompt blocks, for the pool
    pinned: list[int] = field(default_factory=list)  # the pool's blocks this seq holds (one per leading digest)
    num_blocks_to_hold: int = 0  # of digests, those it holds once its prefill is computed (the pool's reservation)
    num_hit_tokens: int = 0  # this admission's prefix-cache hit: its prefill computes the tokens after it
    state: str = WAITING
    num_cached_tokens: int = -1  # hit at the first admission (-1: never admitted), as vLLM reports it
    num_prefill_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    skip_cache: bool = False  # vLLM's skip_reading_prefix_cache (fleet/core/lax.py reads_prefix_cache): no hit
    first_token_s: float | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1, self.max_tokens

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.num_prefill_tokens


class Output(NamedTuple):
    """A seq's progress at `at_s`: its output count so far, and why it ended (None: still going)."""

    seq_id: int
    num_output: int
    at_s: float
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class Step:
    start_s: float
    duration_s: float
    prefill: tuple[tuple[Seq, int], ...]  # (seq, tokens computed this step)
    decode: tuple[Seq, ...]

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(slots=True)
class SchedStats:
    """vLLM's iteration stats, accumulated: prompt tokens count at a request's first token."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))


class BlockPool(Protocol):
    """The KV side the scheduler asks (the engine's prefix cache implements it)."""

    def can_allocate(self, seq: Seq, alone: bool) -> bool:
        """Whether the seq's blocks fit beside the running ones; a seq `alone` always fits."""
        ...

    def allocate(self, seq: Seq) -> int:
        """Pin the seq's prefix-cache hit and reserve the rest of its blocks; returns the hit in tokens."""
        ...

    def cache_blocks(self, seq: Seq, num_computed_tokens: int) -> None:
        """Cache (and announce) the seq's full blocks up to `num_computed_tokens`, as a chunk is scheduled."""
        ...

    def free(self, seq: Seq) -> None:
        """Unpin the seq's blocks (they stay cached until evicted)."""
        ...


def _any(seq: Seq) -> bool:
    return True


class Scheduler:
    """Waiting queue + running batch of one engine, stepped in modelled time."""

    def __init__(
        self, cost: CostModel, max_num_seqs: int, max_num_batched_tokens: int, pool: BlockPool,
        policy: str = "fcfs",
    ) -> None:
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1 and policy in POLICIES
        self.cost, self.pool, self.policy = cost, pool, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.now = 0.0
        self.stats = SchedStats()
        self.outputs: list[Output] = []
        self._next_id = 0

    def add(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        report_full: bool = False,
        digests: list[bytes] | None = None,
        priority: int = 0,
        skip_cache: bool = False,
    ) -> Seq:
        """Queue a request (FIFO, or by priority), stamped with the modelled `now`."""
        seq = Seq(
            self._next_id, token_ids, max_tokens, self.now, lora, cache_salt, report_full, priority,
            list(digests or []), skip_cache=skip_cache
        )
        self._next_id += 1
        self._queue(seq)
        return seq

    def _queue(self, seq: Seq) -> None:
        """Into the waiting queue: at its end (fcfs), or after every seq that goes first by (priority, arrival)."""
        if self.policy == "fcfs":
            self.waiting.append(seq)
            return
        key = (seq.priority, seq.arrival_s, seq.seq_id)
        i = len(self.waiting)
        while i and (self.waiting[i - 1].priority, self.waiting[i - 1].arrival_s, self.waiting[i - 1].seq_id) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def in_flight(self) -> list[Seq]:
        return [*self.running, *self.waiting]

    def take_outputs(self) -> list[Output]:
        out, self.outputs = self.outputs, []
        return out

    def advance(self, dt: float) -> None:
        """Modelled time passing with no step (the engine asleep)."""
        self.now += max(dt, 0.0)

    def plan(self, allowed: Callable[[Seq], bool] = _any) -> Step | None:
        """Schedule the next step (admissions included) and move `now` to its end; None: nothing to run."""
        budget = self.max_num_batched_tokens
        prefill: list[tuple[Seq, int]] = []
        decode: list[Seq] = []
        # running first
        for s in self.running:
            if budget == 0:
                break
            if not allowed(s):
                continue
            if s.prefilling:
                n = min(s.num_prefill_tokens - s.num_computed, budget)
                self._chunk(prefill, s, n)
            else:
                n = 1
                decode.append(s)
            budget -= n
        # then waiting, FIFO
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            if not allowed(s) or not self.pool.can_allocate(s, alone=not self.running):
                break  # NOTE: head-of-line blocking, as vLLM's FCFS policy
            self.waiting.popleft()
            self._admit(s)
            n = min(s.num_prefill_tokens, budget)
            self._chunk(prefill, s, n)
            budget -= n
        if not prefill and not decode:
            return None
        dur = self.cost.step_s(sum(n for _, n in prefill), len(decode))
        step = Step(self.now, dur, tuple(prefill), tuple(decode))
        self.now = step.end_s
        return step

    def _chunk(self, prefill: list[tuple[Seq, int]], s: Seq, n: int) -> None:
        """Schedule `n` prefill tokens of `s` in this step. NOTE: the blocks they complete are cached (and their
        BlockStored queued, published with this step) now, as vLLM's scheduler caches them when it allocates the
        chunk's slots: a request admitted later in this step or after hits them, none beyond them."""
        prefill.append((s, n))
        self.pool.cache_blocks(s, s.num_hit_tokens + s.num_computed + n)

    def complete(self, step: Step) -> None:
        """Apply a planned step at its end: prefill progress, one token per finished prefill or decode.

        Seqs aborted or preempted while the step ran are skipped (their work is lost).
        """
        for s, n in step.prefill:
            if s.state == RUNNING:
                s.num_computed += n
                if not s.prefilling:
                    self._emit(s, step.end_s)
        for s in step.decode:
            if s.state == RUNNING:
                self._emit(s, step.end_s)

    def abort(self, seq: Seq, reason: str = "abort") -> None:
        """End a seq now (client gone, sleep/pause abort, restart): its slot and blocks are freed."""
        if seq.state != FINISHED:
            self._finish(seq, reason, self.now)

    def abort_all(self, reason: str = "abort") -> None:
        for s in self.in_flight():
            self._finish(s, reason, self.now)

    def preempt_all(self) -> None:
        """Every running seq back to the head of the queue, in order, its blocks freed (vLLM: recompute)."""
        for s in reversed(self.running):
            self.pool.free(s)
            s.state, s.num_computed, s.num_prefill_tokens = WAITING, 0, 0
            if self.policy == "fcfs":
                self.waiting.appendleft(s)
            else:
                self._queue(s)
            self.stats.num_preemptions += 1
        self.running.clear()

    def _admit(self, s: Seq) -> None:
        hit = self.pool.allocate(s)
        s.num_hit_tokens = hit
        if s.num_cached_tokens < 0:
            s.num_cached_tokens = hit
        s.num_prefill_tokens = max(len(s.token_ids) + s.num_output - hit, 1)
        s.num_computed, s.state = 0, RUNNING
        self.running.append(s)

    def _emit(self, s: Seq, t: float) -> None:
        s.num_output += 1
        self.stats.num_generation_tokens += 1
        if s.first_token_s is None:
            s.first_token_s = t
            self.stats.ttft.observe(t - s.arrival_s)
            self.stats.num_prompt_tokens += len(s.token_ids)
        if s.num_output >= s.max_tokens:
            self._finish(s, "length", t)
        else:
            self.outputs.append(Output(s.seq_id, s.num_output, t, None))

    def _finish(self, s: Seq, reason: str, t: float) -> None:
        if s.state == RUNNING:
            self.running.remove(s)
            self.pool.free(s)
        elif s.state == WAITING:
            self.waiting.remove(s)
        s.state, s.finish_reason = FINISHED, reason
        self.outputs.append(Output(s.seq_id, s.num_output, t, reason))
