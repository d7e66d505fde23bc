"""Placement by cost (controller/cost.py): exact choices of the pure model, then the real Router on sims.

Every expected choice below is worked out from the formula in docs/routing.md with the default
weights (queue 0.5, request 16, pressure 1.0); the comments show the arithmetic.
"""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import aiohttp
import grpc
import pytest

from controller.auth import mint_token
from controller.branches import Branches
from controller.config import ControllerConfig
from controller.cost import CandidateState, CostConfig, order, terms
from controller.index import PrefixIndex
from controller.inflight import Flight, InFlight
from controller.metrics import Metrics
from controller.router import RouteDecision, Router, RouterConfig, WorkerSpec
from controller.server import build_server
from controller.vllm.events import BlockRemoved, BlockStored
from controller.vllm.http import parse_metrics
from fleet.api.kvfleet.v1 import route_pb2
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.errors import InvalidArgument
from fleet.sdk import base, types

CFG = CostConfig()
QW = CFG.queue_weight  # 0.25
B = 16


def _state(
    worker: str, cached: int = 0, *, serving: bool = True, proven: bool = True, **kw: object
) -> CandidateState:
    return CandidateState(worker, 0, serving, proven, B, cached, **kw)  # type: ignore[arg-type]


class Fleet:
    """The router's bookkeeping in miniature: candidates, index residency and the in-flight ledger."""

    def __init__(self, cached: dict[str, int], cfg: CostConfig = CFG) -> None:
        self.cfg, self.cached = cfg, cached
        self.resident = {w: c // B for w, c in cached.items()}
        self.flights = InFlight(cfg.inflight_ttl_s, cfg.reconcile_grace_s, cfg.untracked_request_tokens)
        self.n = 0

    def complete(self, worker: str, route_id: str, num_tokens: int, num_system_tokens: int) -> None:
        """The routed request ended: released, and its worker now holds the system prompt and its blocks."""
        assert self.flights.release(route_id) is not None
        self.cached[worker] = max(self.cached[worker], num_system_tokens)
        self.resident[worker] += num_tokens // B

    def states(self, spread: int) -> list[CandidateState]:
        out = []
        for w, cached in self.cached.items():
            n, nq, toks = self.flights.load((w, 0))
            out.append(
                _state(
                    w,
                    cached,
                    num_inflight_requests=n,
                    num_queued_requests=nq,
                    num_queued_tokens=toks,
                    num_resident_blocks=self.resident[w],
                    spread=zlib.crc32(w.encode(), spread),
                )
            )
        return out

    def route(self, num_prompt_tokens: int, now: float = 0.0, num_shared_tokens: int = 0) -> str:
        ranked = order(
            self.cfg, num_prompt_tokens, self.states(self.n), self.cfg.untracked_request_tokens, num_shared_tokens
        )
        best = ranked[0]
        self.n += 1
        self.flights.add(
            Flight(f"r{self.n}", (best.state.worker, 0), best.terms.prefill_tokens, None, None, now)
        )
        return best.state.worker


def test_cold_sessions_sharing_only_the_system_prompt_spread_evenly() -> None:
    S, U = 256, 128  # every worker holds the 256-token system prompt; each session adds 128 of its own
    f = Fleet({"w0": S, "w1": S, "w2": S})
    picks = [f.route(S + U) for _ in range(9)]
    print("9 cold sessions over 3 workers holding only the system prompt:", picks)
    assert sorted(picks.count(w) for w in ("w0", "w1", "w2")) == [3, 3, 3]
    # control: the load terms do the spreading. Without them every worker costs the same 128 tokens,
    # and sessions that tie-break alike (one spread value) all pile onto one worker
    flat = Fleet({"w0": S, "w1": S, "w2": S}, CostConfig(queue_weight=0, request_weight=0))
    flat.n = 0
    same = []
    for _ in range(9):
        same.append(order(flat.cfg, S + U, flat.states(0), 0)[0].state.worker)
        flat.flights.add(Flight(f"{len(same):032x}", (same[-1], 0), U, None, None, 0.0))
    assert len(set(same)) == 1


def _sessions(f: Fleet, n: int, *, complete: bool) -> list[str]:
    """n cold sessions: the 256-token system prompt (16 blocks) and 128 tokens of their own."""
    S, U = 256, 128
    branches, system, picks = Branches(), list(range(1, S // B + 1)), []
    for k in range(n):
        chain = system + [1000 * (k + 1) + i for i in range(U // B)]
        picks.append(f.route(S + U, num_shared_tokens=branches.observe(chain) * B))
        if complete:
            f.complete(picks[-1], f"r{f.n}", S + U, S)
    return picks


def test_cold_sessions_are_spread_not_glued_to_the_system_prompts_holder() -> None:
    # one after another, each done before the next (no load anywhere); only w0 holds the prompt at first.
    # Sessions 1 and 2 show no shared prefix yet (two ways on from a block may be one conversation's
    # rewritten tail), so the prompt counts in full: w0 (128 vs 384). From session 3 on the prompt is
    # shared (three sessions continue it differently): the 256 tokens a worker lacks count at weight 0,
    # every worker costs 128, and ties go to the emptier worker
    picks = _sessions(Fleet({"w0": 256, "w1": 0, "w2": 0}), 9, complete=True)
    print("9 sequential cold sessions, system prompt on w0 only:", picks)
    assert picks[:2] == ["w0", "w0"] and set(picks[2:4]) == {"w1", "w2"}
    assert [picks.count(w) for w in ("w0", "w1", "w2")] == [3, 3, 3]
    # control, the old glue: counting the prompt in full (weight 1), w0 costs 128 and the others 384, always
    glued = _sessions(
        Fleet({"w0": 256, "w1": 0, "w2": 0}, CostConfig(shared_prefix_weight=1.0)), 9, complete=True
    )
    assert glued == ["w0"] * 9


def test_a_burst_of_cold_sessions_is_spread_by_the_work_queued() -> None:
    # nine at once, none done: w1 and w2 must prefill the prompt too, so each of their requests queues
    # 384 tokens against w0's 128, and a queued token costs 0.25. w0 costs 128 + 48k after k routes, w1 and w2
    # 128 + 112k after k routes each once the prompt is known as shared (from route 3)
    picks = _sessions(Fleet({"w0": 256, "w1": 0, "w2": 0}), 9, complete=False)
    print("9 cold sessions at once, system prompt on w0 only:", picks)
    # (routes 1-2 see no fork yet and glue to w0, 176 < 384; then w1 and w2 at 128 each; then w0 224 < 240
    # (w1, w2 after one route each), w1 and w2 (240 < 272), w0 twice (272 and 320 < 352))
    assert picks[:2] == ["w0", "w0"] and set(picks[2:4]) == {"w1", "w2"} and picks[4] == "w0"
    assert sorted(picks.count(w) for w in ("w0", "w1", "w2")) == [2, 2, 5]
    # control: the old glue keeps the first six on w0 (128, 176, .., 368 against 384), the seventh spills
    glued = Fleet({"w0": 256, "w1": 0, "w2": 0}, CostConfig(shared_prefix_weight=1.0))
    picks = _sessions(glued, 7, complete=False)
    assert picks[:6] == ["w0"] * 6 and picks[6] != "w0"
    r = order(glued.cfg, 384, glued.states(0), glued.cfg.untracked_request_tokens, 256)
    assert [c.terms.total for c in r if c.state.worker == "w0"] == [128 + QW * 6 * 128 + 16 * 6]


def test_branches_find_the_shared_prefix_not_a_conversations_own_history() -> None:
    b = Branches()
    assert b.observe([1, 2, 3, 10, 11]) == 0  # one conversation: nothing is shared yet
    assert b.observe([1, 2, 3, 20, 21]) == 0  # a second way on from block 3: a rewritten tail, or two
    assert b.observe([1, 2, 3, 30, 31]) == 3  # a third conversation continues block 3: 1-3 are shared
    assert b.observe([1, 2, 3, 10, 11, 12]) == 3  # the first's next turn: its history stays its own
    assert b.observe([1, 2, 3, 10, 11, 40]) == 3  # its last block rewritten: still its own (11 forks twice)
    assert b.observe([1, 2, 3]) == 3 and b.observe([7, 8]) == 0
    t = terms(CFG, 400, _state("w1", 0), 0, num_shared_tokens=3 * B)
    assert (t.prefill_tokens, t.amortized_tokens, t.total) == (400, 48, 400 - 48)
    assert terms(CFG, 400, _state("w0", 3 * B), 0, num_shared_tokens=3 * B).amortized_tokens == 0


def test_a_shared_prefix_in_use_survives_a_flood_of_new_blocks() -> None:
    """Another tenant's distinct prompts fill the bound many times over (1,200 new blocks against 200) while
    conversations keep continuing the prefix 1-3 now and then: it stays known as shared (before, passing the
    bound forgot everything, and the next conversation saw 0 shared blocks). Control: a prefix no request
    observes for two generations is forgotten, and learned again from three conversations."""
    b = Branches(max_blocks=200)
    for tail in (10, 20, 30):
        b.observe([1, 2, 3, tail])
    kept = Branches(max_blocks=200)
    kept._next, kept._forks = dict(b._next), set(b._forks)
    for i in range(40):                                  # 40 prompts of 30 new blocks: 6 generations
        flood = [10**6 + 100 * i + k for k in range(30)]
        b.observe(flood)
        kept.observe(flood)
        if i % 3 == 0:
            b.observe([1, 2, 3, 10, 11 + i])             # in use: the first conversation's next turns
    assert b.observe([1, 2, 3, 99]) == 3                 # NOTE: before, 0
    assert kept.observe([1, 2, 3, 99]) == 0              # control: unobserved for generations, forgotten
    for tail in (98, 97):
        kept.observe([1, 2, 3, tail])
    assert kept.observe([1, 2, 3, 96]) == 3              # and learned again
    assert len(b._next) + len(b._old) <= 200 + 30


@pytest.mark.parametrize("queued, stays", [(8126, True), (8130, False)])
def test_warm_session_stays_until_its_workers_queue_exceeds_four_times_its_warm_prefix(
    queued: int, stays: bool
) -> None:
    # 2048 tokens warm on w0, 52 new; one request of `queued` prefill tokens waits there, w1 is idle:
    # w0 costs 52 + 0.25 * queued + 16, w1 costs 2100: it stays while queued < 4 * (2048 - 16) = 8128
    w0 = _state("w0", 2048, num_inflight_requests=1, num_queued_requests=1, num_queued_tokens=queued)
    best, runner_up = order(CFG, 2100, [w0, _state("w1")], 0)
    assert (best.state.worker == "w0") is stays
    assert {best.terms.total, runner_up.terms.total} == {52 + QW * queued + 16, 2100}
    assert best.terms.total < runner_up.terms.total


MARGIN = CostConfig(affinity_margin=128)  # opt-in (--route-affinity-margin 128): docs/routing.md


def _chat(worker: str, cached: int, active: int, queued: int = 0) -> CandidateState:
    return _state(
        worker, cached, num_inflight_requests=active, num_queued_requests=min(active, 1), num_queued_tokens=queued
    )


@pytest.mark.parametrize("queued, stays", [(764, True), (768, False)])
def test_a_short_chat_stays_on_its_history_until_another_worker_is_cheaper_by_the_margin(
    queued: int, stays: bool
) -> None:
    # 160-token turn: 48 shared (a system prompt) + 64 of its own history cached on w0, 10 requests on
    # each worker. w0: 48 new + 0.25 * queued + 160; w1: 160 - 48 amortized + 160 = 272. Without the
    # margin it leaves w0 at any queue over 256 (the churn the bench showed in short chats); with 128 it
    # leaves once w0 costs 128 more: 208 + 0.25 * queued - 272 >= 128, queued >= 768
    w0, w1 = _chat("w0", 112, 10, queued), _chat("w1", 0, 10)
    best, other = order(MARGIN, 160, [w1, w0], 0, num_shared_tokens=48)
    assert (best.state.worker == "w0") is stays
    assert {best.terms.total, other.terms.total} == {48 + QW * queued + 160, 272}
    off = order(CFG, 160, [w1, w0], 0, num_shared_tokens=48)
    assert off[0].state.worker == "w1"  # the default (margin 0) is the plain cost: it moves at both queues


def test_a_shared_prefix_alone_earns_no_affinity() -> None:
    # w0 holds only the system prompt (48 of 48 shared): a new conversation goes by load, as before,
    # to the idle w1 even though w0 is only 25 more: 112 + 25 + 16 against 112 + 16
    best, _ = order(MARGIN, 160, [_chat("w0", 48, 1, 100), _chat("w1", 0, 1)], 0, num_shared_tokens=48)
    assert best.state.worker == "w1"


@pytest.mark.parametrize("active_w1, moves", [(1, True), (2, False)])
def test_a_worker_running_far_fewer_requests_is_not_held_off_by_the_margin(active_w1: int, moves: bool) -> None:
    # w0 holds 64 tokens of the conversation's own history and runs 3 requests (200 queued): 48 + 50
    # + 48 = 146; w1 costs 112 + 16 * active_w1, cheaper either way but by less than 128. One request
    # there (at most (3 - 1) * 2 / 3) is a lasting imbalance, and the conversation moves; two is not
    best, _ = order(
        MARGIN, 160, [_chat("w0", 112, 3, 200), _chat("w1", 0, active_w1)], 0, num_shared_tokens=48
    )
    assert (best.state.worker == "w1") is moves


def test_a_tracked_route_raises_cost_at_once_and_release_lowers_it() -> None:
    flights = InFlight(CFG.inflight_ttl_s, CFG.reconcile_grace_s, CFG.untracked_request_tokens)
    before = terms(CFG, 500, _state("w0", 0), 0)
    flights.add(Flight("a" * 32, ("w0", 0), 300, None, "acme", 0.0))
    n, nq, toks = flights.load(("w0", 0))
    during = terms(
        CFG, 500, _state("w0", 0, num_inflight_requests=n, num_queued_requests=nq, num_queued_tokens=toks), 0
    )
    assert (before.total, during.total) == (500, 500 + QW * 300 + 16)  # no /metrics look involved
    assert flights.release("a" * 32, owner="bravo") is None and flights.load(("w0", 0)) == (1, 1, 300)
    assert flights.release("a" * 32, owner="acme") is not None and flights.load(("w0", 0)) == (0, 0, 0)
    assert flights.release("a" * 32, owner="acme") is None  # released once


def test_ttl_expiry_drops_leaked_routes_oldest_first() -> None:
    flights = InFlight(ttl_s=10.0, grace_s=0.25, default_tokens=256)
    for i, t in enumerate((0.0, 4.0, 8.0)):
        flights.add(Flight(f"{i:032x}", ("w0", 0), 100, None, None, t))
    assert flights.expire(9.9) == []
    assert [f.route_id for f in flights.expire(14.5)] == [f"{0:032x}", f"{1:032x}"]
    assert flights.load(("w0", 0)) == (1, 1, 100)


def test_reconcile_against_metrics_ends_and_schedules_routes_first_come_first_served() -> None:
    flights = InFlight(ttl_s=120.0, grace_s=0.25, default_tokens=256)
    for i, t in enumerate((0.0, 0.1, 0.2, 0.9)):
        flights.add(Flight(f"{i:032x}", ("w0", 0), 100 * (i + 1), None, None, t))
    # a look begun at t=1.0 shows 1 running, 0 waiting: of the three routes older than the grace the two
    # oldest ended unreleased, the third is running (scheduled: its 300 prefill tokens no longer wait);
    # the route from t=0.9 may not have reached the worker yet and keeps its 400 queued tokens
    ended = flights.reconcile(("w0", 0), num_running=1, num_waiting=0, polled_at=1.0)
    assert [f.num_tokens for f in ended] == [100, 200]
    assert flights.load(("w0", 0)) == (2, 1, 400)
    # a later look showing it waiting keeps it queued; one showing nothing ends both
    assert flights.reconcile(("w0", 0), num_running=1, num_waiting=1, polled_at=2.0) == []
    assert flights.load(("w0", 0)) == (2, 1, 400)
    assert len(flights.reconcile(("w0", 0), num_running=0, num_waiting=0, polled_at=3.0)) == 2
    assert flights.load(("w0", 0)) == (0, 0, 0) and len(flights) == 0


def test_untracked_requests_seen_in_metrics_count_at_the_mean_routed_size() -> None:
    # w0 shows 3 waiting requests nobody tracked, at the configured 256 tokens each before any route
    t = terms(CFG, 100, _state("w0", num_waiting=3.0, num_running=2.0), 256)
    assert (t.queued_tokens, t.active_requests, t.total) == (768, 5, 100 + QW * 768 + 16 * 5)


def test_a_route_extending_a_queued_one_does_not_wait_behind_it() -> None:
    flights = InFlight(120.0, 0.25, 256)
    flights.add(Flight("1" * 32, ("w0", 0), 300, 0xBEEF, None, 0.0))
    # the next turn's chain contains the queued route's last block hash: its 300 tokens are not ahead of it
    assert flights.extended([0x1, 0xBEEF, 0x2]) == {("w0", 0): 300}
    assert flights.extended([0x1, 0x2]) == {}


@pytest.mark.parametrize(
    "resident, session, expected",
    [
        (990, 1600, "w1"),  # 100 new blocks on w0: 990 + 100 - 1000 = 90 evicted -> 1600 + 1440 > 1664 on w1
        (500, 1600, "w0"),  # control: room for them on w0 -> 1600 < 1664
        (990, 32, "w0"),  # a short session: 2 new blocks fit (992 <= 1000) -> 32 < 96
    ],
)
def test_kv_pressure_steers_a_long_new_session_away_from_a_nearly_full_worker(
    resident: int, session: int, expected: str
) -> None:
    S = 64  # the system prompt is warm only on w0, which is nearly full; w1 is empty
    w0 = _state("w0", S, num_resident_blocks=resident, num_gpu_blocks=1000)
    w1 = _state("w1", 0, num_resident_blocks=0, num_gpu_blocks=1000)
    best = order(CFG, S + session, [w0, w1], 0)[0]
    assert best.state.worker == expected


def test_kv_pressure_falls_back_to_kv_usage_without_a_capacity() -> None:
    # no num_gpu_blocks: usage 0.95 over the 0.8 high-water mark -> 75% of the 100 new blocks evict
    t = terms(CFG, 64 + 1600, _state("w0", 64, kv_usage=0.95), 0)
    assert (t.evicted_tokens, t.total) == (75 * B, 1600 + 75 * B)
    assert terms(CFG, 64 + 1600, _state("w0", 64, kv_usage=0.5), 0).evicted_tokens == 0


@pytest.mark.parametrize(
    "num_prompt, cached, evicted",
    [
        (256, 256, 0),  # all 16 blocks resident: the request adds none, so it evicts none (issue #27)
        (260, 256, 0),  # every full block resident, a partial tail: still no new full block
        (256, 240, 256),  # control: one block missing, the over-committed working set is charged
    ],
)
def test_a_fully_resident_prompt_is_never_charged_for_evicting_on_an_overcommitted_rank(
    num_prompt: int, cached: int, evicted: int
) -> None:
    # the rank's working set is 116 blocks against a capacity of 100: overcommit (116 - 100) x 16 = 256 tokens
    s = _state("w0", cached, num_resident_blocks=100, num_gpu_blocks=100, num_demand_blocks=116)
    t = terms(CFG, num_prompt, s, 0)
    assert (t.prefill_tokens, t.evicted_tokens, t.total) == (num_prompt - cached, evicted, num_prompt - cached + evicted)


def test_a_sleeping_worker_is_never_chosen_and_an_unproven_one_never_credited_even_if_cheapest() -> None:
    asleep = _state("asleep", 1024, serving=False)  # would cost 0: holds the whole prompt
    unproven = _state("unproven", 1024, proven=False)  # its index claims it all, but e.g. under a stale epoch
    warm = _state("warm", 512)  # proven, half the prompt
    ranked = order(CFG, 1024, [asleep, unproven, warm], 0)
    assert [(c.state.worker, c.terms.cached_tokens, c.terms.total) for c in ranked] == [
        ("warm", 512, 512),
        ("unproven", 0, 1024),
    ]
    assert order(CFG, 1024, [asleep], 0) == []


@pytest.mark.parametrize(
    "bad",
    [
        dict(queue_weight=-1),
        dict(request_weight=float("nan")),
        dict(kv_high_water=1.0),
        dict(inflight_ttl_s=0),
        dict(working_set_ttl_s=0),
        dict(working_set_ttl_s=float("inf")),
        dict(shared_prefix_weight=1.5),
        dict(untracked_request_tokens=-5),
        dict(pressure_weight=True),
        dict(affinity_margin=-1),
    ],
)
def test_cost_config_refuses_bad_weights(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        CostConfig(**bad)  # type: ignore[arg-type]


def test_capacity_from_metrics_and_learned_from_evictions() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="8192"} 1.0\n'
        'vllm:num_requests_running{engine="0"} 3.0\n'
    )
    assert (parse_metrics(text).num_gpu_blocks, parse_metrics(text).block_size) == (8192, 16)
    assert parse_metrics(text.replace('"8192"', '"None"')).num_gpu_blocks is None
    idx = PrefixIndex()
    idx.apply(("w0", 0), BlockStored(tuple(range(10)), None, tuple(range(160)), 16, "GPU", group_idx=0))
    assert idx.learned_capacity(("w0", 0)) is None and idx.num_resident(("w0", 0)) == 10
    idx.apply(("w0", 0), BlockRemoved((0,), "GPU", 0))
    assert idx.learned_capacity(("w0", 0)) == 10 and idx.num_resident(("w0", 0)) == 9
    idx.drop(("w0", 0))  # an epoch bump forgets the blocks, not the pool's size
    assert idx.learned_capacity(("w0", 0)) == 10 and idx.num_resident(("w0", 0)) == 0


# ---- the real Router on real sim-vllm workers -------------------------------------------------------

SYSTEM = list(range(2000, 2064))  # 4 blocks


async def _fleet(tmp_path, n: int, **cost_kw: object) -> tuple[Router, list[SimVllm], object]:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sims = [
        await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=256))).start() for _ in range(n)
    ]
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, cost=CostConfig(**cost_kw)))  # type: ignore[arg-type]
    await r.start()
    for i, s in enumerate(sims):
        await r.register_worker(WorkerSpec(f"w{i}", s.url, s.kv_events, s.replay, "m"))
    return r, sims, store


async def _prefill(r: Router, sim: SimVllm, toks: list[int], name: str) -> None:
    async with (
        aiohttp.ClientSession() as h,
        h.post(sim.url + "/v1/completions", json={"prompt": toks}) as resp,
    ):
        assert resp.status == 200
    for _ in range(300):
        if r.index.num_resident((name, 0)) >= len(toks) // B:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{name} never indexed {len(toks) // B} blocks")


async def test_live_cold_sessions_spread_with_cost_terms_and_runner_up(tmp_path) -> None:
    # grace 30 s: no /metrics look may end these routes during the test (the sims answer instantly)
    r, sims, store = await _fleet(tmp_path, 3, reconcile_grace_s=30.0)
    try:
        await _prefill(r, sims[0], SYSTEM, "w0")  # only w0 holds the 64-token system prompt

        async def sessions(base: int) -> list[RouteDecision]:
            out = [
                await r.route(SYSTEM + [base + 100 * k + i for i in range(48)], "m", track=True, owner="acme")
                for k in range(6)
            ]
            return out

        # control, the old glue: with the missing prompt counted in full, w0 costs 48 + 0.25 * 48k + 16k
        # after k routes (48, 76, 104, ...) against 112 + load elsewhere: w0, w0, then the others, 4 / 1 / 1
        # (without the in-flight credit, which spreads that glue over the routes' own workers: 3 / 2 / 1)
        r.set_cost_config(CostConfig(shared_prefix_weight=1.0, reconcile_grace_s=30.0, inflight_prefix=False))
        glued = [d.worker for d in await sessions(5000)]
        assert glued[:2] == ["w0", "w0"] and sorted(glued.count(w) for w in set(glued)) == [1, 1, 4]
        assert all(await _released(r))
        # the defaults: the prompt is shared (six sessions continued it), so the 64 tokens w1 and w2 lack
        # count at weight 0. Every worker costs 48 + its load; ties go to the emptier worker: 2 / 2 / 2
        r.set_cost_config(CostConfig(reconcile_grace_s=30.0))
        ds = await sessions(9000)
        picks = [d.worker for d in ds]
        print("6 cold sessions, system prompt on w0 only:", picks, "(glued control:", glued, ")")
        assert picks[0] != "w0" and sorted(picks.count(w) for w in ("w0", "w1", "w2")) == [2, 2, 2]
        d = ds[0]
        assert (
            d.verdict == "COLD"
            and d.cost is not None
            and d.runner_up is not None
            and d.runner_up.cost is not None
        )
        assert (d.cost.prefill_tokens, d.cost.amortized_tokens, d.cost.total) == (112, 64, 48)
        assert d.runner_up.worker not in ("w0", d.worker) and d.runner_up.cost.total == 48
        w0 = next(c for c in d.candidates if c.worker == "w0")
        assert (
            w0.cost is not None and (w0.matched_tokens, w0.cost.total) == (64, 48) and len(d.candidates) == 3
        )
        inflight = r.metrics.registry.get_sample_value  # the gauge as a scrape reads it
        assert inflight("kvfleet_route_inflight_requests", {"worker": "w0"}) == 2
        for x in ds:
            assert r.release_route(x.route_id, owner="acme")
        assert len(r.flights) == 0 and inflight("kvfleet_route_inflight_requests", {"worker": "w0"}) == 0
        assert not r.release_route(ds[0].route_id, owner="acme")
        with pytest.raises(InvalidArgument):
            r.release_route("not-an-id")
        counts = {
            x.name: x.value for x in r.metrics.route_cost.collect()[0].samples if x.name.endswith("_count")
        }
        assert counts == {"kvfleet_route_cost_tokens_count": 12}  # every route's chosen cost is observed
        margins = r.metrics.route_cost_margin.collect()[0].samples
        assert [x.value for x in margins if x.name.endswith("_count")] == [12]
    finally:
        await r.stop()
        for s in sims:
            await s.stop()
        store.close()


async def _released(r: Router) -> list[bool]:
    """Release every tracked route (the glued control's), oldest first."""
    ids = [f.route_id for f in list(r.flights._all.values())]
    return [r.release_route(i, owner="acme") for i in ids]


async def test_live_reconcile_ends_unreleased_routes_at_the_next_look(tmp_path) -> None:
    r, sims, store = await _fleet(tmp_path, 2, reconcile_grace_s=0.05)
    try:
        d = await r.route(SYSTEM, "m", track=True)
        assert len(r.flights) == 1
        await _prefill(r, sims[int(d.worker[1:])], SYSTEM, d.worker)  # served and done; never released
        for _ in range(200):  # the next look shows nothing running: the route ends by reconcile
            await asyncio.sleep(0.02)
            await r.route([1, 2, 3], "m")
            if not r.flights:
                break
        assert len(r.flights) == 0 and r.metrics.inflight_dropped.labels("reconcile")._value.get() == 1
    finally:
        await r.stop()
        for s in sims:
            await s.stop()
        store.close()


async def test_route_over_grpc_carries_cost_and_release_is_the_tenants(tmp_path) -> None:
    (sim,) = [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()]
    tokens = tmp_path / "tokens.json"
    acme, bravo = mint_token(tokens, "acme", "tenant"), mint_token(tokens, "bravo", "tenant")
    ctl = await build_server(
        ControllerConfig(
            listen="127.0.0.1:0", store_url=f"sqlite:///{tmp_path}/ctl.db", tokens_file=str(tokens)
        ),
        metrics=Metrics(),
    )
    router = ctl.ctx.need_router()
    await router.register_worker(WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m"))
    channel = grpc.aio.insecure_channel(ctl.address)
    stub = RouteServiceStub(channel)
    try:
        req = route_pb2.RouteRequest(token_ids=SYSTEM, model="m", track=True)
        resp = await stub.Route(req, metadata=base.metadata(acme))
        d = types.route_decision(resp)
        assert d.route_id and d.cost is not None and d.cost.prefill_tokens == 64 and d.runner_up is None
        assert len(router.flights) == 1
        untracked = await stub.Route(
            route_pb2.RouteRequest(token_ids=SYSTEM, model="m"), metadata=base.metadata(acme)
        )
        assert untracked.route_id == "" and len(router.flights) == 1
        rel = route_pb2.ReleaseRouteRequest(route_id=d.route_id)
        assert not (await stub.ReleaseRoute(rel, metadata=base.metadata(bravo))).released  # not bravo's route
        assert (await stub.ReleaseRoute(rel, metadata=base.metadata(acme))).released
        assert not (await stub.ReleaseRoute(rel, metadata=base.metadata(acme))).released
        for bad in ("", "XYZ"):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ReleaseRoute(
                    route_pb2.ReleaseRouteRequest(route_id=bad), metadata=base.metadata(acme)
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "route_id" in (
                e.value.details() or ""
            )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ReleaseRoute(rel)  # no token
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await channel.close()
        await ctl.stop(0)
        await sim.stop()


# ---- configuration: flags and Helm values reach CostConfig --------------------------------------


def test_route_flags_make_the_cost_config_and_bad_weights_stop_the_controller(tmp_path, capsys) -> None:
    from controller.main import cost_config_from, main, parse_args
    from fleet.app.cli.up import parse as parse_up

    args = parse_args(["--route-queue-weight", "1.5", "--route-untracked-request-tokens", "64"], {})
    assert cost_config_from(args) == CostConfig(queue_weight=1.5, untracked_request_tokens=64)
    assert cost_config_from(parse_args([], {})) == CostConfig()
    assert cost_config_from(parse_up(["--route-pressure-weight", "0"])) == CostConfig(pressure_weight=0.0)
    # each flag also from the environment, as the --kv-* flags are (the flag wins)
    env = {"KVFLEET_ROUTE_AFFINITY_MARGIN": "96", "KVFLEET_ROUTE_QUEUE_WEIGHT": "0.5"}
    assert cost_config_from(parse_args([], env)) == CostConfig(affinity_margin=96.0, queue_weight=0.5)
    assert cost_config_from(parse_args(["--route-queue-weight", "2"], env)) == CostConfig(affinity_margin=96.0,
                                                                                          queue_weight=2.0)
    assert main(["--store", f"sqlite:///{tmp_path}/x.db"], {"KVFLEET_ROUTE_REQUEST_WEIGHT": "-1"}) == 2
    assert "--route-request-weight" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a value that does not parse names the variable too
        parse_args([], {"KVFLEET_ROUTE_QUEUE_WEIGHT": "abc"})
    assert "KVFLEET_ROUTE_QUEUE_WEIGHT" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # as do the --kv-* flags' (NOTE: before, they named the flag only)
        parse_args([], {"KVFLEET_KV_MAX_EVENTS_PER_S": "many"})
    assert "KVFLEET_KV_MAX_EVENTS_PER_S" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as mp:  # `kvfleet up` reads them as the controller does
        mp.setenv("KVFLEET_ROUTE_AFFINITY_MARGIN", "64")
        assert cost_config_from(parse_up([])) == CostConfig(affinity_margin=64.0)
    assert main(["--route-kv-high-water", "1.0", "--store", f"sqlite:///{tmp_path}/x.db"], {}) == 2
    assert "--route-kv-high-water" in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists()  # refused before anything started


def test_helm_routing_values_become_flags_the_controller_parses() -> None:
    helm = pytest.importorskip("helm_python")
    import yaml

    from controller.main import cost_config_from, parse_args

    def args(values: dict[str, object]) -> list[str]:
        with helm.Chart.load(Path(__file__).resolve().parents[2] / "helm" / "kvfleet") as chart:
            out = chart.render(values, name="demo", namespace="kvfleet")
        dep = next(
            d for p, t in out.items() if "controller-deployment" in p for d in yaml.safe_load_all(t) if d
        )
        return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])

    assert not [a for a in args({}) if a.startswith("--route-")]  # null values: the controller's defaults
    routing = {
        "queueWeight": 1,
        "requestWeight": 0,
        "kvHighWater": 0.9,
        "untrackedRequestTokens": 1000000,
        "inflightTtlSeconds": 300,
        "workingSetTtlSeconds": 900,
        "reconcileGraceSeconds": 0.5,
        "pressureWeight": 2.5,
        "affinityMargin": 0,
        "mixedPrefixWeight": 0.25,
        "inflightPrefix": False,
        "scheduledByEvents": True,
    }
    got = cost_config_from(parse_args(args({"controller": {"routing": routing}})[1:], {}))
    assert got == CostConfig(
        queue_weight=1.0,
        request_weight=0.0,
        pressure_weight=2.5,
        kv_high_water=0.9,
        untracked_request_tokens=1000000,
        inflight_ttl_s=300.0,
        working_set_ttl_s=900.0,
        reconcile_grace_s=0.5,
        affinity_margin=0.0,
        mixed_prefix_weight=0.25,
        inflight_prefix=False,
        scheduled_by_events=True,
    )


async def test_a_stopped_router_reports_no_routes_in_flight(tmp_path: Path) -> None:
    """The in-flight gauges are read from the router when scraped; a router that stopped (its controller no longer
    leads) leaves them empty, not frozen at its last ledger (the rows read while it runs: the test above)."""
    from controller.metrics import Metrics
    from controller.router import Router
    from fleet.cas import open_store

    with open_store(f"sqlite:///{tmp_path / 'kv.db'}") as store:
        m = Metrics()
        r = Router(store, m)
        assert m.inflight == r._inflight_rows  # read from this router when scraped
        await r.stop()
        assert m.inflight is None
        other = Router(store, m)  # the next leader's router reads its own
        assert m.inflight == other._inflight_rows
        await r.stop()  # a stop of the old one again leaves the new one's
        assert m.inflight == other._inflight_rows
        await other.stop()
