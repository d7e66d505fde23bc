"""The working-set ledger's bounds: a candidate's demand costs a few rate look-ups however many groups
the rank holds, a cache loss touches only that rank's records, and the records are capped (the oldest
leaves first). Controls: on ordinary workloads (a few groups, conversations that grow, move, expire
and lose their cache) every demand figure is what the whole-table formula gives."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Iterator

from controller.demand import Conversation, DemandLedger, RankKey

W0, W1, W2 = ("w0", 0), ("w1", 0), ("w1", 1)


def reference(
    ws: DemandLedger,
    key: RankKey,
    prev: Conversation | None,
    num_blocks: int,
    num_shared: int,
    group: int = 0,
) -> float:
    """The demand formula over the rank's whole table of records (the ledger before its bounds), unrounded."""
    rate = ws.evidence.rate
    own: dict[tuple[int, int], int] = {}
    shared: dict[tuple[int, int], dict[int, int]] = {}
    for c in ws._conv.values():
        if c.key == key and c is not prev:
            own[c.stage] = own.get(c.stage, 0) + c.num_blocks - c.num_shared
            sh = shared.setdefault(c.stage, {})
            sh[c.num_shared] = sh.get(c.num_shared, 0) + 1
    total = sum(rate(st) * n for st, n in own.items())
    top = max((rate(st) * s for st, sh in shared.items() for s in sh), default=0.0)
    if num_blocks:
        st = (prev.group, 1) if prev is not None else (group, 0)
        k = min(num_shared, num_blocks)
        total += rate(st) * (num_blocks - k)
        top = max(top, rate(st) * k)
    return total + top


def assert_same(
    ws: DemandLedger, key: RankKey, prev: Conversation | None, n: int, s: int, group: int = 0
) -> None:
    want = reference(ws, key, prev, n, s, group)
    got = ws.demand_with(key, prev, n, s, group)
    if abs(want % 1 - 0.5) > 1e-9:  # NOTE: a sum at exactly .5 may round either way in another order
        assert got == round(want), (key, prev, n, s, group, want, got)


def test_demand_with_looks_up_a_few_rates_however_many_groups_the_rank_holds() -> None:
    """One tenant's 3,000 groups on w0 (in each, one conversation came back and another waits): another
    tenant's candidate there looks up at most 3 rates (before: two per stage, 12,000 per candidate)."""
    ws = DemandLedger()
    for g in range(3000):
        ws.place(W0, [10**9 + g, 2 * 10**9 + g], 1, now=0.0, group=10**9 + g)
        ws.place(W0, [10**9 + g, 2 * 10**9 + g], 1, now=0.0)  # back again: its group's first turns weigh
        ws.place(W0, [10**9 + g, 3 * 10**9 + g], 1, now=0.0, group=10**9 + g)
    calls = 0
    rate = ws.evidence.rate

    def counted(st: tuple[int, int]) -> float:
        nonlocal calls
        calls += 1
        return rate(st)

    ws.evidence.rate = counted  # type: ignore[method-assign]
    prev = ws.previous([10**9 + 7, 3 * 10**9 + 7, 5])
    assert prev is not None
    for args in ((None, 2, 1, 5), (prev[1], 3, 1, 0), (None, 0, 0, 0)):
        calls = 0
        ws.demand_with(W0, *args)
        assert calls <= 3, (args, calls)
    ws.evidence.rate = rate  # type: ignore[method-assign]
    assert_same(ws, W0, None, 2, 1, 5)
    assert_same(ws, W0, prev[1], 3, 1)
    assert_same(ws, W0, None, 0, 0)
    assert ws.demand(W0) > 900  # each waiting conversation's own block, by its group's rate


class CountingDict(OrderedDict[int, Conversation]):
    """The ledger's records, counting each one an iteration over them yields."""

    yielded = 0

    def items(self) -> Iterator[tuple[int, Conversation]]:  # type: ignore[override]
        for kv in super().items():
            CountingDict.yielded += 1
            yield kv

    def values(self) -> Iterator[Conversation]:  # type: ignore[override]
        for _, c in self.items():
            yield c

    def __iter__(self) -> Iterator[int]:
        for h, _ in self.items():
            yield h


def test_a_cache_loss_touches_only_that_ranks_records() -> None:
    """5,000 conversations on w0, 3 on w1: w1's cache loss looks at no record of w0's (before: all
    5,003 on every clear, sleep or reset of any rank), and leaves w0's demand as it was."""
    ws = DemandLedger()
    for i in range(5000):
        ws.place(W0, [i, 10**6 + i], 0, now=0.0)
    ws.place(W0, [7, 10**6 + 7], 0, now=0.0)  # a return: w0 has demand
    for i in range(3):
        ws.place(W1, [2 * 10**6 + i], 0, now=0.0)
    before = ws.demand(W0)
    assert before > 0
    ws._conv = CountingDict(ws._conv)
    CountingDict.yielded = 0
    ws.forget_rank(W1)
    assert CountingDict.yielded <= 3
    assert len(ws) == 5000 and ws.demand(W0) == before and ws.demand(W1) == 0
    assert ws.previous([2 * 10**6]) is None and ws.previous([0, 10**6]) is not None
    ws.forget_rank(W0)
    assert len(ws) == 0 and ws.demand(W0) == 0


def test_the_records_are_capped_and_the_oldest_leaves_first() -> None:
    """A flood of one-shots past MAX_CONVERSATIONS keeps MAX_CONVERSATIONS records, the latest ones; a
    small cap behaves the same, and the demand of what is left is the formula's over what is left."""
    from controller.demand import MAX_CONVERSATIONS  # NOTE: here, so the other tests run on the old ledger

    ws = DemandLedger()
    n = MAX_CONVERSATIONS + 100
    for i in range(n):
        ws.place(W0 if i % 2 else W1, [i], 0, now=0.0)
    assert len(ws) == MAX_CONVERSATIONS
    assert ws.previous([99]) is None and ws.previous([100]) is not None and ws.previous([n - 1]) is not None

    small = DemandLedger(max_conversations=50)
    for i in range(40):  # 40 conversations, each back for 3 turns: their stages earn weight
        for t in range(3):
            small.place(
                (f"w{i % 3}", 0), [1, 2, 3] + [1000 * i + k for k in range(t + 1)], 3, now=float(i), group=3
            )
    for i in range(30):
        small.place(W0, [10**6 + i], 0, now=100.0 + i)
    assert len(small) == 50
    kept = sorted(c.t for c in small._conv.values())
    assert kept[0] == 20.0 and kept[-1] == 129.0  # conversations 0-19 were the oldest: they left
    for w in ("w0", "w1", "w2"):
        assert_same(small, (w, 0), None, 0, 0)
        assert_same(small, (w, 0), None, 9, 3, 3)
    assert small.demand(("w1", 0)) > 0


def test_ordinary_workloads_give_the_whole_table_figures() -> None:
    """Control: conversations in 3 system-prompt groups and one-shots across 3 ranks, growing turn by
    turn, moved by the proxy, expiring and losing their cache: at every step every rank's demand, and
    with each candidate turn, is the whole-table formula's (the decayed rates of the default window)."""
    rng = random.Random(27)
    ws = DemandLedger(ttl_s=50.0)
    systems = {g: [g * 10**6 + k for k in range(4)] for g in (1, 2, 3)}
    convs: list[list[int]] = []
    keys = [W0, W1, W2]
    for step in range(1500):
        now = step * 0.1
        op = rng.random()
        if op < 0.35 or not convs:  # a new conversation, or a one-shot
            if rng.random() < 0.7:
                g = rng.choice(list(systems))
                chain = systems[g] + [step * 100 + k for k in range(rng.randint(1, 4))]
                convs.append(chain)
                ws.place(rng.choice(keys), chain, 4, now, group=systems[g][-1])
            else:
                ws.place(rng.choice(keys), [7 * 10**8 + step, 7 * 10**8 + step + 1], 0, now)
        elif op < 0.85:  # a conversation's next turn
            i = rng.randrange(len(convs))
            chain = convs[i] = convs[i] + [step * 100 + 50 + k for k in range(rng.randint(1, 3))]
            prev = ws.previous(chain)
            for key in keys:
                assert_same(ws, key, prev[1] if prev else None, len(chain), 4, chain[3])
            ws.place(rng.choice(keys), chain, rng.choice((4, 4, 4, 5)), now, group=chain[3])
        elif op < 0.95:
            ws.move(rng.choice(convs)[-1], rng.choice(keys))
        elif op < 0.955:
            ws.forget_rank(rng.choice(keys))
        else:
            ws.expire(now)
        for key in keys:
            assert_same(ws, key, None, 0, 0)
            assert_same(ws, key, None, 8, 4, systems[1][-1])
    assert len(ws) > 50 and max(ws.demand(k) for k in keys) > 0


def test_many_shared_sizes_and_rates_give_the_whole_table_figures() -> None:
    """The kept terms against the whole-table formula where the heaps work: later turns of one group
    with shared prefixes of 30 different sizes coming and going on 2 ranks (the largest leaving, ties,
    a turn's record moving between ranks), with a short window so every rate keeps changing."""
    rng = random.Random(5)
    ws = DemandLedger(window=4)
    head = list(range(1, 41))
    convs = [head + [10**6 * (i + 1)] for i in range(60)]
    for i, chain in enumerate(convs):
        ws.place(W0 if i % 2 else W1, chain, 40, now=0.0, group=40)
    for step in range(3000):
        i = rng.randrange(len(convs))
        chain = convs[i] = convs[i] + [10**6 * (i + 1) + step + 1]
        prev = ws.previous(chain)
        s = rng.randint(1, 30)
        for key in (W0, W1):
            assert_same(ws, key, prev[1] if prev else None, len(chain), s, 40)
        ws.place(rng.choice((W0, W1)), chain, s, now=0.0)
        if step % 97 == 0:
            ws.move(rng.choice(convs)[-1], rng.choice((W0, W1)))
        for key in (W0, W1):
            assert_same(ws, key, None, 0, 0)
    assert len(ws) == 60 and ws.demand(W0) > 0 and ws.demand(W1) > 0


def test_a_tenant_past_the_cap_loses_its_own_records_not_anothers() -> None:
    """Tenant b places 200 one-shots into a ledger capped at 100 records, after tenant a's 20 live
    conversations: a keeps all 20 (before, the globally oldest left first, a's among them) and b keeps
    the 80 newest of its own. Control: a alone past the cap loses its own oldest, as before."""
    ws = DemandLedger(max_conversations=100)
    for i in range(20):
        ws.place(W0, [1, 2, 5000 + i], 2, now=float(i), group=2, tenant="a")
    for i in range(200):
        ws.place(W1, [10**6 + i], 0, now=100.0 + i, tenant="b")
    mine = [c.tenant for c in ws._conv.values()]
    assert mine.count("a") == 20 and mine.count("b") == 80     # NOTE: before, a's 20 were the first to leave
    assert ws.previous([10**6 + 119]) is None and ws.previous([10**6 + 120]) is not None
    assert_same(ws, W0, None, 0, 0)
    assert_same(ws, W1, None, 0, 0)
    alone = DemandLedger(max_conversations=10)
    for i in range(15):
        alone.place(W0, [i], 0, now=float(i), tenant="a")
    assert sorted(c.t for c in alone._conv.values()) == [float(i) for i in range(5, 15)]


def test_a_tenant_past_the_evidence_bound_loses_its_own_rates_not_anothers() -> None:
    """Tenant a's system-prompt group has earned a return rate; tenant b then begins more groups than the
    evidence holds (max_groups 64). a's rate, and so its conversations' weight on w0, survive (before,
    every rate went back to 0); b's own evidence is what is dropped. The demand still matches the
    whole-table formula."""
    ws = DemandLedger(max_groups=64, window=math.inf)
    for i in range(6):                                       # a's conversations: each comes back once
        first = [1, 2, 3, 9000 + 10 * i]
        ws.place(W0, first, 3, now=0.0, group=3, tenant="a")
        ws.place(W0, first + [9001 + 10 * i], 3, now=0.0, group=3, tenant="a")
    ws.place(W0, [1, 2, 3, 9999, 9998], 3, now=0.0, group=3, tenant="a")   # a new one: its first turn weighs
    rate = ws.evidence.rate((3, 0))
    weight = ws.demand(W0)
    assert rate > 0 and weight > 0
    for g in range(200):                                     # b: 200 groups of its own, one request each
        ws.place(W1, [10**7 + g, 2 * 10**7 + g], 1, now=0.0, group=10**7 + g, tenant="b")
    assert ws.evidence.rate((3, 0)) == rate and ws.demand(W0) == weight   # NOTE: before, 0 and less
    assert len(ws.evidence._placed) <= 64
    assert_same(ws, W0, None, 0, 0)
    assert_same(ws, W1, None, 0, 0)


def test_dropping_a_tenants_evidence_updates_only_its_stages() -> None:
    """Evidence full and spread over 16 tenants (4 stages each, 64 in all): a new stage drops one tenant's 4,
    and the ledger updates those 4 and the new one, not every rank's every stage (before this, each drop
    recomputed all of them: 22 ms per place with 8,191 tenants at the default bound). Demand figures still
    match the whole-table formula."""
    ws = DemandLedger(max_groups=64, window=math.inf)
    for g in range(64):
        ws.place((f"w{g % 4}", 0), [g, 10**6 + g], 1, now=0.0, group=g, tenant=f"t{g // 4}")
    calls: list[tuple[int, int]] = []
    rerate = ws._rerate
    ws._rerate = lambda st, old: (calls.append(st), rerate(st, old))[1]  # type: ignore[method-assign]
    ws.place(W0, [10**8, 10**8 + 1], 1, now=0.0, group=10**8, tenant="x")
    assert len(calls) == 5 and len(ws.evidence._placed) == 61
    for k in ((f"w{i}", 0) for i in range(4)):
        assert_same(ws, k, None, 0, 0)
        assert_same(ws, k, None, 4, 1, 3)
