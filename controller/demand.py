"""The working set the router has placed on each rank: which conversations, and how many blocks.

Pure (the caller passes `now`). A conversation is a chain of block hashes that grows turn by turn;
a new request whose chain contains the last hash of a recorded one *extends* it (the next turn),
so the record moves to wherever this turn is placed. A rank's demand is the blocks its recent
conversations need to stay warm: each one's own blocks, plus the largest prefix they share (a
system prompt) once. It can exceed the rank's capacity, which is exactly what the index cannot
show (the index never holds more than fits): an over-committed rank thrashes every round, since
with vLLM's LRU the blocks it evicts are the ones the next turns need.

    demand(w) = max(shared blocks on w) + sum over conversations on w of (blocks - shared)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

RankKey = tuple[str, int]
LOOKBACK = 4096  # blocks searched backwards for the previous turn's last hash


class Conversation(NamedTuple):
    key: RankKey
    num_blocks: int
    num_shared: int
    t: float


class WorkingSet:
    """Conversations placed per rank, forgotten `ttl_s` after their last turn."""

    def __init__(self, ttl_s: float = 300.0) -> None:
        self.ttl_s = ttl_s
        self._conv: OrderedDict[int, Conversation] = OrderedDict()  # last hash -> record, oldest first
        self._own: dict[RankKey, int] = {}
        self._shared: dict[RankKey, dict[int, int]] = {}  # key -> {num_shared: conversations}

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
        """Blocks the rank's conversations need now."""
        return self.demand_with(key, None, 0, 0)

    def demand_with(self, key: RankKey, prev: Conversation | None, num_blocks: int, num_shared: int) -> int:
        """The rank's demand if this turn (`num_blocks`, `num_shared` of them shared) went there;
        `prev`: the record of the conversation's earlier turn, wherever it is."""
        own = self._own.get(key, 0) + num_blocks - min(num_shared, num_blocks)
        shared = dict(self._shared.get(key, {}))
        if prev is not None and prev.key == key:
            own -= prev.num_blocks - prev.num_shared
            shared[prev.num_shared] -= 1
        top = max((s for s, n in shared.items() if n > 0), default=0)
        return own + max(top, min(num_shared, num_blocks))

    def place(self, key: RankKey, chain: Sequence[int], num_shared: int, now: float) -> None:
        """This turn of the conversation went to `key` (an earlier turn's record moves with it)."""
        self.expire(now)
        if not chain:
            return
        prev = self.previous(chain)
        if prev is not None:
            self._drop(*prev)
        self._drop_hash(chain[-1])
        c = Conversation(key, len(chain), min(num_shared, len(chain)), now)
        self._conv[chain[-1]] = c
        self._own[key] = self._own.get(key, 0) + c.num_blocks - c.num_shared
        sh = self._shared.setdefault(key, {})
        sh[c.num_shared] = sh.get(c.num_shared, 0) + 1

    def expire(self, now: float) -> None:
        while self._conv:
            h, c = next(iter(self._conv.items()))
            if now - c.t < self.ttl_s:
                break
            self._drop(h, c)

    def forget_rank(self, key: RankKey) -> None:
        """The rank is gone (unregistered): its conversations are no longer its demand."""
        for h, c in [(h, c) for h, c in self._conv.items() if c.key == key]:
            self._drop(h, c)

    def _drop_hash(self, h: int) -> None:
        c = self._conv.get(h)
        if c is not None:
            self._drop(h, c)

    def _drop(self, h: int, c: Conversation) -> None:
        del self._conv[h]
        self._own[c.key] -= c.num_blocks - c.num_shared
        sh = self._shared[c.key]
        sh[c.num_shared] -= 1
        if not sh[c.num_shared]:
            del sh[c.num_shared]
