"""The working set the router has placed on each rank: which conversations, weighted by how likely they return.

Pure (the caller passes `now`). A conversation is a chain of block hashes that grows turn by turn;
a new request whose chain contains the last hash of a recorded one *extends* it (the next turn, or
the same prompt again), so the record moves to wherever this turn is placed. A rank's demand is the
blocks its recent conversations need to stay warm, each counted in proportion to the evidence that
it comes back: a one-shot request that never returns must not make its rank look over-committed
and push live conversations away (issue #27).

Evidence is pooled per (prefix group, stage): the group is the shared prefix a request continues
(its last fork block, e.g. a system prompt or a few-shot preamble; 0 when none) and the stage is
"first request" or "a later turn". For each, a decayed count of records placed and of records that
came back; the return rate is returned / (placed + 1), so a group earns weight only once returns
are seen (no prior: one-shots sharing a few-shot prefix weigh 0 from the start).

    demand(w) = max over groups on w of rate * shared blocks
                + sum over conversations c on w of rate(c) * (blocks(c) - shared(c))

Demand can exceed the rank's capacity, which is what the index cannot show (it never holds more
than fits): an over-committed rank thrashes every round, since with vLLM's LRU the blocks it evicts
are the ones the next turns need. Cache loss (AllBlocksCleared, sleep, reset) empties a rank's
records (`forget_rank`): its conversations will be prefilled wherever they go next.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

RankKey = tuple[str, int]
Stage = tuple[int, int]  # (group, 0: a first request | 1: a later turn)
LOOKBACK = 4096  # blocks searched backwards for the previous turn's last hash
MAX_GROUPS = 1 << 14  # evidence kept for this many (group, stage) pairs, then relearned


class Conversation(NamedTuple):
    key: RankKey
    num_blocks: int
    num_shared: int
    t: float
    group: int = 0
    turns: int = 1

    @property
    def stage(self) -> Stage:
        return self.group, 1 if self.turns > 1 else 0


class Evidence:
    """Decayed counts of records placed and records that came back, per (group, stage)."""

    def __init__(self, window: float = 64) -> None:
        self.decay = 1.0 - 1.0 / window
        self._placed: dict[Stage, float] = {}
        self._returned: dict[Stage, float] = {}

    def placed(self, st: Stage) -> None:
        if len(self._placed) > MAX_GROUPS:
            self._placed.clear()
            self._returned.clear()
        self._placed[st] = self._placed.get(st, 0.0) * self.decay + 1.0
        self._returned[st] = self._returned.get(st, 0.0) * self.decay

    def returned(self, st: Stage) -> None:
        if st in self._placed:
            self._returned[st] = min(self._returned[st] + 1.0, self._placed[st])

    def rate(self, st: Stage) -> float:
        """Share of recent records of this (group, stage) that came back (0 without evidence)."""
        p = self._placed.get(st)
        return self._returned[st] / (p + 1.0) if p is not None else 0.0


class DemandLedger:
    """Conversations placed per rank, forgotten `ttl_s` after their last turn."""

    def __init__(self, ttl_s: float = 300.0, window: float = 64) -> None:
        """`window`: the evidence decays by 1 - 1/window per record placed in a (group, stage)."""
        self.ttl_s = ttl_s
        self.evidence = Evidence(window)
        self._conv: OrderedDict[int, Conversation] = OrderedDict()  # last hash -> record, oldest first
        self._own: dict[RankKey, dict[Stage, int]] = {}  # own (unshared) blocks per stage
        self._shared: dict[RankKey, dict[Stage, dict[int, int]]] = {}  # {num_shared: conversations}

    def __len__(self) -> int:
        return len(self._conv)

    def previous(self, chain: Sequence[int]) -> tuple[int, Conversation] | None:
        """The recorded conversation this chain extends (its last hash inside the chain), if any."""
        conv = self._conv
        for h in reversed(chain[-LOOKBACK:]):
            c = conv.get(h)
            if c is not None:
                return h, c
        return None

    def demand(self, key: RankKey) -> int:
        """Blocks the rank's conversations need now, weighted by their return rates."""
        return self.demand_with(key, None, 0, 0)

    def demand_with(
        self, key: RankKey, prev: Conversation | None, num_blocks: int, num_shared: int, group: int = 0
    ) -> int:
        """The rank's demand if this turn (`num_blocks`, `num_shared` of them shared, in `group`) went
        there; `prev`: the record of the conversation's earlier turn, wherever it is."""
        rate = self.evidence.rate
        own = dict(self._own.get(key, {}))
        shared = {st: dict(sh) for st, sh in self._shared.get(key, {}).items()}
        if prev is not None and prev.key == key:
            own[prev.stage] = own.get(prev.stage, 0) - (prev.num_blocks - prev.num_shared)
            shared[prev.stage][prev.num_shared] -= 1
        total = sum(rate(st) * n for st, n in own.items())
        top = max((rate(st) * s for st, sh in shared.items() for s, n in sh.items() if n > 0), default=0.0)
        if num_blocks:
            st = (prev.group, 1) if prev is not None else (group, 0)
            k = min(num_shared, num_blocks)
            total += rate(st) * (num_blocks - k)
            top = max(top, rate(st) * k)
        return round(total + top)

    def place(self, key: RankKey, chain: Sequence[int], num_shared: int, now: float, group: int = 0) -> None:
        """This turn of the conversation went to `key` (an earlier turn's record moves with it, and
        counts as a return for its group)."""
        self.expire(now)
        if not chain:
            return
        turns = 1
        prev = self.previous(chain)
        if prev is not None:
            self._drop(*prev)
            self.evidence.returned(prev[1].stage)
            turns, group = prev[1].turns + 1, prev[1].group
        self._drop_hash(chain[-1])
        c = Conversation(key, len(chain), min(num_shared, len(chain)), now, group, turns)
        self.evidence.placed(c.stage)
        self._add(chain[-1], c)

    def move(self, last_hash: int, key: RankKey) -> None:
        """The turn recorded under `last_hash` ran on `key` instead (the proxy sent it elsewhere): the
        record changes rank, and nothing else (no evidence: it is the same placement)."""
        c = self._conv.get(last_hash)
        if c is None or c.key == key:
            return
        self._drop(last_hash, c)
        self._add(last_hash, c._replace(key=key))

    def _add(self, h: int, c: Conversation) -> None:
        self._conv[h] = c
        own = self._own.setdefault(c.key, {})
        own[c.stage] = own.get(c.stage, 0) + c.num_blocks - c.num_shared
        sh = self._shared.setdefault(c.key, {}).setdefault(c.stage, {})
        sh[c.num_shared] = sh.get(c.num_shared, 0) + 1

    def expire(self, now: float) -> None:
        while self._conv:
            h, c = next(iter(self._conv.items()))
            if now - c.t < self.ttl_s:
                break
            self._drop(h, c)

    def forget_rank(self, key: RankKey) -> None:
        """The rank lost its cache (cleared, slept, reset) or is gone: its conversations are no longer
        its demand (their next turns are prefilled wherever they go)."""
        for h, c in [(h, c) for h, c in self._conv.items() if c.key == key]:
            self._drop(h, c)

    def _drop_hash(self, h: int) -> None:
        c = self._conv.get(h)
        if c is not None:
            self._drop(h, c)

    def _drop(self, h: int, c: Conversation) -> None:
        del self._conv[h]
        own = self._own[c.key]
        own[c.stage] = own.get(c.stage, 0) - (c.num_blocks - c.num_shared)
        if not own[c.stage]:
            del own[c.stage]
        sh = self._shared[c.key][c.stage]
        sh[c.num_shared] -= 1
        if not sh[c.num_shared]:
            del sh[c.num_shared]
        if not sh:
            del self._shared[c.key][c.stage]
