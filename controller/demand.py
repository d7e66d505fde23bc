"""The working set the router has placed on each rank: which conversations, weighted by how likely they return.

Pure (the caller passes `now`). A conversation is a chain of block hashes that grows turn by turn;
a new request whose chain contains the last hash of a recorded one *extends* it (the next turn, or
the same prompt again), so the record moves to wherever this turn is placed. A rank's demand is the
blocks its recent conversations need to stay warm, each counted in proportion to the evidence that
it comes back: a one-shot request that never returns must not make its rank look over-committed
and push live conversations away (issue #27).

Evidence is pooled per (prefix group, stage): the group is the shared prefix a request continues
(its last fork block, e.g. a system prompt or a few-shot preamble; when none, a group of the tenant's own,
controller/ordering.py `solo_group`) and the stage is
"first request" or "a later turn". For each, a decayed count of records placed and of records that
came back; the return rate is returned / (placed + 1), so a group earns weight only once returns
are seen (no prior: one-shots sharing a few-shot prefix weigh 0 from the start).

    demand(w) = max over groups on w of rate * shared blocks
                + sum over conversations c on w of rate(c) * (blocks(c) - shared(c))

Demand can exceed the rank's capacity, which is what the index cannot show (it never holds more
than fits): an over-committed rank thrashes every round, since with vLLM's LRU the blocks it evicts
are the ones the next turns need. Cache loss (AllBlocksCleared, sleep, reset) empties a rank's
records (`forget_rank`): its conversations will be prefilled wherever they go next.

Bounded per Route: each rank keeps both terms up to date as records come and go and as rates change
(a rate changes only when its own (group, stage) is placed or returns; then the few ranks holding that
stage are updated), so a candidate's demand costs a few rate look-ups, not one per group on the rank:
one tenant's many cheap groups no longer slow every Route. A rank's records are indexed, so a cache
loss touches only that rank's; and at most `max_conversations` records are kept (the oldest last turn
leaves first, as it would by the TTL).

Fair between tenants: past `max_conversations`, the record that leaves is the oldest of the tenant holding the
most; past `max_groups` (group, stage) pairs of evidence, the tenant that began the most of them loses its
own. Before, one tenant placing 65,536 conversations within the TTL made every other tenant's oldest
conversations look new, and one starting 16,384 groups wiped every tenant's return rates.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from controller.evidence import MAX_GROUPS, Evidence, Stage
from controller.lazy_heaps import KeyedMax, SizeMultiset
from controller.owned import Counts

RankKey = tuple[str, int]
LOOKBACK = 4096  # blocks searched backwards for the previous turn's last hash
# Conversation records kept, all ranks together (then the oldest leaves first): ~320 bytes each with
# the rank's terms, ~900 where each is a group of its own, so 20-60 MiB. The largest bench/fleet_routing.py
# cell places 600 requests (mooncake), the others fewer; this is 100x that, or 109 new conversations a
# second all held for the router's default 600 s TTL (CostConfig.working_set_ttl_s).
MAX_CONVERSATIONS = 1 << 16


class Conversation(NamedTuple):
    key: RankKey
    num_blocks: int
    num_shared: int
    t: float
    group: int = 0
    turns: int = 1
    tenant: str = ""  # who placed its last turn (the record's share of the cap is theirs)
    root: int | None = None  # its first block's hash: conversations of one system prompt (and tenant) share it

    @property
    def stage(self) -> Stage:
        return self.group, 1 if self.turns > 1 else 0


class _Rank:
    """One rank's records and both terms of its demand, kept up to date."""

    __slots__ = ("own", "records", "roots", "sizes", "top", "total")

    def __init__(self) -> None:
        self.records: dict[int, None] = {}  # last hashes of its conversations
        self.roots: dict[int | None, int] = {}  # records per first block hash
        self.own: dict[Stage, int] = {}  # own (unshared) blocks per stage
        self.sizes: dict[Stage, SizeMultiset] = {}  # shared blocks of each stage's records
        self.total = 0.0  # sum over stages of rate * own blocks
        self.top: KeyedMax[Stage] = KeyedMax()  # rate * the stage's largest shared size, per stage


class DemandLedger:
    """Conversations placed per rank, forgotten `ttl_s` after their last turn, at most
    `max_conversations` of them (the oldest last turn leaves first)."""

    def __init__(
        self, ttl_s: float = 300.0, window: float = 64, max_conversations: int = MAX_CONVERSATIONS,
        max_groups: int = MAX_GROUPS,
    ) -> None:
        """`window`: the evidence decays by 1 - 1/window per record placed in a (group, stage)."""
        if max_conversations < 1 or max_groups < 1:
            raise ValueError(f"max_conversations and max_groups must be >= 1, got {max_conversations}, {max_groups}")
        self.ttl_s = ttl_s
        self.max_conversations = max_conversations
        self.evidence = Evidence(window, max_groups)
        self._conv: OrderedDict[int, Conversation] = OrderedDict()  # last hash -> record, oldest first
        self._mine: dict[str, OrderedDict[int, None]] = {}  # per tenant: its records' last hashes, oldest first
        self._held = Counts()  # the same, counted
        self._ranks: dict[RankKey, _Rank] = {}
        self._holders: dict[Stage, tuple[RankKey, ...]] = {}  # the ranks holding records of each stage

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
        there; `prev`: the record of the conversation's earlier turn, wherever it is.

        At most three rate look-ups and two heap peeks, however many stages the rank holds. The kept
        sums are updated by differences: the figure is the whole-table formula's up to float rounding
        (an unrounded demand of exactly n + 0.5 may round either way)."""
        rate = self.evidence.rate
        total = top = 0.0
        r = self._ranks.get(key)
        if r is not None:
            total = r.total
            if prev is not None and prev.key == key:
                st, rp = prev.stage, rate(prev.stage)
                total -= rp * (prev.num_blocks - prev.num_shared)
                top = max(r.top.max_without(st), rp * r.sizes[st].max_without_one(prev.num_shared))
            else:
                top = r.top.max()
        if num_blocks:
            st = (prev.group, 1) if prev is not None else (group, 0)
            k = min(num_shared, num_blocks)
            rs = rate(st)
            total += rs * (num_blocks - k)
            top = max(top, rs * k)
        return round(total + top)

    def serves_other_prefix(self, key: RankKey, root: int) -> bool:
        """Whether the rank holds a conversation whose first block is not `root`: one of another system prompt or
        another tenant (vLLM's block hashes carry the tenant's cache salt)."""
        r = self._ranks.get(key)
        return r is not None and len(r.roots) > (root in r.roots)

    def place(self, key: RankKey, chain: Sequence[int], num_shared: int, now: float, group: int = 0,
              tenant: str | None = "") -> None:
        """This turn of the conversation, `tenant`'s, went to `key` (an earlier turn's record moves with it,
        and counts as a return for its group)."""
        self.expire(now)
        if not chain:
            return
        turns = 1
        prev = self.previous(chain)
        if prev is not None:
            self._drop(*prev)
            st, old = prev[1].stage, self.evidence.rate(prev[1].stage)
            self.evidence.returned(st)
            self._rerate(st, old)
            turns, group = prev[1].turns + 1, prev[1].group
        self._drop_hash(chain[-1])
        tenant = tenant or ""
        c = Conversation(key, len(chain), min(num_shared, len(chain)), now, group, turns, tenant, chain[0])
        old = self.evidence.rate(c.stage)
        for st, was in self.evidence.placed(c.stage, tenant).items():  # the largest tenant's evidence, dropped
            self._rerate(st, was)
        self._rerate(c.stage, old)
        self._add(chain[-1], c)
        while len(self._conv) > self.max_conversations:  # the oldest record of the tenant holding the most
            h = next(iter(self._mine[self._held.largest()]))
            self._drop(h, self._conv[h])

    def move(self, last_hash: int, key: RankKey) -> None:
        """The turn recorded under `last_hash` ran on `key` instead (the proxy sent it elsewhere): the
        record changes rank, and nothing else (no evidence: it is the same placement)."""
        c = self._conv.get(last_hash)
        if c is None or c.key == key:
            return
        self._drop(last_hash, c)
        self._add(last_hash, c._replace(key=key))

    def expire(self, now: float) -> None:
        while self._conv:
            h, c = next(iter(self._conv.items()))
            if now - c.t < self.ttl_s:
                break
            self._drop(h, c)

    def forget_rank(self, key: RankKey) -> None:
        """The rank lost its cache (cleared, slept, reset) or is gone: its conversations are no longer
        its demand (their next turns are prefilled wherever they go). Touches that rank's records only."""
        r = self._ranks.pop(key, None)
        if r is None:
            return
        for h in r.records:
            self._unmine(h, self._conv.pop(h))
        for st in r.sizes:
            self._unhold(st, key)

    def _rerate(self, st: Stage, old: float) -> None:
        """The rate of `st` changed from `old`: update the ranks holding records of it."""
        new = self.evidence.rate(st)
        if new == old:
            return
        for key in self._holders.get(st, ()):
            r = self._ranks[key]
            r.total += (new - old) * r.own.get(st, 0)
            r.top.set(st, new * r.sizes[st].max())

    def _add(self, h: int, c: Conversation) -> None:
        self._conv[h] = c
        self._mine.setdefault(c.tenant, OrderedDict())[h] = None
        self._held.add(c.tenant, 1)
        r = self._ranks.get(c.key)
        if r is None:
            r = self._ranks[c.key] = _Rank()
        r.records[h] = None
        r.roots[c.root] = r.roots.get(c.root, 0) + 1
        st, n = c.stage, c.num_blocks - c.num_shared
        rate = self.evidence.rate(st)
        r.own[st] = r.own.get(st, 0) + n
        r.total += rate * n
        sz = r.sizes.get(st)
        if sz is None:
            sz = r.sizes[st] = SizeMultiset()
            self._holders[st] = self._holders.get(st, ()) + (c.key,)
        sz.add(c.num_shared)
        r.top.set(st, rate * sz.max())

    def _drop_hash(self, h: int) -> None:
        c = self._conv.get(h)
        if c is not None:
            self._drop(h, c)

    def _unmine(self, h: int, c: Conversation) -> None:
        mine = self._mine[c.tenant]
        del mine[h]
        if not mine:
            del self._mine[c.tenant]
        self._held.add(c.tenant, -1)

    def _drop(self, h: int, c: Conversation) -> None:
        del self._conv[h]
        self._unmine(h, c)
        r = self._ranks[c.key]
        del r.records[h]
        if not r.records:  # NOTE: its terms start again from 0, not from what rounding left
            del self._ranks[c.key]
            for st in r.sizes:
                self._unhold(st, c.key)
            return
        if (left := r.roots[c.root] - 1) > 0:
            r.roots[c.root] = left
        else:
            del r.roots[c.root]
        st, n = c.stage, c.num_blocks - c.num_shared
        rate = self.evidence.rate(st)
        left = r.own.get(st, 0) - n
        if left:
            r.own[st] = left
        else:
            r.own.pop(st, None)
        r.total -= rate * n
        sz = r.sizes[st]
        sz.remove(c.num_shared)
        if sz:
            r.top.set(st, rate * sz.max())
        else:
            del r.sizes[st]
            r.top.discard(st)
            self._unhold(st, c.key)

    def _unhold(self, st: Stage, key: RankKey) -> None:
        ks = tuple(k for k in self._holders[st] if k != key)
        if ks:
            self._holders[st] = ks
        else:
            del self._holders[st]
