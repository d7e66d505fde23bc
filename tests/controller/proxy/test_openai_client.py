"""The official `openai` client (sync and async) against the proxy: every answer parses with the SDK's own types,
streams end cleanly with their usage where it was asked for, errors raise the exception class their status implies
with the proxy's message, and the SDK's retries do what the status says.

Real controller, proxy and `kvfleet sim-vllm` stand-ins (tests/support/proxy_fleet.py); `openai` comes with the
`dev` extra, so an ImportError here is a failure. What the stand-in answers is its own (vLLM's shapes); what is
checked is what the proxy does to it on the way.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import openai
from aiohttp import web
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion
from support.dying_worker import die_after
from support.proxy_fleet import LONG_CONTEXT, MODEL, Fleet, served, start_fleet, until

KIB = 1 << 10
USER = [{"role": "user", "content": "Summarise the release notes in one line."}]
# a tool call and its result, as the SDK's users send them (assistant content null beside its tool_calls)
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny, 21 C"}]}]
CHUNK = (b'data: {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "sim-model", '
         b'"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]}\n\n')


def _breaks_off(sim: Any) -> Any:
    """A stand-in that, asked with X-Request-Id "break-whole" or "break-mid", sends one chat chunk (and, mid, the
    first part of the next) and dies."""

    @web.middleware
    async def middleware(req: web.Request, handler: Any) -> web.StreamResponse:
        cue = req.headers.get("X-Request-Id", "")
        if cue not in ("break-whole", "break-mid"):
            return await handler(req)  # type: ignore[no-any-return]
        return await die_after(req, {"Content-Type": "text/event-stream"},
                               CHUNK + (CHUNK[:40] if cue == "break-mid" else b""))

    return middleware


def _clients(fleet: Fleet, who: str = "a", **kw: Any) -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    kw = {"base_url": fleet.proxy.url + "/v1", "api_key": fleet.tokens.get(who, who), "max_retries": 0, **kw}
    return openai.OpenAI(**kw), openai.AsyncOpenAI(**kw)


def _retries(e: openai.APIStatusError) -> int:
    """How many times the SDK retried before it raised `e` (its own header on the last request)."""
    return int(e.response.request.headers.get("x-stainless-retry-count", "0"))


def _answers_sync(c: openai.OpenAI) -> None:
    assert [m.id for m in c.models.list()] == [MODEL]
    chat = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert isinstance(chat, ChatCompletion) and chat.usage is not None and chat.usage.completion_tokens == 4
    with c.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, stream=True,
                                   stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    assert all(isinstance(ch, ChatCompletionChunk) for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chat.choices[0].message.content and text.startswith(chat.choices[0].message.content)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    one = c.completions.create(model=MODEL, prompt="hello there", max_tokens=3)
    ids = c.completions.create(model=MODEL, prompt=[101, 202, 303], max_tokens=3)
    batch = c.completions.create(model=MODEL, prompt=["first prompt", "second prompt"], max_tokens=3, n=2)
    assert all(isinstance(x, Completion) for x in (one, ids, batch))
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert ids.usage is not None and ids.usage.prompt_tokens == 3  # the ids as sent
    tools = c.chat.completions.create(model=MODEL, messages=TOOL_TURNS, tools=TOOLS, tool_choice="auto",
                                      max_completion_tokens=3)
    assert tools.choices[0].finish_reason == "length"
    first = c.responses.create(model=MODEL, input="Where is my order?", max_output_tokens=4)
    second = c.responses.create(model=MODEL, input="And when?", previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id and second.output_text
    assert c.responses.retrieve(first.id).id == first.id


async def _answers_async(c: openai.AsyncOpenAI, fleet: Fleet) -> None:
    stream = await c.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=3, stream=True,
                                        stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices) == [0, 0, 0, 1, 1, 1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    chat = await c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, n=2)
    assert [ch.index for ch in chat.choices] == [0, 1]
    stream = await c.chat.completions.create(model=MODEL, messages=USER, max_tokens=100_000, stream=True)
    async for _ in stream:
        break
    await stream.close()  # the client leaves: the worker's request ends with it
    chats = [s for sim in fleet.sims.values() for s in served(sim, "/v1/chat/completions")]
    # NOTE: the worker's request ends either way the client's leaving reaches it: its handler cancelled, or its next
    # write to the closed connection refused (ClientConnectionResetError: seen once in a fresh-clone CI run)
    ended = {"CancelledError", "ClientConnectionResetError"}
    await until(lambda: _now([s.outcome for s in chats]), lambda outcomes: bool(ended & set(outcomes)))


async def _now(x: Any) -> Any:
    return x


async def test_every_answer_parses_with_the_sdk_types(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw=LONG_CONTEXT)
    try:
        sync, aio = _clients(fleet)
        await asyncio.to_thread(_answers_sync, sync)
        await _answers_async(aio, fleet)
    finally:
        await fleet.stop()


async def _raised(call: Any) -> openai.APIStatusError:
    try:
        await call
    except openai.APIStatusError as e:
        return e
    raise AssertionError("no error raised")


async def test_errors_raise_the_class_their_status_implies_with_the_proxys_message(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=LONG_CONTEXT, max_body_bytes=200 * KIB,
                              max_inflight_bytes_per_tenant=256 * KIB, max_inflight_bytes=1 << 20)
    try:
        sync, aio = _clients(fleet)
        no_role: Any = [{"content": "no role"}]
        e = await _raised(aio.chat.completions.create(model=MODEL, messages=no_role))  # the worker's 400
        assert isinstance(e, openai.BadRequestError) and "'role'" in e.message and e.type == "BadRequestError"
        e = await _raised(aio.chat.completions.create(model=7, messages=USER))  # type: ignore[arg-type]
        assert isinstance(e, openai.BadRequestError) and "model" in e.message  # the proxy's own 400
        e = await _raised(aio.chat.completions.create(model="no-such-model", messages=USER))
        assert isinstance(e, openai.NotFoundError) and e.param == "model" and "no-such-model" in e.message
        e = await _raised(aio.responses.retrieve("resp_unknown"))
        assert isinstance(e, openai.NotFoundError) and "not found" in e.message
        bad_sync, bad_aio = _clients(fleet, who="not-a-token", max_retries=2)
        e = await _raised(bad_aio.models.list())
        assert isinstance(e, openai.AuthenticationError) and "invalid bearer token" in e.message and _retries(e) == 0
        sync_e = await _raised(asyncio.to_thread(bad_sync.completions.create, model=MODEL, prompt="x"))
        assert isinstance(sync_e, openai.AuthenticationError) and sync_e.body == e.body
        assert isinstance(e.body, dict) and e.body["message"] in e.message and e.body["code"] == 401
        await _rate_limited_then_served(fleet)
        await _quarantined_chain_is_not_retried(fleet, aio)
        await _no_serving_worker_is_retried_after_retry_after(fleet)
    finally:
        await fleet.stop()


async def _rate_limited_then_served(fleet: Fleet) -> None:
    """Two streams the client does not read hold 2 x 90 KiB of acme's 256 KiB of bodies in flight: a third body of
    90 KiB is a 429 with Retry-After, which the SDK waits out; once the streams are closed its retry is served."""
    _, aio = _clients(fleet)
    big = [{"role": "user", "content": "x" * (90 * KIB)}]  # NOTE: one word, one token: its KV fits the stand-in
    held = [await aio.chat.completions.create(model=MODEL, messages=big, max_tokens=100_000, stream=True)
            for _ in range(2)]
    refused: list[float] = []

    async def on_response(r: Any) -> None:
        if r.status_code == 429:
            refused.append(time.monotonic())
            for s in held:
                await s.close()  # the client leaves its streams: their bodies leave the budget

    try:
        e = await _raised(aio.chat.completions.create(model=MODEL, messages=big, max_tokens=2))
        assert isinstance(e, openai.RateLimitError) and "--max-inflight-bytes-per-tenant" in e.message
        assert "controller" not in e.message  # NOTE: the proxy's own budget was said as the controller's refusal
        assert e.response.headers["retry-after"] == "1"
        hooked = openai.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]})
        retrying = openai.AsyncOpenAI(base_url=fleet.proxy.url + "/v1", api_key=fleet.tokens["a"], max_retries=5,
                                      http_client=hooked)
        answer = await retrying.chat.completions.create(model=MODEL, messages=big, max_tokens=2)
    finally:
        for s in held:
            await s.close()
    print(f"a 90 KiB request beside two held streams: {len(refused)} x 429, then served "
          f"{time.monotonic() - refused[0]:.2f} s after the first")
    assert answer.choices and refused
    assert time.monotonic() - refused[0] >= 1.0  # the SDK waited out Retry-After (its own first backoff: <= 0.5 s)


async def _quarantined_chain_is_not_retried(fleet: Fleet, aio: openai.AsyncOpenAI) -> None:
    """A follow-up whose stored conversation carries a tool output quarantined since is a 409 (docs/proxy.md): the
    client must resend the conversation, so the SDK (which retries a 409 by default) is told not to retry it."""
    output = "Order 4412 shipped on 3 March via DHL, tracking JD014600006512345678."
    first = await aio.responses.create(model=MODEL, max_output_tokens=4, input=[
        {"role": "user", "content": "Where is my order?"},
        {"type": "function_call", "call_id": "call_1", "name": "order_status", "arguments": '{"id": 4412}'},
        {"type": "function_call_output", "call_id": "call_1", "output": output}])
    await fleet.op.set_verdict(hashlib.sha256(output.encode()).hexdigest(), "QUARANTINED", reasons=["operator"])
    retrying = aio.with_options(max_retries=2)
    e = await _raised(retrying.responses.create(model=MODEL, input="Thanks!", previous_response_id=first.id))
    print(f"409 after {_retries(e)} retries: {e.message[:120]}")
    assert isinstance(e, openai.ConflictError) and e.param == "previous_response_id" and "quarantined" in e.message
    assert _retries(e) == 0  # NOTE: before, 2: the same refusal three times, each asking the controller again


async def _no_serving_worker_is_retried_after_retry_after(fleet: Fleet) -> None:
    """Every worker asleep: 503 with Retry-After: 1; the SDK retries it after that second, and raises the class of
    its status with the proxy's words once its retries are spent."""
    for name in fleet.sims:
        await fleet.op.lifecycle(name, "sleep", level=1)
    try:
        _, aio = _clients(fleet, max_retries=1)
        t0 = time.monotonic()
        e = await _raised(aio.chat.completions.create(model=MODEL, messages=USER))
        took = time.monotonic() - t0
        print(f"503 after {_retries(e)} retry in {took:.2f} s: {e.message[:120]}")
        assert isinstance(e, openai.InternalServerError) and e.status_code == 503 and "no serving worker" in e.message
        assert e.response.headers["retry-after"] == "1" and _retries(e) == 1 and took >= 1.0
    finally:
        for name in fleet.sims:
            await fleet.op.lifecycle(name, "wake_up")


async def test_a_stream_the_worker_breaks_off_raises_the_sdks_api_error(tmp_path: Path) -> None:
    """The worker dies mid-stream: the client gets the chunks sent so far, then the proxy's error event, which the
    SDK raises as an APIError with its body, as it raises vLLM's own error event. Also when the worker died inside
    an event: that event's first part is not relayed.
    NOTE: it was (the relay passed bytes on as they came), and the error event read as its continuation: the SDK
    raised json.JSONDecodeError, not an openai error; straight from the worker it raised APIConnectionError."""
    fleet = await start_fleet(tmp_path, num_workers=1, worker_middleware=_breaks_off)
    try:
        sync, aio = _clients(fleet)
        for cue in ("break-whole", "break-mid"):
            got: list[str | None] = []
            try:
                stream = await aio.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                           extra_headers={"X-Request-Id": cue})
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content)
                raise AssertionError("the stream ended without an error")
            except openai.APIError as e:
                print(f"{cue}: {got} then {type(e).__name__}: {e.message}")
                assert got == ["a"] and isinstance(e.body, dict) and e.body["code"] == 502
                assert "broke off its answer" in e.message and not isinstance(e, openai.APIStatusError)

        def read_sync() -> list[str | None]:
            with sync.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                              extra_headers={"X-Request-Id": "break-mid"}) as stream:
                return [chunk.choices[0].delta.content for chunk in stream]

        try:
            await asyncio.to_thread(read_sync)
            raise AssertionError("the stream ended without an error")
        except openai.APIError as e:
            assert e.body is not None and "broke off its answer" in e.message
        chat = await aio.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)  # control: it answers
        assert chat.choices[0].message.content
    finally:
        await fleet.stop()
