"""The stand-in checks each request against its context length (`max_model_len`) as vLLM does, before anything runs:
output asked for past the context length, or a prompt that leaves no room for it, is a 400 in vLLM's words; a
request that fits exactly runs. NOTE: before, nothing was checked: `max_tokens: 10**30` made the stand-in build the
whole output until the kernel killed its process (exit 137), taking every request on it down."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from fleet.app.testkit.sim_vllm import tokenizer as tok
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

L = 64  # a small context, so prompts at and past it stay small


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


def _refused(status: int, doc: dict[str, Any], message: str) -> bool:
    """vLLM's 400: its message, and the parameter it names as "param" (before, the stand-in's body had no "param")."""
    param = message.rsplit("(parameter=", 1)[1].split(",")[0] if "(parameter=" in message else None
    return status == 400 and doc == {"error": {"message": message, "type": "BadRequestError", "param": param,
                                               "code": 400}}


async def test_output_past_the_context_length_is_refused_and_the_worker_keeps_serving() -> None:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m"))).start()  # the default: 8192
    try:
        async with aiohttp.ClientSession() as http:
            url = sim.url + "/v1/completions"
            for big in (8193, 10**30):
                status, doc = await _post(http, url, {"prompt": "hello", "max_tokens": big})
                assert _refused(status, doc, f"max_tokens={big} cannot be greater than max_model_len=max_total_tokens="
                                             f"8192. Please request fewer output tokens. (parameter=max_tokens, "
                                             f"value={big})"), (status, doc)
            # a chat request names its field; max_completion_tokens wins over max_tokens
            status, doc = await _post(http, sim.url + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9000, "max_tokens": 4})
            assert _refused(status, doc, "max_completion_tokens=9000 cannot be greater than max_model_len="
                                         "max_total_tokens=8192. Please request fewer output tokens. (parameter="
                                         "max_completion_tokens, value=9000)"), (status, doc)
            assert sim.engine.queries == 0  # nothing ran
            status, doc = await _post(http, url, {"prompt": "hello", "max_tokens": 3})  # the worker still serves
            assert status == 200 and doc["usage"]["completion_tokens"] == 3
    finally:
        await sim.stop()


@pytest.mark.parametrize("time_scale", [0.0, 0.001])
async def test_a_prompt_that_leaves_no_room_is_refused_and_one_that_fits_exactly_runs(time_scale: float) -> None:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", max_model_len=L, time_scale=time_scale))).start()
    try:
        async with aiohttp.ClientSession() as http:
            url = sim.url + "/v1/completions"
            status, doc = await _post(http, url, {"prompt": list(range(L - 15)), "max_tokens": 16})  # L - 16 + 1
            assert _refused(status, doc, f"You passed {L - 15} input tokens and requested 16 output tokens. However, "
                                         f"the model's context length is only {L} tokens, resulting in a maximum "
                                         f"input length of {L - 16} tokens. Please reduce the length of the input "
                                         f"prompt. (parameter=input_tokens, value={L - 15})"), (status, doc)
            # one prompt of a batch too long refuses the whole request: none of its prompts runs
            status, doc = await _post(http, url, {"prompt": [[1, 2, 3], list(range(L + 1))]})
            assert status == 400 and "You passed 65 input tokens and requested 16 output" in doc["error"]["message"]
            assert sim.engine.queries == 0
            # prompt + max_tokens == max_model_len runs (a completion's max_tokens defaults to 16)
            status, doc = await _post(http, url, {"prompt": list(range(L - 16))})
            assert status == 200 and doc["usage"] == {"prompt_tokens": L - 16, "completion_tokens": 16,
                                                      "total_tokens": L, "prompt_tokens_details": doc["usage"][
                                                          "prompt_tokens_details"]}
    finally:
        await sim.stop()


async def test_a_chat_without_an_output_count_runs_16_tokens_within_the_context_length() -> None:
    """vLLM lets such a chat run to max_model_len less its prompt, and a real model stops at its end of sequence
    long before; the stand-in has none, so it runs 16 tokens (context.output_len), fewer where the context ends."""
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", max_model_len=L))).start()
    try:
        async with aiohttp.ClientSession() as http:
            url = sim.url + "/v1/chat/completions"
            msgs = [{"role": "user", "content": "one two three"}]
            n = len(tok.apply_chat_template(msgs))
            status, doc = await _post(http, url, {"messages": msgs})
            assert status == 200 and doc["usage"]["completion_tokens"] == min(16, L - n), doc
            near = [{"role": "user", "content": " ".join(["w"] * (L - n - 2))}]  # 5 tokens of room: 5, not 16
            m = len(tok.apply_chat_template(near))
            status, doc = await _post(http, url, {"messages": near})
            assert 0 < L - m < 16 and status == 200 and doc["usage"]["completion_tokens"] == L - m, (m, doc)
            status, doc = await _post(http, url, {"messages": msgs, "max_completion_tokens": 5, "max_tokens": 7})
            assert status == 200 and doc["usage"]["completion_tokens"] == 5, doc  # max_completion_tokens wins
            # a rendered chat of exactly max_model_len tokens leaves no room for the token it must compute
            words = " ".join(["w"] * (L - n + 3))
            long_msgs = [{"role": "user", "content": words}]
            m = len(tok.apply_chat_template(long_msgs))
            assert m == L, m
            status, doc = await _post(http, url, {"messages": long_msgs})
            assert _refused(status, doc, f"The decoder prompt (length {L}) plus the number of requested output tokens "
                                         f"(at least 1) is longer than the maximum model length of {L}. Make sure "
                                         "that `max_model_len` is no smaller than the number of text tokens (prompt + "
                                         "requested output tokens)."), (status, doc)
    finally:
        await sim.stop()
