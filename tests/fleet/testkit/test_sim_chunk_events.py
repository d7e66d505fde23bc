"""The stand-in stores and announces a prompt's blocks per prefill chunk, at the step that computes them, as vLLM's
KV cache manager caches them (`allocate_slots` -> `cache_full_blocks`: one BlockStored per request and step,
published with that step's batch). A prompt longer than `max_num_batched_tokens` goes out in several batches, a
request that arrives between the chunks can hit only the blocks already computed, and a `mode=wait` drain publishes
the blocks its running requests compute. Before, every full block of a prompt was stored and announced when the
request was admitted.

The engine test steps a real SimEngine in modelled time (exact, no sockets); the HTTP tests run a real SimVllm with
its ZMQ publisher, its clock in real time with slow prefill steps (half a second per 64-token chunk), and assert on
what was published and answered, never on durations.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq
import zmq.asyncio

from controller.vllm.events import AllBlocksCleared, BlockStored, decode_batch, parse_seq
from controller.vllm.http import parse_metrics
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.engine import SimEngine
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.app.testkit.sim_vllm.wire import VllmBlockStored
from fleet.core.block_hash import HashConfig, external_chain

B, BUDGET = 16, 64  # a chunk is 64 tokens: 4 blocks
PROMPT = list(range(1000, 1512))  # 512 tokens: 32 blocks, 8 chunks
CHAIN = external_chain(HashConfig("sha256", None, B), PROMPT)
# half a second of modelled (and, at time_scale 1, wall) time per 64-token chunk; a decode step 5 ms
SLOW = {"max_num_batched_tokens": BUDGET, "prefill_tokens_per_s": 128.0, "decode_base_s": 0.005}


def test_each_step_stores_and_publishes_the_blocks_its_chunk_computed() -> None:
    published: list[list[object]] = []
    eng = SimEngine(SimEngineConfig(model="m", num_blocks=64, max_num_batched_tokens=BUDGET), published.append)
    warm = eng.submit(list(range(48)), 1)  # 48 tokens: the next request is admitted beside it with 16 of budget
    seq = eng.submit(PROMPT, 1)
    n = 0
    while (step := eng.plan()) is not None:
        chunk = dict((s.seq_id, k) for s, k in step.prefill).get(seq.seq_id, 0)
        stored = [h for e in eng.pending if isinstance(e, VllmBlockStored) for h in e.block_hashes if h in CHAIN]
        # cached as the step is scheduled (a request admitted after it hits them), published when it ends
        assert stored == CHAIN[n : (seq.num_computed + chunk) // B], (n, stored)
        assert {eng.lru[b] for b in seq.pinned} <= eng.cache.keys() and len(seq.pinned) == len(stored) + n
        before = len(published)
        eng.finish(step)
        if stored:
            assert len(published) == before + 1 and [h for e in published[-1] if isinstance(e, VllmBlockStored)
                                                     for h in e.block_hashes if h in CHAIN] == stored
        n += len(stored)
    assert warm.finish_reason == seq.finish_reason == "length" and n == len(CHAIN)
    # the first chunk had the 16 tokens of the step's budget the other request left (one block), the next seven 64
    # (4 blocks each), the ninth the last 48 (3 blocks)
    sizes = [len([h for e in b if isinstance(e, VllmBlockStored) for h in e.block_hashes if h in CHAIN])
             for b in published]
    assert [k for k in sizes if k] == [1, 4, 4, 4, 4, 4, 4, 4, 3]


@pytest.fixture
async def slow() -> AsyncIterator[tuple[SimVllm, aiohttp.ClientSession, zmq.asyncio.Socket]]:
    cfg = SimEngineConfig(model="m", num_blocks=256, time_scale=1.0, **SLOW)
    s = await SimVllm(SimConfig(engine=cfg)).start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(s.kv_events)
    try:
        async with aiohttp.ClientSession() as http:
            await asyncio.sleep(0.2)  # the SUB joins before anything is published
            yield s, http, sub
    finally:
        sub.close(0)
        ctx.term()
        await s.stop()


async def _recv(sub: zmq.asyncio.Socket, timeout: float = 10.0) -> tuple[int, list[object]]:
    f = await asyncio.wait_for(sub.recv_multipart(), timeout)
    return parse_seq(f[1]), list(decode_batch(f[2]).events)


def _stored(events: list[object]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


async def _until_waiting(http: aiohttp.ClientSession, s: SimVllm, n: int) -> None:
    for _ in range(500):
        if parse_metrics(await (await http.get(s.url + "/metrics")).text()).waiting == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"vllm:num_requests_waiting never reached {n}")


async def _completion(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}) as r:
        return r.status, await r.json()


async def test_a_prompt_longer_than_the_budget_is_announced_chunk_by_chunk(slow) -> None:
    s, http, sub = slow
    status, body = await _completion(http, s.url)
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    batches = [await _recv(sub) for _ in range(len(PROMPT) // BUDGET)]
    # one batch per step, in order, each the one BlockStored of the 4 blocks its 64-token chunk filled, chained on
    # the block before it (before: all 32 blocks in one batch, at admission)
    assert [seq for seq, _ in batches] == list(range(8))
    assert [[(list(e.block_hashes), e.parent_block_hash) for e in _stored(evs)] for _, evs in batches] == [
        [(CHAIN[i : i + 4], CHAIN[i - 1] if i else None)] for i in range(0, 32, 4)
    ]
    assert [b for _, evs in batches for e in _stored(evs) for b in e.token_ids] == PROMPT


async def test_a_request_sent_between_the_chunks_hits_only_the_blocks_computed(slow) -> None:
    """The first request's client goes away mid-prefill: the blocks its chunks computed stay cached, the rest were
    never computed. A second request with the same prompt, sent while the first was prefilling, hits exactly the
    blocks announced for the first (before: all 32, stored when the first was admitted)."""
    s, http, sub = slow
    first = asyncio.create_task(_completion(http, s.url))
    seq, evs = await _recv(sub)  # its first chunk was computed and announced
    assert seq == 0 and list(_stored(evs)[0].block_hashes) == CHAIN[:4]
    second = asyncio.create_task(_completion(http, s.url))
    await _until_waiting(http, s, 1)  # queued behind the first, which takes each step's whole budget
    first.cancel()  # its client goes away: aborted, its blocks freed (the computed ones stay cached)
    status, body = await asyncio.wait_for(second, 30)
    hit = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    announced = list(_stored(evs)[0].block_hashes)
    while len(announced) < len(CHAIN):
        _, evs = await _recv(sub)
        announced += [h for e in _stored(evs) for h in e.block_hashes]
    assert status == 200 and announced == CHAIN  # each block computed once: by the first, or by the second
    assert hit % BUDGET == 0 and BUDGET <= hit < len(PROMPT), hit  # a chunk boundary inside the prompt
    text = await (await http.get(s.url + "/metrics")).text()
    queries = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("vllm:prefix_cache_queries_total")]
    assert parse_metrics(text).prefix_hits == hit and queries == [2 * len(PROMPT)]


@pytest.mark.slow
async def test_a_wait_drain_publishes_the_blocks_a_running_request_computes(slow) -> None:
    """`/sleep?level=1&mode=wait` lets the running request finish: its later chunks are computed during the drain
    and their blocks announced then, before the sleep answers; the cache reset comes after them, with the step
    after wake (before: nothing was stored during a drain, the prompt's blocks having all gone out at admission)."""
    s, http, sub = slow
    req = asyncio.create_task(_completion(http, s.url))
    seq, evs = await _recv(sub)
    assert seq == 0 and list(_stored(evs)[0].block_hashes) == CHAIN[:4]
    sleep = asyncio.create_task(http.post(s.url + "/sleep", params={"level": "1", "mode": "wait"}))
    for _ in range(500):
        if s.engine.is_sleeping():
            break
        await asyncio.sleep(0.01)
    assert s.engine.is_sleeping() and not sleep.done()  # draining
    during = []
    while not sleep.done():
        try:
            during.append(await _recv(sub, 0.2))
        except TimeoutError:
            pass
    async with await sleep as r:
        assert r.status == 200
    status, _ = await req
    drained = [h for _, evs in during for e in _stored(evs) for h in e.block_hashes]
    assert status == 200 and drained and CHAIN[:4] + drained == CHAIN  # the rest of the prompt, during the drain
    assert not any(isinstance(e, AllBlocksCleared) for _, evs in during for e in evs)  # the reset is only queued
    await http.post(s.url + "/wake_up")
    assert (await _completion(http, s.url))[0] == 200
    _, evs = await _recv(sub)
    assert isinstance(evs[0], AllBlocksCleared)
