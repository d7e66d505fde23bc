"""The stand-in serves the request shapes that carry several prompts or sequences as vLLM does: a completion's batch
(a list of strings, or of token-id lists) and `n` > 1 give one choice per prompt x n, choice i * n + j being prompt
i's j-th sequence, each its own engine request; usage counts each prompt's tokens once and every sequence's output.
NOTE: before, a batch was the stand-in's 400 ("prompt must be a string, got list") and `n` was ignored (one choice),
so the bench and the proxy tests never saw a worker prefill several prompts for one request."""

from __future__ import annotations

import json

import aiohttp
import pytest

from fleet.app.testkit.sim_vllm import tokenizer as tok
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

A, B = "alpha beta gamma delta", "epsilon zeta"


async def _sim(time_scale: float) -> SimVllm:
    return await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=256, time_scale=time_scale))).start()


@pytest.mark.parametrize("time_scale", [0.0, 0.001])
async def test_a_batch_times_n_gives_one_choice_per_prompt_and_sequence_with_usage_summed(time_scale: float) -> None:
    sim = await _sim(time_scale)
    try:
        async with aiohttp.ClientSession() as http:
            for prompt in ([A, B], [tok.tokenize(A), tok.tokenize(B)]):
                r = await http.post(sim.url + "/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 3})
                doc = await r.json()
                assert r.status == 200, doc
                assert [c["index"] for c in doc["choices"]] == [0, 1, 2, 3]
                want = [tok.detokenize(tok.synthetic_output(tok.tokenize(p), 3)) for p in (A, A, B, B)]
                assert [c["text"] for c in doc["choices"]] == want
                u = doc["usage"]
                assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (6, 12, 18)
            # the chat's n: one prompt, n choices
            r = await http.post(sim.url + "/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": A}], "n": 3, "max_tokens": 2})
            doc = await r.json()
            assert [c["index"] for c in doc["choices"]] == [0, 1, 2] and doc["usage"]["completion_tokens"] == 6
            # streamed: every choice's chunks, then one usage chunk over them all
            r = await http.post(sim.url + "/v1/completions", json={"prompt": [A, B], "n": 2, "max_tokens": 2,
                                                                  "stream": True, "stream_options": {}})
            raw = (await r.read()).decode()
            events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
            ended = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
            assert ended == [0, 1, 2, 3] and raw.endswith("data: [DONE]\n\n")
            assert events[-1]["usage"]["prompt_tokens"] == 6 and events[-1]["usage"]["completion_tokens"] == 8
    finally:
        await sim.stop()


async def test_bad_batch_shapes_and_n_are_refused_with_a_clear_400() -> None:
    sim = await _sim(0.001)
    try:
        async with aiohttp.ClientSession() as http:
            for body, words in (({"prompt": []}, "prompt must be"), ({"prompt": [A, [1, 2]]}, "not a mix"),
                                ({"prompt": [A, 3]}, "not a mix"), ({"prompt": [[]]}, "cannot be empty"),
                                ({"prompt": [A, ""]}, "cannot be empty"), ({"prompt": A, "n": 0}, "at least 1"),
                                ({"prompt": A, "n": "2"}, "n must be an integer")):
                r = await http.post(sim.url + "/v1/completions", json={"max_tokens": 2, **body})
                assert r.status == 400, body
                assert words in (await r.json())["error"]["message"], body
            # nothing was left running or queued by the refusals
            r = await http.post(sim.url + "/v1/completions", json={"prompt": A, "max_tokens": 2})
            assert r.status == 200
            assert (sim.engine.running, sim.engine.waiting) == (0, 0)
    finally:
        await sim.stop()
