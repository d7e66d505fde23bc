"""The proxy reads a worker's answers strictly and boundedly: /tokenize gives vLLM's ids or a clear error,
/v1/models its cards or the model's own card.

A real aiohttp server on loopback answers as the test says; the proxy's Tokenizer (or WorkerDirectory) calls
it. An id that is not an integer (a float, a string) is a 502 naming the answer, never an id coerced with
int(). An answer longer than its bound is read no further.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from support.http_stub import serving

from controller.proxy.config import ProxyConfig
from controller.proxy.errors import ProxyError
from controller.proxy.tokenize import Tokenizer


class _Directory:
    def __init__(self, url: str) -> None:
        self.url = url

    def tokenizer_urls(self, base: str, listing: str | None = None) -> list[str]:
        return [self.url]


@asynccontextmanager
async def _worker(
    answer: bytes, status: int = 200, max_body_bytes: int = 8 << 20
) -> AsyncIterator[Callable[[], Awaitable[list[int]]]]:
    async def tokenize(_: web.Request) -> web.Response:
        return web.Response(body=answer, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    async with serving(app) as url, aiohttp.ClientSession() as http:
        directory = _Directory(url)  # the one method Tokenizer reads
        cfg = ProxyConfig(controller="127.0.0.1:1", max_body_bytes=max_body_bytes)
        tok = Tokenizer(cfg, directory, http)  # type: ignore[arg-type]
        yield lambda: tok.token_ids({"model": "m", "prompt": "hello"}, False, "m", "tenant-a")


async def test_vllm_answer_gives_its_ids() -> None:
    answer = b'{"count": 3, "max_model_len": 8, "tokens": [5, 6, 7], "token_strs": null}'
    async with _worker(answer) as ids:
        got = await ids()
    assert got == [5, 6, 7] and all(type(i) is int for i in got)


@pytest.mark.parametrize(
    "answer, why",
    [
        (b'{"tokens": [5, 6.5]}', "Expected `int`, got `float`"),
        (b'{"tokens": ["5"]}', "Expected `int`, got `str`"),
        (b'{"count": 1}', "missing required field `tokens`"),
        (b"not json", "not a list of token ids"),
    ],
)
async def test_an_answer_without_integer_ids_is_a_502(answer: bytes, why: str) -> None:
    async with _worker(answer) as ids:
        with pytest.raises(ProxyError) as e:
            await ids()
    assert (
        e.value.status == 502
        and "tokenize: the worker's answer is not a list of token ids" in e.value.message
    )
    assert why in e.value.message


async def test_a_refusal_keeps_the_workers_message() -> None:
    async with _worker(b'{"error": {"message": "prompt too long"}}', status=400) as ids:
        with pytest.raises(ProxyError) as e:
            await ids()
    assert (e.value.status, e.value.message) == (400, "tokenize: prompt too long")
    async with _worker(b"<html>bad gateway</html>", status=502) as ids:
        with pytest.raises(ProxyError) as e:
            await ids()
    assert e.value.status == 502 and "answered 502 with a body that is not JSON" in e.value.message


async def test_an_answer_longer_than_any_accepted_prompts_ids_is_a_502_read_no_further() -> None:
    # a prompt of n bytes has at most n ids of at most 8 bytes of JSON each: with 1 KiB bodies, 72 KiB at most
    ids = ", ".join(["7"] * 40_000).encode()
    async with _worker(b'{"tokens": [' + ids + b"]}", max_body_bytes=1024) as too_long:
        with pytest.raises(ProxyError) as e:
            await too_long()
    assert e.value.status == 502 and "over 73728 bytes" in e.value.message
    async with _worker(b'{"tokens": [' + ids + b"]}") as fits:  # control: the default 8 MiB bodies
        assert len(await fits()) == 40_000


async def test_a_models_answer_past_its_bound_is_read_no_further_and_the_worker_keeps_its_own_card() -> None:
    from controller.proxy.directory import MAX_MODELS_BYTES, WorkerDirectory
    from fleet.sdk.types import WorkerInfo

    cards = {"data": [{"id": "m", "root": "m"}, {"id": "m-lora", "root": "/adapters/x", "parent": "m"}]}
    padded = json.dumps(cards).encode()[:-1] + b', "pad": "' + b"x" * MAX_MODELS_BYTES + b'"}'
    seen = {}
    for name, body in (("ok", json.dumps(cards).encode()), ("huge", padded)):

        async def models(_: web.Request, body: bytes = body) -> web.Response:
            return web.Response(body=body, content_type="application/json")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        async with serving(app) as url, aiohttp.ClientSession() as http:
            d = WorkerDirectory(ProxyConfig(controller="127.0.0.1:1"), None, http)  # type: ignore[arg-type]
            await d._fetch_cards(WorkerInfo(name, url, "", "", "m", 1, 16, "sha256", None), 0.0)
            seen[name] = [c["id"] for c in d.cards[name]]
    assert seen == {
        "ok": ["m", "m-lora"],
        "huge": ["m"],
    }  # the control's cards; past the bound, the model's own


@pytest.mark.parametrize("data, kept", [
    ([1], ["m"]),  # before: kept as a card, and every request of every tenant was a 500 (int has no .get)
    ([{"id": 7}, {"root": "m"}, {"id": ""}], ["m"]),
    ([{"id": "m-lora", "parent": ["m"]}, {"id": "m-lora2", "parent": "m"}, "junk"], ["m-lora2"]),
    ([{"id": "m"}, {"id": "m-lora", "parent": "m"}], ["m", "m-lora"]),  # the control: valid cards are kept
])
async def test_model_cards_that_are_not_objects_with_a_string_id_are_ignored(data: list[object], kept: list[str]) -> None:
    from controller.proxy.directory import WorkerDirectory
    from fleet.sdk.types import WorkerInfo

    async def models(_: web.Request) -> web.Response:
        return web.Response(body=json.dumps({"data": data}).encode(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as url, aiohttp.ClientSession() as http:
        d = WorkerDirectory(ProxyConfig(controller="127.0.0.1:1"), None, http)  # type: ignore[arg-type]
        w = WorkerInfo("w", url, "", "", "m", 1, 16, "sha256", None)
        d.workers["w"] = w
        await d._fetch_cards(w, 0.0)
        assert [c["id"] for c in d.cards["w"]] == kept
        assert d.resolve(kept[0])[0] == "m"  # a request resolves (before: AttributeError, a 500)
