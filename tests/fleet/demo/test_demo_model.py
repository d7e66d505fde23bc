"""The offline cache model on a hand-made trace: exact token counts per policy (no Ray, no I/O)."""

from __future__ import annotations

from fleet.app.demo.live import LiveResult
from fleet.app.demo.model import Greedy, PolicyResult, Recorded, Sticky, max_min_share, replay, replay_all
from fleet.app.demo.peers import reused_of, tally
from fleet.app.demo.summary import render, summarize
from fleet.app.demo.trace import Lifecycle, Request, Trace
from fleet.app.demo.workload import DemoConfig

B = 16
SYS = tuple(range(1, 65))                        # 4 blocks shared by both agents


def req(agent: str, turn: int, extra: int, worker: str = "w0", claimed: int = 0, cached: int = 0) -> Request:
    toks = SYS + tuple(1000 * (1 + (agent == "b")) + i for i in range(extra))
    return Request(agent, turn, toks, "salt", worker, "WARM" if claimed else "COLD", claimed, cached)


def trace() -> Trace:
    t = Trace(["w0", "w1"], B, 1024)
    t.events += [req("a", 0, 32), req("a", 1, 64, claimed=96, cached=96),
                 Lifecycle("sleep", "w0", "controller", 1, 2),
                 req("a", 2, 96, worker="w1"), Lifecycle("wake_up", "w0", "controller", 1, 3),
                 req("a", 3, 128, worker="w1", claimed=160, cached=160)]
    return t


def test_each_policy_counts_exact_tokens() -> None:
    r = replay_all(trace())
    want_total = 96 + 128 + 160 + 192
    for p in r.values():
        assert p.total_tokens == want_total and p.reused_tokens + p.prefill_tokens == want_total
    # kvfleet's recorded choices: 0 + 96 + 0 (cold on w1 after the sleep) + 160
    assert (r["kvfleet"].reused_tokens, r["kvfleet"].stale_warm_routes, r["kvfleet"].to_sleeping) == (256, 0, 0)
    assert r["greedy"].reused_tokens == 256 and r["greedy"].to_sleeping == 0
    # sticky: every turn of "a" on its ring worker; the sleep hits that worker (its busiest), turn 2
    # goes cold to the other one without hanging (it skips sleepers), turn 3 returns to the emptied one
    assert (r["sticky"].reused_tokens, r["sticky"].to_sleeping) == (96, 0)
    assert sorted(r["sticky"].per_worker.values()) == [1, 3] and r["sticky"].to_dict()["max_min_share"] == 3.0
    # blind: its index still holds w0's blocks while w0 sleeps -> one hung request, stale warm, then fails over
    assert (r["blind"].to_sleeping, r["blind"].stale_warm_routes, r["blind"].reused_tokens) == (1, 1, 256)
    # round-robin: w0, w1; its busiest is then w1 (tie, larger name), so the sleep clears w1;
    # turn 2 on w0 reuses turn 0's 96 tokens; turn 3 on w1 finds it emptied by the sleep
    assert (r["round_robin"].to_sleeping, r["round_robin"].reused_tokens) == (0, 0 + 0 + 96 + 0)


def test_recorded_replay_detects_a_wrong_live_figure() -> None:
    """Control for the fidelity check: a trace whose recorded claim is impossible shows up as stale."""
    t = trace()
    t.events[1] = req("a", 1, 64, claimed=160, cached=96)          # claimed more than was resident
    assert replay(t, Recorded(B)).stale_warm_routes == 1
    assert replay(t, Greedy()).stale_warm_routes == 0


def test_sticky_spreads_sessions_and_share_is_bounded_only_when_every_worker_serves() -> None:
    ring = Sticky(["w0", "w1", "w2", "w3"])
    t = Trace(["w0", "w1", "w2", "w3"], B, 1024)
    t.events += [req(f"agent-{i}", 0, 16) for i in range(64)]
    r = replay(t, ring)
    print("sticky share over 64 agents:", r.per_worker)
    assert sum(r.per_worker.values()) == 64 and min(r.per_worker.values()) > 0
    assert max_min_share({"w0": 3, "w1": 0}) is None and max_min_share({"w0": 3, "w1": 1}) == 3.0


def test_the_witness_line_formats_its_figures() -> None:
    # before: "control kept-vs-never = 0.2726077139377594" (found by review)
    from fleet.app.demo.summary import witness_line

    q = {"agent": "agent-1", "turn": 4, "tokens": 156, "write_time": True, "max_abs_delta": 0.0,
         "control": 0.2726077139377594}
    assert witness_line(q) == ("quarantine witness (agent-1, turn 4, 156 tokens, write-time): "
                               "max|Δ| evict-vs-never = 0, control kept-vs-never = 0.273")
    assert witness_line(dict(q, max_abs_delta=3.2e-07)).endswith("evict-vs-never = 3.2e-07, control kept-vs-never = 0.273")


def _router_with_unanswered() -> PolicyResult:
    """vllm-router's replay as the review saw it: the least prefill, because 3 of its 4 requests got no answer."""
    out = PolicyResult.for_workers("vllm_router", ["w0", "w1"])
    for tokens, answered in ((96, True), (128, False), (160, False), (192, False)):
        tally(out, tokens, answered)
    out.reused_tokens = reused_of(out.total_tokens, 96)  # the workers computed the one answered request
    return out


def test_an_unanswered_request_counts_no_tokens_and_no_hits() -> None:
    # before: total = every request's tokens (576) and reused = total - prefilled = 480, more than the 96 tokens
    # of the one request it served
    r = _router_with_unanswered()
    assert (r.num_requests, r.failed, r.total_tokens, r.reused_tokens, r.prefill_tokens) == (4, 3, 96, 0, 96)
    assert reused_of(100, 140) == 0  # a given-up request computed after a wake never makes reuse negative


def test_a_routing_with_unanswered_requests_is_never_the_best_other() -> None:
    # before: summarize crowned the routing that answered 1 request of 4 "the best other routing"
    live = LiveResult(trace(), {}, {}, [], 0, 1, 0.0)
    s = summarize(DemoConfig(), live, _router_with_unanswered())
    assert s["policies"]["vllm_router"]["prefill_tokens"] < min(
        p["prefill_tokens"] for k, p in s["policies"].items() if k != "vllm_router")
    assert s["best_other"] == "greedy" and s["unranked"] == {"vllm_router": 3}
    lines = [str(x) for x in render(s).renderables[1:]]
    assert any("vllm-router kv_aware (live replay): not ranked, 3 of 4 requests never answered" in x for x in lines)
