"""The router's in-flight ledger: the tracked routes it has decided and not yet seen end, per (worker, dp_rank).

Pure: no I/O, no clock of its own (callers pass `t` and `now`). The cost (controller/cost.py) reads a rank's
load from it (`load`, `extended`, `mean_tokens`); the router adds, releases, moves and expires its routes
(controller/route_book.py), and the candidate ordering reconciles it against each rank's /metrics look
(controller/ordering.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

RankKey = tuple[str, int]  # (worker, dp_rank)


class Flight(NamedTuple):
    """One tracked route the router has not seen end. `t` is the caller's clock at routing."""

    route_id: str
    key: RankKey
    num_tokens: int  # prompt tokens it had to prefill there (uncached at routing time)
    last_hash: int | None  # its prompt's last full block hash on that rank (None: under one block)
    owner: str | None
    t: float
    # its prompt's leading block hashes on that rank (at most PENDING_BLOCKS): what it computes there, which a
    # request sharing that prefix finds cached when it is admitted after it (`pending`)
    blocks: tuple[int, ...] = ()


PENDING_BLOCKS = 1024  # the leading blocks of a route that `pending` credits (16,384 tokens at 16 a block)
# distinct block hashes `pending` keeps per rank; a route that would pass it is tracked without them (its prefix is
# credited by KV events alone): a flood of tracked routes that never end stays bounded (8 bytes and a dict slot each)
PENDING_HASHES_PER_RANK = 1 << 16


class InFlight:
    """The router's ledger of tracked, unfinished routes per (worker, dp_rank).

    A route is added when decided and queued until vLLM is seen to schedule it; it leaves by
    `release` (the proxy's answer ended), `expire` (older than the TTL: a leaked route decays) or
    `reconcile` (the worker no longer shows it). Like Dynamo's active-sequence tracking and llm-d's
    active-request scorer, it raises a worker's cost at once, before any /metrics look could.

    Per rank it also keeps the mean prefill of the tracked routes a look saw that rank schedule
    (`mean_tokens`): the size at which the rank's untracked waiting requests count.
    """

    def __init__(self, ttl_s: float, grace_s: float, default_tokens: int) -> None:
        self.ttl_s, self.grace_s, self.default_tokens = ttl_s, grace_s, default_tokens
        self._all: OrderedDict[str, Flight] = OrderedDict()  # routing order == time order
        self._by_key: dict[RankKey, OrderedDict[str, Flight]] = {}
        self._queued: dict[RankKey, OrderedDict[str, Flight]] = {}  # not yet scheduled, oldest first
        self._queued_tokens: dict[RankKey, int] = {}
        self._by_hash: dict[int, dict[str, Flight]] = {}  # queued routes by their last block hash
        self._means: dict[RankKey, tuple[float, int]] = {}  # per rank: mean prefill of routes seen scheduled, count
        self._blocks: dict[RankKey, dict[int, int]] = {}  # per rank: block hash -> tracked routes whose prompt has it

    def __len__(self) -> int:
        return len(self._all)

    def add(self, f: Flight) -> None:
        """Track a route (its id must be new); it counts as queued until scheduled."""
        assert f.route_id not in self._all, f.route_id
        if f.blocks and len(self._blocks.get(f.key, ())) + len(f.blocks) > PENDING_HASHES_PER_RANK:
            f = f._replace(blocks=())
        self._all[f.route_id] = f
        self._by_key.setdefault(f.key, OrderedDict())[f.route_id] = f
        self._queued.setdefault(f.key, OrderedDict())[f.route_id] = f
        self._queued_tokens[f.key] = self._queued_tokens.get(f.key, 0) + f.num_tokens
        if f.last_hash is not None:
            self._by_hash.setdefault(f.last_hash, {})[f.route_id] = f
        if f.blocks:
            held = self._blocks.setdefault(f.key, {})
            for h in f.blocks:
                held[h] = held.get(h, 0) + 1

    def _unqueue(self, f: Flight) -> bool:
        """Take the route out of the queue; False if it was not queued."""
        queued = self._queued.get(f.key)
        if queued is None or f.route_id not in queued:
            return False
        del queued[f.route_id]
        self._queued_tokens[f.key] -= f.num_tokens
        if not queued:
            del self._queued[f.key], self._queued_tokens[f.key]
        if f.last_hash is not None:
            same = self._by_hash[f.last_hash]
            del same[f.route_id]
            if not same:
                del self._by_hash[f.last_hash]
        return True

    def _ran(self, f: Flight) -> None:
        """A look saw the rank schedule `f`: its prefill joins the rank's running mean (the last 64 weigh most)."""
        mean, n = self._means.get(f.key, (0.0, 0))
        n += 1
        self._means[f.key] = (mean + (f.num_tokens - mean) / min(n, 64), n)

    def _remove(self, f: Flight) -> None:
        self._unqueue(f)
        if f.blocks:
            held = self._blocks[f.key]
            for h in f.blocks:
                if (n := held[h]) > 1:
                    held[h] = n - 1
                else:
                    del held[h]
            if not held:
                del self._blocks[f.key]
        del self._all[f.route_id]
        by_key = self._by_key[f.key]
        del by_key[f.route_id]
        if not by_key:
            del self._by_key[f.key]

    def scheduled(self, key: RankKey, block_hashes: Sequence[int]) -> int:
        """A BlockStored on the rank: its queued routes whose last full block is among `block_hashes` leave the queue
        (they stay active until released); returns how many did.

        vLLM stores a prompt's full blocks in the step that schedules them, so the route's prefill no longer waits,
        and the events say so within a step. Without it (CostConfig.scheduled_by_events off, the default), a route
        counts as queued until a /metrics look at least the reconcile grace after it (0.25-0.75 s), or its release.
        """
        n = 0
        if not self._by_hash:  # NOTE: no queued route anywhere (the common case): an event costs one test
            return n
        for h in block_hashes:
            same = self._by_hash.get(h)
            if same:
                for f in [f for f in same.values() if f.key == key]:
                    if self._unqueue(f):
                        self._ran(f)
                        n += 1
        return n

    def get(self, route_id: str) -> Flight | None:
        return self._all.get(route_id)

    def release(self, route_id: str, owner: str | None = None) -> Flight | None:
        """End a route; None if unknown, already ended, or `owner` is not the one that routed it."""
        f = self._all.get(route_id)
        if f is None or (owner is not None and f.owner is not None and f.owner != owner):
            return None
        self._remove(f)
        return f

    def expire(self, now: float) -> list[Flight]:
        """Drop routes older than the TTL (oldest first)."""
        out = []
        while self._all:
            f = next(iter(self._all.values()))
            if now - f.t < self.ttl_s:
                break
            self._remove(f)
            out.append(f)
        return out

    def reconcile(
        self, key: RankKey, num_running: float, num_waiting: float, polled_at: float
    ) -> list[Flight]:
        """Fold in a /metrics look that began at `polled_at`; return the routes found ended.

        Routes older than the grace have reached the worker. vLLM schedules first come, first
        served, so where it shows fewer requests than such routes the oldest have ended unreleased
        (dropped), and of the rest all but the newest `num_waiting` have been scheduled (their
        prefill no longer waits; they stay active until released).
        """
        flights = self._by_key.get(key)
        if not flights:
            return []
        due = [f for f in flights.values() if f.t <= polled_at - self.grace_s]
        num_ended = max(len(due) - math.floor(num_running + num_waiting), 0)
        for f in due[:num_ended]:
            self._remove(f)
        for f in due[num_ended : max(len(due) - math.floor(num_waiting), num_ended)]:
            if self._unqueue(f):
                self._ran(f)
        return due[:num_ended]

    def newest(self, worker: str) -> float | None:
        """When the newest tracked route to any rank of `worker` was decided (None: it has none)."""
        return max((next(reversed(fl.values())).t for key, fl in self._by_key.items() if key[0] == worker),
                   default=None)

    def drop_worker(self, worker: str) -> list[Flight]:
        out = [f for f in self._all.values() if f.key[0] == worker]
        for f in out:
            self._remove(f)
        for key in [key for key in self._means if key[0] == worker]:
            del self._means[key]
        return out

    def load(self, key: RankKey) -> tuple[int, int, int]:
        """(active requests, queued requests, queued tokens) tracked on the rank."""
        flights = self._by_key.get(key)
        if not flights:
            return 0, 0, 0
        queued = self._queued.get(key)
        # NOTE: .get: the scrape reads this from the metrics server's thread while the loop changes it; a queue that
        # emptied between the two reads raised KeyError and failed the whole scrape (found by review, not reproduced)
        return (len(flights), len(queued), self._queued_tokens.get(key, 0)) if queued else (len(flights), 0, 0)

    def extended(self, chain: Sequence[int]) -> dict[RankKey, int]:
        """Queued tokens per rank of routes whose whole prompt this chain extends (or repeats).

        Such a route is this conversation's earlier turn (turns are sequential: it has ended) or the
        same prompt, which vLLM prefills once; either way its tokens are not queued ahead of this one.
        """
        out: dict[RankKey, int] = {}
        if not self._by_hash:
            return out
        for h in chain:
            same = self._by_hash.get(h)
            if same:
                for f in same.values():
                    out[f.key] = out.get(f.key, 0) + f.num_tokens
        return out

    def pending(self, key: RankKey, chain: Sequence[int]) -> int:
        """How many leading blocks of `chain` a tracked route on the rank, not yet ended, has in its prompt.

        vLLM caches a prompt's full blocks in the step that schedules them (`cache_full_blocks` at allocation), so
        a request admitted with or after that route finds them cached, proven by KV events or not yet: two
        conversations of one system prompt routed 5 ms apart share its prefill on one worker, where the index
        alone (events only) saw it nowhere and sent the second to prefill it again elsewhere (issue #27).
        """
        held = self._blocks.get(key)
        if not held:
            return 0
        n = 0
        for h in chain:
            if h not in held:
                break
            n += 1
        return n

    def mean_tokens(self, key: RankKey) -> float:
        """The size an untracked waiting request counts at on the rank: the running mean prefill of the tracked
        routes a /metrics look saw it schedule (the configured default before any).

        NOTE: it was one mean for every rank, moved by every tracked route when it was decided: one tenant's
        64 tracked 8,192-token Routes, released at once and never sent, raised it from 256 to 5,295 tokens, and
        another tenant's fully warm prompt left a worker with 2 untracked requests waiting (queued 512 -> 10,591
        tokens) COLD. Now only a route the rank's own count showed scheduled moves that rank's mean.
        """
        seen = self._means.get(key)
        return float(self.default_tokens) if seen is None else seen[0]
