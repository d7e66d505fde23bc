"""The stand-in's clock: modelled step costs, max_num_seqs queueing, KV capacity, and what /metrics shows.

The scheduler tests drive a real SimEngine (prefix cache, events) step by step in modelled time: no
sockets, no wall clock, exact figures. The HTTP tests run a real SimVllm and assert on states and
counts, never on wall-clock durations.
"""

from __future__ import annotations

import asyncio
import math
from bisect import bisect_left

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.engine import SimEngine
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm, _parse
from fleet.app.testkit.sim_vllm.sched import FINISHED, RUNNING, WAITING, Output
from fleet.app.testkit.sim_vllm.step_cost import lone_ttft_s
from fleet.app.testkit.sim_vllm.wire import VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored
from fleet.core.block_hash import HashConfig, external_chain
from fleet.core.errors import InvalidArgument

# round figures, so that each expected duration is easy to read off the config
COST = {
    "step_overhead_s": 0.001,
    "prefill_tokens_per_s": 10_000.0,
    "decode_base_s": 0.005,
    "decode_per_seq_s": 0.0005,
}
# vLLM's vllm:time_to_first_token_seconds buckets, transcribed from vllm/v1/metrics/loggers.py
VLLM_TTFT_LE = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]


def make_engine(**kw: object) -> tuple[SimEngine, list[list[object]]]:
    published: list[list[object]] = []
    cfg = SimEngineConfig(**{"model": "m", "num_blocks": 1024, **COST, **kw})
    return SimEngine(cfg, published.append), published


def play(eng: SimEngine) -> list[object]:
    """Play every step out at once (what the shell does, minus the sleeps); returns the steps."""
    steps = []
    while (step := eng.plan()) is not None:
        eng.finish(step)
        steps.append(step)
    return steps


def step_s(prefill: int, decode: int) -> float:
    return (
        COST["step_overhead_s"]
        + max(COST["decode_base_s"], prefill / COST["prefill_tokens_per_s"])
        + COST["decode_per_seq_s"] * decode
    )


def ttft(seq: object) -> float:
    return seq.first_token_s - seq.arrival_s


def test_prefill_time_scales_with_uncached_tokens() -> None:
    eng, _ = make_engine()
    cold = eng.submit(list(range(1600)), 1)
    play(eng)
    warm = eng.submit(list(range(1600)), 1)
    play(eng)
    half = eng.submit(list(range(800)) + list(range(5000, 5800)), 1)
    play(eng)
    # warm: vLLM looks up at most prompt - 1 tokens, so a fully cached prompt recomputes its last block
    assert (cold.num_cached_tokens, warm.num_cached_tokens, half.num_cached_tokens) == (0, 1584, 800)
    assert ttft(cold) == pytest.approx(step_s(1600, 0), rel=1e-12)  # 0.161: overhead + 1600 / 10k
    assert ttft(half) == pytest.approx(step_s(800, 0), rel=1e-12)  # 0.081
    assert ttft(warm) == pytest.approx(step_s(16, 0), rel=1e-12)  # 0.006: one forward pass, the floor
    overhead = COST["step_overhead_s"]
    assert (ttft(cold) - overhead) / (ttft(half) - overhead) == pytest.approx(2.0)  # proportional to uncached
    # the instant path records the same figure for a request alone
    assert lone_ttft_s(eng.sched.cost, eng.cfg.max_num_batched_tokens, 800) == pytest.approx(ttft(half))
    assert eng.sched.stats.ttft.count == 3 and eng.sched.stats.num_prompt_tokens == 4800


def test_decode_step_grows_with_batch() -> None:
    eng, _ = make_engine()
    alone = eng.submit(list(range(16)), 3)
    play(eng)
    times = [o.at_s for o in eng.sched.take_outputs() if o.seq_id == alone.seq_id]
    assert [b - a for a, b in zip(times, times[1:], strict=False)] == pytest.approx([step_s(0, 1)] * 2)
    four = [eng.submit(list(range(100 * i, 100 * i + 16)), 3) for i in range(1, 5)]
    steps = play(eng)
    assert [len(s.prefill) for s in steps] == [4, 0, 0] and [len(s.decode) for s in steps] == [0, 4, 4]
    times = [o.at_s for o in eng.sched.take_outputs() if o.seq_id == four[0].seq_id]
    assert [b - a for a, b in zip(times, times[1:], strict=False)] == pytest.approx([step_s(0, 4)] * 2)
    assert step_s(0, 4) - step_s(0, 1) == pytest.approx(3 * COST["decode_per_seq_s"])


def test_max_num_seqs_queues_fifo() -> None:
    eng, _ = make_engine(max_num_seqs=2)
    a, b, c, d = (eng.submit(list(range(100 * i, 100 * i + 16)), 2) for i in range(4))
    s1 = eng.plan()
    assert s1 is not None and [s.seq_id for s, _ in s1.prefill] == [a.seq_id, b.seq_id]
    assert (eng.running, eng.waiting) == (2, 2) and [c.state, d.state] == [WAITING, WAITING]
    eng.finish(s1)
    s2 = eng.plan()  # a and b decode their 2nd (last) token; the queue waits for their slots
    assert s2 is not None and len(s2.decode) == 2 and not s2.prefill
    eng.finish(s2)
    assert (a.state, b.state, eng.running, eng.waiting) == (FINISHED, FINISHED, 0, 2)
    s3 = eng.plan()
    assert s3 is not None and [s.seq_id for s, _ in s3.prefill] == [c.seq_id, d.seq_id]  # FIFO
    eng.finish(s3)
    assert c.arrival_s == 0.0 and s3.start_s == pytest.approx(s2.end_s)  # it waited for a's and b's slots
    assert ttft(c) == pytest.approx(s3.end_s) and ttft(a) == pytest.approx(
        s1.end_s
    )  # the wait is in its TTFT


def test_priority_policy_runs_waiting_requests_by_priority_then_arrival() -> None:
    """vLLM's --scheduling-policy priority: the waiting queue is ordered by (priority, arrival), lower first;
    fcfs (the control, and the default) keeps arrival order whatever the priorities."""
    for policy, expected in (("priority", ["d", "e", "c", "b", "a"]), ("fcfs", ["a", "b", "c", "d", "e"])):
        eng, _ = make_engine(max_num_seqs=1, scheduling_policy=policy)
        order: dict[int, str] = {}
        for name, prio in (("a", 5), ("b", 3), ("c", 1), ("d", 0), ("e", 0)):
            order[eng.submit(list(range(16)), 1, priority=prio).seq_id] = name
        ran = [order[s.seq_id] for step in play(eng) for s, _ in step.prefill]
        assert ran == expected, (policy, ran)
    eng, _ = make_engine(max_num_seqs=1, scheduling_policy="priority")
    x = eng.submit(list(range(16)), 3, priority=1)
    eng.finish(eng.plan())                        # x runs
    y = eng.submit(list(range(16, 32)), 3, priority=0)
    eng.sched.preempt_all()   # x goes back in its place by (priority, arrival), behind y, not first (fcfs)
    assert [s.seq_id for s in eng.sched.waiting] == [y.seq_id, x.seq_id]
    with pytest.raises(InvalidArgument, match="--scheduling-policy must be fcfs or priority"):
        make_engine(scheduling_policy="lottery")
    assert _parse(["--scheduling-policy", "priority"]).engine.scheduling_policy == "priority"


def test_kv_capacity_bounds_running_and_usage_moves() -> None:
    eng, published = make_engine(num_blocks=8)
    a_ids, b_ids = list(range(80)), list(range(1000, 1080))  # 5 full blocks each
    a = eng.submit(a_ids, 2)
    same = eng.submit(a_ids, 2)  # the blocks a holds count once: it fits beside a
    b = eng.submit(b_ids, 2)  # 6 + 5 > 8: waits, though max_num_seqs has room
    s1 = eng.plan()
    # same: all cached, but vLLM hits at most prompt - 1 tokens, so it recomputes its last block in a block of its
    # own (a second copy of a's last block: vLLM does not de-duplicate)
    assert s1 is not None and s1.prefill == ((a, 80), (same, 16))
    assert (eng.running, eng.waiting, eng.kv_usage(), b.state) == (2, 1, 6 / 8, WAITING)
    eng.finish(s1)
    eng.finish(eng.plan())  # a's and same's last tokens
    assert (a.state, same.state, eng.kv_usage()) == (FINISHED, FINISHED, 0.0)  # cached but free is free
    published.clear()
    s3 = eng.plan()
    assert s3 is not None and s3.prefill == ((b, 80),) and eng.kv_usage() == 5 / 8
    eng.finish(s3)
    removed = [h for e in published[0] if isinstance(e, VllmBlockRemoved) for h in e.block_hashes]
    # LRU, tail first (vLLM frees a request's blocks in reverse order): a's last block, then same's copy of it
    # (each copy with its BlockRemoved), then a's fourth go; its first three (the prefix a repeat would hit) stay
    a_chain = external_chain(HashConfig("sha256", None, 16), a_ids)
    assert removed == [a_chain[4], a_chain[4], a_chain[3]]
    assert isinstance(published[0][-1], VllmBlockStored) and len(eng.cache) == 8


def test_chunked_prefill_shares_the_token_budget() -> None:
    eng, _ = make_engine(max_num_batched_tokens=64)
    a = eng.submit(list(range(16)), 10)
    b = eng.submit(list(range(500, 700)), 1)  # 200 tokens: 48 + 63 + 63 + 26
    steps = play(eng)
    chunks = [[n for s, n in st.prefill if s is b] for st in steps[:4]]
    assert chunks == [[48], [63], [63], [26]] and all(a in st.decode for st in steps[1:4])  # a never stalls
    assert b.first_token_s == pytest.approx(sum(st.duration_s for st in steps[:4]))
    assert steps[1].duration_s == pytest.approx(step_s(63, 1))


def test_sleep_abort_ends_in_flight_and_queued_clear_waits_for_a_step() -> None:
    eng, published = make_engine()
    a = eng.submit(list(range(32)), 100)
    eng.finish(eng.plan())
    published.clear()
    eng.sleep(1, "abort")
    assert a.state == FINISHED and a.finish_reason == "abort" and eng.kv_usage() == 0.0
    assert eng.sched.take_outputs()[-1] == Output(a.seq_id, 1, a.first_token_s, "abort")
    late = eng.submit(list(range(32)), 1)
    assert eng.plan() is None and eng.waiting == 1 and not published  # asleep: it waits; clear only queued
    eng.wake_up(None)
    play(eng)
    assert late.state == FINISHED and late.num_cached_tokens == 0
    assert isinstance(published[0][0], VllmAllBlocksCleared) and isinstance(published[0][1], VllmBlockStored)


def test_sleep_keep_preempts_and_recomputes_after_wake() -> None:
    eng, _ = make_engine()
    a = eng.submit(list(range(32)), 3)
    eng.finish(eng.plan())
    eng.finish(eng.plan())
    first = a.first_token_s
    eng.sleep(1, "keep")  # the cache reset preempts the running request: it waits, frozen
    assert (a.state, a.num_output, eng.sched.stats.num_preemptions, eng.plan()) == (WAITING, 2, 1, None)
    eng.wake_up(None)
    s = eng.plan()
    assert s is not None and s.prefill == ((a, 32 + 2),)  # prompt and output recomputed: the cache is empty
    eng.finish(s)
    assert (a.state, a.num_output, a.first_token_s) == (FINISHED, 3, first)


def test_sleep_wait_drains_then_clears() -> None:
    eng, published = make_engine()
    a = eng.submit(list(range(32)), 3)
    eng.finish(eng.plan())
    eng.sleep(1, "wait")
    b = eng.submit(list(range(64, 96)), 1)
    assert eng.is_sleeping() and len(eng.cache) == 2  # drains first: cache untouched
    play(eng)
    assert a.state == FINISHED and a.finish_reason == "length" and b.state == WAITING
    assert len(eng.cache) == 0 and isinstance(eng.pending[-1], VllmAllBlocksCleared)  # reset after the drain
    assert not any(isinstance(e, VllmAllBlocksCleared) for batch in published for e in batch)  # only queued
    eng.wake_up(None)
    play(eng)
    assert b.state == FINISHED and isinstance(published[-1][0], VllmAllBlocksCleared)


def test_abort_frees_the_slot_for_the_queue() -> None:
    eng, _ = make_engine(max_num_seqs=1)
    a = eng.submit(list(range(16)), 1000)
    b = eng.submit(list(range(100, 116)), 1)
    eng.finish(eng.plan())
    assert (a.state, b.state) == (RUNNING, WAITING)
    eng.abort(a)  # the client went away
    s = eng.plan()
    assert s is not None and s.prefill == ((b, 16),) and not a.pinned and eng.running == 1


def test_sleep_counts_in_ttft_through_the_time_source() -> None:
    wall = [100.0]
    cfg = SimEngineConfig(model="m", time_scale=0.5, **COST)
    eng = SimEngine(cfg, lambda _: None, clock=lambda: wall[0])
    eng.sleep(0, "abort")
    a = eng.submit(list(range(16)), 1)
    wall[0] += 2.0  # two wall seconds asleep = four modelled seconds at time_scale 0.5
    eng.wake_up(None)
    play(eng)
    assert ttft(a) == pytest.approx(4.0 + step_s(16, 0))


# --- over HTTP: a real SimVllm ---------------------------------------------------------------------


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


async def _metrics(
    http: aiohttp.ClientSession, sim: SimVllm
) -> dict[str, list[tuple[dict[str, str], float]]]:
    async with http.get(sim.url + "/metrics") as r:
        return _samples(await r.text())


def _v(m: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return m[name][0][1]


async def _until(fn, pred, timeout: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        x = await fn()
        if pred(x):
            return x
        assert asyncio.get_running_loop().time() < deadline, f"timed out; last {x}"
        await asyncio.sleep(0.02)


async def test_http_queue_kv_usage_and_cancel_in_metrics() -> None:
    # real time (time_scale 1, vLLM-like default costs): one slot, a 100000-token stream holds it
    sim = await SimVllm(
        SimConfig(engine=SimEngineConfig(model="m", num_blocks=64, time_scale=1.0, max_num_seqs=1))
    ).start()
    try:
        async with aiohttp.ClientSession() as http:
            long = await http.post(
                sim.url + "/v1/completions",
                json={"prompt": list(range(64)), "max_tokens": 8000, "stream": True},
            )
            await long.content.readuntil(b"\n\n")  # streaming: its first token is out
            short = asyncio.create_task(
                http.post(sim.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
            )
            m = await _until(lambda: _metrics(http, sim), lambda m: _v(m, "vllm:num_requests_waiting") == 1)
            assert _v(m, "vllm:num_requests_running") == 1
            assert _v(m, "vllm:kv_cache_usage_perc") == 4 / 64  # the stream's 4 prompt blocks
            long.close()  # the client goes away: its slot frees, the queued request runs
            r = await asyncio.wait_for(short, 30)
            assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "length"
            m = await _until(lambda: _metrics(http, sim), lambda m: _v(m, "vllm:num_requests_running") == 0)
            assert (_v(m, "vllm:num_requests_waiting"), _v(m, "vllm:kv_cache_usage_perc")) == (0, 0)
    finally:
        await sim.stop()


async def test_http_ttft_histogram_token_counters_and_cache_config() -> None:
    eng = SimEngineConfig(model="m", num_blocks=1024, time_scale=0.01, **COST)
    sim = await SimVllm(SimConfig(engine=eng)).start()
    bodies = [
        {"prompt": list(range(1600)), "max_tokens": 4},
        {"prompt": list(range(1600)), "max_tokens": 2},
        {"prompt": list(range(800)) + list(range(9000, 9300)), "max_tokens": 3},
    ]
    try:
        async with aiohttp.ClientSession() as http:
            cached = []
            for b in bodies:  # one after the other: each runs alone, so its TTFT is the lone figure
                async with http.post(sim.url + "/v1/completions", json=b) as r:
                    assert r.status == 200
                    cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
            m = await _metrics(http, sim)
    finally:
        await sim.stop()
    assert cached == [0, 1584, 800]  # the repeat: all but its last block (vLLM hits at most prompt - 1 tokens)
    expected = [step_s(max(len(b["prompt"]) - c, 1), 0) for b, c in zip(bodies, cached, strict=True)]
    buckets = {s[0]["le"]: s[1] for s in m["vllm:time_to_first_token_seconds_bucket"]}
    assert list(buckets) == [str(le) for le in VLLM_TTFT_LE] + ["+Inf"]  # vLLM's buckets, exactly
    want = [sum(bisect_left(VLLM_TTFT_LE, t) <= i for t in expected) for i in range(len(VLLM_TTFT_LE) + 1)]
    assert list(buckets.values()) == want and want[-1] == 3
    assert _v(m, "vllm:time_to_first_token_seconds_count") == 3
    assert _v(m, "vllm:time_to_first_token_seconds_sum") == pytest.approx(math.fsum(expected))
    assert _v(m, "vllm:prompt_tokens_total") == 1600 + 1600 + 1100
    assert _v(m, "vllm:generation_tokens_total") == 4 + 2 + 3
    assert _v(m, "vllm:prefix_cache_hits_total") == 2384 and _v(m, "vllm:prefix_cache_queries_total") == 4300
    info = m["vllm:cache_config_info"][0][0]
    assert info["num_gpu_blocks"] == "1024" and info["block_size"] == "16" and info["engine"] == "0"


async def test_time_scale_zero_is_instant() -> None:
    # a decode cost of 100 s per step: with the clock on this request would take 50 modelled minutes
    eng = SimEngineConfig(model="m", decode_base_s=100.0)  # time_scale defaults to 0 in-process
    sim = await SimVllm(SimConfig(engine=eng)).start()
    try:
        assert sim.loop is None
        async with aiohttp.ClientSession() as http:
            async with http.post(
                sim.url + "/v1/completions",
                json={"prompt": list(range(40)), "max_tokens": 30},
                timeout=aiohttp.ClientTimeout(total=30),
            ) as r:
                body = await r.json()
            m = await _metrics(http, sim)
    finally:
        await sim.stop()
    assert body["usage"]["completion_tokens"] == 30 and sim.engine.sched.now == 0.0  # no step played out
    assert _v(m, "vllm:time_to_first_token_seconds_count") == 1
    assert _v(m, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.002 + 100.0)  # modelled, alone


def test_cli_clock_flags() -> None:
    d = _parse([]).engine
    assert d.time_scale == 1.0  # the command plays the clock in real time by default
    assert (d.max_num_seqs, d.max_num_batched_tokens, d.prefill_tokens_per_s) == (1024, 8192, 15000.0)
    c = _parse(
        [
            "--time-scale",
            "0.25",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--prefill-tokens-per-s",
            "20000",
            "--step-overhead-s",
            "0.001",
            "--decode-base-s",
            "0.01",
            "--decode-per-seq-s",
            "0.0001",
            "--num-blocks",
            "99",
        ]
    ).engine
    assert (c.time_scale, c.max_num_seqs, c.max_num_batched_tokens, c.num_blocks) == (0.25, 8, 512, 99)
    assert c.cost_model().step_s(0, 2) == pytest.approx(0.001 + 0.01 + 0.0002)
    with pytest.raises(SystemExit):
        _parse(["--max-num-seqs", "0"])


def test_instant_path_evicts_a_requests_tail_first() -> None:
    """vLLM frees a finished request's blocks in reverse order, so under pressure an old
    conversation loses its tail, not its head: a repeat still hits its first blocks."""
    eng, _ = make_engine(num_blocks=8)
    a_ids, b_ids = list(range(80)), list(range(1000, 1048))  # 5 and 3 full blocks
    eng._step(a_ids, None, None, False)
    eng._step(b_ids, None, None, False)  # fills the pool exactly
    eng._step(list(range(2000, 2032)), None, None, False)  # 2 more blocks: evicts a's last two
    again = eng._step(a_ids, None, None, False)
    print(f"repeat of a after pressure: {again.num_cached_tokens} of 80 tokens cached")
    assert again.num_cached_tokens == 48  # a's head (3 blocks) survived; head-first LRU would give 0
