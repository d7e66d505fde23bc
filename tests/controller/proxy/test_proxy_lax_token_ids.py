"""A completions prompt of token ids is read as vLLM reads it: its request model's `prompt` is a union of shapes
(`list[int >= 0] | list[list[int >= 0]] | str | list[str]`) that pydantic validates in lax mode, so 1000.0, "1000"
and true are token ids 1000, 1000 and 1 there, and 1000.5, "a" or -1 are its 400. The proxy refused every id that was
not a JSON integer (a client holding its ids as floats, as JavaScript and numpy do, got a 400 vLLM never gives)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import pytest
from support.proxy_fleet import BLOCK, MODEL, Fleet, served, until

from fleet.core.lax import lax_int

IDS = [(7 * i + 3) % 5000 for i in range(64)]  # 4 blocks


async def _send(fleet: Fleet, prompt: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    return status, h, json.loads(raw)


async def test_whole_float_ids_are_routed_as_the_ints_vllm_reads(fleet: Fleet) -> None:
    status, h, doc = await _send(fleet, IDS)
    assert status == 200 and h["x-kvfleet-verdict"] == "COLD", doc
    holder = h["x-kvfleet-worker"]
    await until(lambda: fleet.blocks_known(holder), lambda n: n >= len(IDS) // BLOCK)
    # the same ids as floats, with the first as a string, and as a batch of one list of floats: WARM on the holder for
    # all 4 blocks (NOTE: before the fix, each a 400 from the proxy)
    resent: list[Any] = [[float(t) for t in IDS], [str(t) for t in IDS[:1]] + IDS[1:], [[float(t) for t in IDS]]]
    for prompt in resent:
        status, h, doc = await _send(fleet, prompt)
        assert status == 200, (prompt[:2], doc)
        cached = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
        # the worker reuses all but the last block: vLLM hits at most prompt - 1 tokens
        assert (h["x-kvfleet-worker"], h["x-kvfleet-verdict"], h["x-kvfleet-matched-tokens"], cached) == \
            (holder, "WARM", "64", 64 - BLOCK), prompt[:2]
    status, h, doc = await _send(fleet, [True, *IDS[1:]])  # true is id 1
    assert status == 200 and doc["usage"]["prompt_tokens"] == len(IDS), doc
    sent = sum(len(served(s, "/v1/completions")) for s in fleet.sims.values())
    # what vLLM refuses is still a 400 naming the element, and reaches no worker
    refused: list[tuple[Any, str]] = [([1000.5, 12], "prompt[0] is 1000.5"), ([12, "a"], 'prompt[1] is "a"'),
                          ([[1], [2, -3]], "prompt[1][1] is -3"), ([1, 1e300], "prompt[1] is 1e+300"),
                          ([1, 2 ** 32], "prompt[1] is 4294967296"), ([[1], [2.0 ** 40]], "prompt[1][0] is 1099511627776")]
    for prompt, where in refused:
        status, _, doc = await _send(fleet, prompt)
        assert status == 400 and where in doc["error"]["message"], (prompt, doc)
        assert doc["error"]["param"] in ("prompt", "prompt[1]")
        assert "must be a string, a list of token ids" in doc["error"]["message"]
    assert sum(len(served(s, "/v1/completions")) for s in fleet.sims.values()) == sent


@pytest.mark.parametrize("value", [
    0, 7, True, False, 1000.0, -0.0, 1000.5, 1e300, float("inf"), float("nan"), 2.0 ** 63, 9.223372036854775e18,
    "12", " 12 ", "\t12\n", "\u300012", "\x1c12", "+12", "-0", "012", "1_000", "1__0", "_10", "10_", "12.0", "1.00",
    "12.", ".0", "1.0_0", "1_0.0", "12.5", "1e3", "0x10", "\u0661\u0662", "", " ", "+ 12", "99999999999999999999999",
    None, [], {}, [1]])
def test_an_id_is_read_as_pydantics_lax_int(value: Any) -> None:
    """lax_int against pydantic itself (what vLLM's FastAPI validates a request with), value by value."""
    from pydantic import Field, TypeAdapter, ValidationError

    vllm: TypeAdapter[int] = TypeAdapter(Annotated[int, Field(strict=False)])
    try:
        want: int | None = vllm.validate_python(value)
    except ValidationError:
        want = None
    assert lax_int(value) == want


def test_the_proxys_fast_paths_read_a_prompt_as_pydantic_does() -> None:
    """The proxy reads an id list in C first (msgspec, strict, then lax for a list of numbers), id by id only when
    that refuses it: every path gives pydantic's answer or its refusal."""
    from pydantic import Field, TypeAdapter, ValidationError

    from controller.proxy.batch_prompts import MAX_ID, _ids
    from controller.proxy.errors import ProxyError

    vllm: TypeAdapter[list[int]] = TypeAdapter(list[Annotated[int, Field(ge=0)]])
    lists: list[list[Any]] = [[1, 2], [1.0, 2], [-0.0], [2.0 ** 53], [9.223372036854775e18], [2.0 ** 63], [1e300],
                              [1, -1], [-1.0], [1.5], [True, 0], [False], ["7", 1.0], [" 7", "8.0"], [2 ** 70], [None],
                              [MAX_ID], [MAX_ID + 1], [float(MAX_ID)], [str(MAX_ID + 1)]]
    for p in lists:
        try:
            want: list[int] | None = vllm.validate_python(p)
        except ValidationError:
            want = None
        if want is not None and max(want) > MAX_ID:  # vLLM's validation takes it; the router's ids are 4 bytes
            want = None
        try:
            got = _ids(p, "prompt")
        except ProxyError:
            got = None
        assert got == want, p
