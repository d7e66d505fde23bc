"""What one worker's KV-event stream may cost the controller's event loop (issue #31 item 1).

Two bounds, both per (worker, dp_rank) stream:

- time: events, live or replayed, are applied in slices; `Slicer.tick()` yields to the event loop
  once `SLICE_S` has passed since the last yield, so no stream holds the loop longer than about
  that (plus one event) at a time, however many events it sends;
- volume: `EventBudget` is a token bucket of events (rate `max_events_per_s`, depth
  `max_event_burst`, controller/vllm/subscriber.py StreamLimits; an AllBlocksCleared counts as
  STEP_COST events: it steps the epoch and writes the store). Every message also costs
  `message_cost` (1, plus 1 per 4 KiB) before it is decoded, and one larger than its announced
  events allow (`max_batch_bytes`) is refused undecoded. A batch that does not fit what
  is left is not applied. A stream invalidation (seq reset or duplicate, decode error, unrepaired
  gap, another rank's batch) also costs STEP_COST: it steps the epoch and writes the store too: the worker is then faulty (controller/vllm/watcher.py) for
  `faulty_hold_s`: not serving, listed as phase "faulty", counted in kvfleet_worker_faulty.

NOTE: the bucket starts full, so a controller restart's catch-up replay (vLLM buffers 10,000
batches) fits the default depth; a flood of AllBlocksCleared batches (each event an epoch step
and an index clear) used to take the loop for 20 s per replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SLICE_S = 0.002  # the longest a stream's events run before yielding to the event loop
STEP_COST = 1000  # what one AllBlocksCleared costs of the budget: an epoch step, and a store write
# a stored or removed block costs 1 / HASHES_PER_UNIT of a unit beside its event's 1: decoding and indexing a block
# hash takes about 0.3 us. An honest worker prefilling 100,000 tokens a second at 16 tokens a block stores and
# evicts about 6,250 blocks a second each: about 3,100 units, well inside the default 20,000 a second
HASHES_PER_UNIT = 4


def batch_cost(batch: Any) -> int:
    """A batch's cost in budget units: 1 per event, STEP_COST per AllBlocksCleared (vLLM sends one
    when its cache is reset or put to sleep: rare; each steps the rank's epoch and is persisted)."""
    return sum(STEP_COST if type(ev).__name__ == "AllBlocksCleared" else 1 for ev in batch.events)


def blocks_cost(batch: Any) -> int:
    """What a live batch's blocks cost beside its events: 1 per HASHES_PER_UNIT block hashes.

    Charged on every message but a controller restart's catch-up, which replays up to 10,000 honest steps at
    once (8,192-token steps would cost 1.3M units). NOTE: charged on live messages only at first, a worker
    answering each tail poll with 64 batches of 116,000 hashes held the loop 6.3 s of 8, never faulty.
    NOTE: an event cost 1 whatever it carried: one BlockStored of 116,000 hashes (1 MiB, no token ids)
    held the event loop ~35 ms, and 70 such messages a second stayed inside the budget, so another
    worker's Routes took 35 ms at the median instead of 1, for as long as the worker liked (its stores
    were all refused as over capacity, which never made it faulty). Such a message now costs 29,000."""
    return sum(len(getattr(ev, "block_hashes", ())) for ev in batch.events) // HASHES_PER_UNIT


@dataclass(slots=True)
class EventBudget:
    """A token bucket of events: refills at `rate` per second up to `depth`."""

    rate: float
    depth: float
    tokens: float = -1.0
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.depth > 0:
            raise ValueError(f"an event budget needs rate > 0 and depth > 0, got {self.rate}, {self.depth}")
        if self.tokens < 0:
            self.tokens = self.depth

    def take(self, n: int) -> bool:
        """Spend `n` events if they fit what is left (after refilling); False (nothing spent) if not."""
        now = time.monotonic()
        self.tokens = min(self.depth, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if n > self.tokens:
            return False
        self.tokens -= n
        return True


class Slicer:
    """Yields to the event loop once `slice_s` has passed since its last yield."""

    def __init__(self, slice_s: float = SLICE_S) -> None:
        self.slice_s = slice_s
        self._since = time.perf_counter()
        self.yields = 0

    def due(self) -> bool:
        return time.perf_counter() - self._since >= self.slice_s

    async def tick(self) -> None:
        if self.due():
            await asyncio.sleep(0)
            self.yields += 1
            self._since = time.perf_counter()


class FaultGuard:
    """One worker's event budgets (one per rank) and its faulty state, as the watcher keeps them.

    `admit(rank, cost, events)` spends a batch's cost from the rank's budget; False trips the worker:
    faulty until `hold_s` from now (metrics: kvfleet_worker_faulty{worker} = 1 meanwhile, and the
    events refused in kvfleet_kv_events_over_budget_total). `faulty()` ends on its own; `settle()`
    (called by the reconcile loop) then resets the gauge.
    """

    def __init__(
        self, worker: str, ranks: Iterable[int], *, rate: float, depth: float, hold_s: float, metrics: Any
    ) -> None:
        self.worker, self.hold_s, self.metrics = worker, hold_s, metrics
        self.budgets = {r: EventBudget(rate, depth) for r in ranks}  # by global DP rank
        self.until = 0.0
        self.trips = 0

    def faulty(self) -> bool:
        return time.monotonic() < self.until

    def admit(self, rank: int, cost: int, events: int) -> bool:
        """Spend a batch's `cost` (batch_cost) from `rank`'s budget; False: it did not fit, its
        `events` are refused and the worker is faulty from now on."""
        if self.budgets[rank].take(cost):
            return True
        self.until = time.monotonic() + self.hold_s
        self.trips += 1
        self.metrics.kv_events_over_budget.inc(events)
        self.metrics.worker_faulty.labels(self.worker).set(1)
        return False

    def trip(self, events: int) -> None:
        """Faulty from now on, whatever the budget holds (a message too large to decode)."""
        self.until = time.monotonic() + self.hold_s
        self.trips += 1
        self.metrics.kv_events_over_budget.inc(max(events, 0))
        self.metrics.worker_faulty.labels(self.worker).set(1)

    def settle(self) -> None:
        if self.until and not self.faulty():
            self.until = 0.0
            self.metrics.worker_faulty.labels(self.worker).set(0)

    def forget(self) -> None:
        """The worker is gone (unregistered or the router stopped): drop its gauge."""
        with contextlib.suppress(KeyError):
            self.metrics.worker_faulty.remove(self.worker)


MAX_BATCH_EVENTS = 4_096  # events one message may announce (vLLM: ~1 per stored or evicted block of a step); more is refused undecoded
_UNPARSED_MAX_BYTES = 1 << 20  # a message whose header cannot be read is decoded only below this size
# What a message's size may be for the events it announces: MSG_BASE_BYTES + EVENT_BYTES per event (and never
# over StreamLimits.max_msg_bytes). A batch holds one engine step's events, and a step computes at most
# max_num_batched_tokens tokens (vLLM's defaults: 2,048 to 16,384): its BlockStored token ids, at most 5
# bytes each, and block hashes (9 bytes a block) take ~100 KiB; 1 MiB is a 170,000-token step. An event's
# own fields (keys, medium, parent, one block's extra keys) take a few hundred bytes.
# NOTE: the event count alone let one 1-hash BlockStored carry 30M token ids (28.6 MiB): one decode
# held the event loop ~0.5 s, for a cost of 1 event.
MSG_BASE_BYTES = 1 << 20
EVENT_BYTES = 4 << 10
BYTES_PER_UNIT = 4 << 10  # a message costs 1 budget unit per this many bytes, charged before it is decoded


def message_cost(nbytes: int) -> int:
    """What a message costs of its rank's budget before it is decoded: 1, plus 1 per BYTES_PER_UNIT
    bytes (its events, and STEP_COST per AllBlocksCleared, are charged once decoded: batch_cost).
    NOTE: empty batches used to cost nothing: a flood of them took another tenant's Route p95 to 20 ms."""
    return 1 + nbytes // BYTES_PER_UNIT


def max_batch_bytes(events: int) -> int:
    """The largest message that may announce `events` events (MSG_BASE_BYTES + EVENT_BYTES each)."""
    return MSG_BASE_BYTES + EVENT_BYTES * max(events, 0)


def peek_num_events(payload: bytes) -> int | None:
    """The number of events a batch announces, read from its msgpack header without decoding it:
    vLLM sends [ts (float), [event, ...], dp_rank?]. None when the header has another shape.

    NOTE: decoding is one C call that holds the event loop for its whole length (about 3 us per
    event here): one 64 MiB message of small events took seconds, which no slicing can split.
    """
    if len(payload) < 3 or payload[0] not in (0x92, 0x93):
        return None
    i, t = 1, payload[1]
    if t == 0xCB:  # float64 (what vLLM sends)
        i += 9
    elif t == 0xCA:  # float32
        i += 5
    elif t <= 0x7F:  # positive fixint
        i += 1
    elif 0xCC <= t <= 0xCF:  # uint8..uint64
        i += 1 + (1 << (t - 0xCC))
    else:
        return None
    if i >= len(payload):
        return None
    h = payload[i]
    if 0x90 <= h <= 0x9F:
        return h & 0x0F
    if h == 0xDC and i + 3 <= len(payload):
        return int.from_bytes(payload[i + 1 : i + 3], "big")
    if h == 0xDD and i + 5 <= len(payload):
        return int.from_bytes(payload[i + 1 : i + 5], "big")
    return None


def refusal(payload: bytes) -> tuple[int, str] | None:
    """(event count, what was sent) of a message to refuse undecoded: over MAX_BATCH_EVENTS events,
    larger than max_batch_bytes of the events it announces, or an unreadable header on a message over
    1 MiB (count -1); None to decode it."""
    n = peek_num_events(payload)
    if n is None:
        if len(payload) > _UNPARSED_MAX_BYTES:
            return -1, f"a message of {len(payload):,} bytes with no KV-event batch header"
        return None
    if n > MAX_BATCH_EVENTS:
        return n, f"a batch announcing {n:,} events (at most {MAX_BATCH_EVENTS:,})"
    if len(payload) > max_batch_bytes(n):
        return n, (f"a message of {len(payload):,} bytes announcing {n:,} event{'' if n == 1 else 's'} "
                   f"(at most {max_batch_bytes(n):,} bytes)")
    return None


def too_many_events(payload: bytes) -> int | None:
    """The event count of a message to refuse undecoded (see `refusal`); None to decode it."""
    r = refusal(payload)
    return None if r is None else r[0]
