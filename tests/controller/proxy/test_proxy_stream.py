"""Streaming arrives intact and in order; a client that goes away cancels the upstream request."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from support.proxy_fleet import LONG_CONTEXT, MODEL, Fleet, served, sse_events, start_fleet, until

from fleet.app.testkit.sim_vllm import tokenizer as simtok

PROMPT = "Write the release notes for version two, one bullet per fix."


def _choices(raw: bytes) -> list[object]:
    """Each SSE event's choices (ids and timestamps differ run to run); '[DONE]' kept as is."""
    return [e if e == "[DONE]" else json.loads(e)["choices"] for e in sse_events(raw)]


async def test_stream_arrives_intact_and_in_order(fleet: Fleet) -> None:
    n = 40
    status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": n,
                                                          "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and h["Content-Type"].startswith("text/event-stream")
    pieces = [c[0]["text"] for c in _choices(raw)[:-2]]  # then the usage chunk and [DONE]
    expected = [simtok.detokenize([t]) for t in simtok.synthetic_output(simtok.tokenize(PROMPT), n)]
    print(f"{len(pieces)} streamed pieces through the proxy; first {pieces[:3]}; expected first {expected[:3]}")
    assert pieces == expected and _choices(raw)[-1] == "[DONE]"
    # the same request straight to the worker that served it: event for event the same stream
    url = fleet.sims[h["x-kvfleet-worker"]].url
    async with fleet.http.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": n,
                                                              "stream": True, "stream_options": {"include_usage": True}}) as r:
        direct = await r.read()
    assert _choices(raw) == _choices(direct) and len(sse_events(raw)) == n + 2
    # chat, streamed: the deltas are the worker's, in order
    status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": 12,
                                                               "messages": [{"role": "user", "content": PROMPT}]})
    deltas = [c[0]["delta"]["content"] for c in _choices(raw)[:-1]]  # then [DONE]: no usage chunk unasked, as vLLM
    ids = simtok.apply_chat_template([{"role": "user", "content": PROMPT}])
    assert status == 200 and deltas == [simtok.detokenize([t]) for t in simtok.synthetic_output(ids, 12)]


async def test_client_disconnect_mid_stream_cancels_upstream(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, engine_kw=LONG_CONTEXT)  # an answer far past the default context length
    try:
        await _disconnect_mid_stream(fleet)
    finally:
        await fleet.stop()


async def _disconnect_mid_stream(fleet: Fleet) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100_000, "stream": True}
    async with fleet.http.post(fleet.proxy.url + "/v1/completions", json=body, headers=fleet.headers()) as r:
        worker = r.headers["x-kvfleet-worker"]
        first = await r.content.readuntil(b"\n\n")
        r.close()  # the client goes away after its first event
    seen = served(fleet.sims[worker], "/v1/completions")[-1]
    await until(lambda: _now(seen), lambda s: s.disconnected and s.outcome != "running", timeout=10)
    print(f"client read {len(first)} bytes of a 100000-token stream and left; the worker saw its connection close "
          f"and its handler ended with {seen.outcome}")
    assert seen.outcome != "ok"  # the worker did not get to finish the 100000 tokens
    assert fleet.proxy.metrics.cancelled.labels(worker)._value.get() == 1


async def test_client_disconnect_while_queued_closes_upstream(tmp_path: Path) -> None:
    # a worker asleep behind the controller's back queues the request; the client gives up first
    fleet = await start_fleet(tmp_path, num_workers=1, reconcile_s=30.0, first_byte_timeout_s=30.0)
    try:
        sim = next(iter(fleet.sims.values()))
        async with fleet.http.post(sim.url + "/sleep?level=0") as r:
            assert r.status == 200
        task = asyncio.create_task(fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT}))
        await until(lambda: _now(served(sim, "/v1/completions")), lambda s: len(s) == 1)
        seen = served(sim, "/v1/completions")[0]
        assert not seen.disconnected and sim.engine.waiting == 1  # control: queued at the worker, connection open
        task.cancel()
        await until(lambda: _now(seen), lambda s: s.disconnected, timeout=10)
        print("queued request: client cancelled -> the worker's connection closed:", seen.disconnected)
    finally:
        await fleet.stop()


async def _now(x: object) -> object:
    return x
