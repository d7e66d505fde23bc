"""The stand-in's /v1/responses answers unstreamed only; a streamed request is told what to send instead."""

from __future__ import annotations

import aiohttp

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm


async def test_a_streamed_responses_request_is_told_to_send_it_unstreamed() -> None:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=16))).start()
    body = {"model": "m", "input": "hello", "max_output_tokens": 4}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(sim.url + "/v1/responses", json={**body, "stream": True}) as r:
                status, err = r.status, (await r.json())["error"]
            async with http.post(sim.url + "/v1/responses", json=body) as r:  # control: unstreamed, answered
                ok, doc = r.status, await r.json()
    finally:
        await sim.stop()
    print(status, err)
    assert status == 400 and err["type"] and "unstreamed only" in err["message"]
    assert 'send it without "stream": true' in err["message"]  # before: it named no next step (the OpenAI client's
    assert ok == 200 and doc["object"] == "response" and doc["output"]  # responses.create(stream=True) got only that)
