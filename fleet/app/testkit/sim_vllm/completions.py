"""/v1/completions and /v1/chat/completions of the stand-in, with vLLM 0.33.0's bodies (SSE or not).

Clocked (time_scale > 0): the answer waits for the modelled steps, and a stream sends each token as
the step that made it ends. Headers go out with the first token (a queued request sends nothing),
and a client that leaves frees its slot. Instant (time_scale 0): everything at once, as before.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from fleet.app.testkit.sim_vllm import prompts
from fleet.app.testkit.sim_vllm import tokenizer as tok
from fleet.app.testkit.sim_vllm.engine import EnginePaused, EngineRestarted, SimEngineConfig
from fleet.app.testkit.sim_vllm.parts import Sim
from fleet.core.errors import InvalidArgument

if TYPE_CHECKING:
    from fleet.app.testkit.sim_vllm.loop import Ticket


def _j(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def _unavailable(msg: str) -> web.Response:
    return _j({"error": {"message": msg, "type": "ServiceUnavailableError", "code": 503}}, 503)


async def body_of(req: web.Request) -> dict[str, Any]:
    try:
        body = await req.json()
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidArgument("body must be a JSON object")
    return body


def unknown_model(c: SimEngineConfig, model: Any) -> web.Response | None:
    """vLLM's 404 for a model it does not serve (None: it serves it, under one of its names or as a LoRA adapter)."""
    if model in c.names or model in c.loras:
        return None
    return _j({"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "code": 404}}, 404)


def _prompt_ids(body: dict[str, Any], chat: bool, max_model_len: int) -> list[int]:
    """What the engine prefills: the rendered chat or the prompt, truncated as the request asks (prompts.py)."""
    if chat:
        ids = prompts.chat_ids(body)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = list(p)
        else:
            ids = tok.tokenize(p)
    ids = prompts.truncated(ids, body, chat, max_model_len)
    if not ids:  # NOTE: vLLM refuses an empty prompt
        raise InvalidArgument("The decoder prompt cannot be empty")
    return ids


@dataclass(slots=True)
class _Reply:
    """One response's fixed parts: what it is, its prompt and its (deterministic) output ids."""

    model: str
    chat: bool
    ids: list[int]
    out: list[int]
    rid: str = ""
    created: int = 0

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self, n: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": len(self.ids),
            "completion_tokens": n,
            "total_tokens": len(self.ids) + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def body(self, n: int, fin: str, cached: int) -> dict[str, Any]:
        text = tok.detokenize(self.out[:n])
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fin}
            if self.chat
            else {"index": 0, "text": text, "finish_reason": fin}
        )
        return {
            "id": self.rid,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(n, cached),
        }

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {
            "id": self.rid,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return f"data: {json.dumps({**chunk, **extra})}\n\n".encode()

    def _piece(self, i: int | None, fin: str | None) -> bytes:
        piece = tok.detokenize([self.out[i]]) if i is not None else ""
        choice = (
            {"index": 0, "delta": {"content": piece}, "finish_reason": fin}
            if self.chat
            else {"index": 0, "text": piece, "finish_reason": fin}
        )
        return self._chunk([choice])

    async def write_tokens(self, resp: web.StreamResponse, start: int, end: int, fin: str | None) -> None:
        """One chunk per token out[start:end]; the last carries `fin` (an empty chunk if none is new)."""
        for i in range(start, end):
            await resp.write(self._piece(i, fin if i == end - 1 else None))
        if fin is not None and start == end:
            await resp.write(self._piece(None, fin))

    async def write_end(self, resp: web.StreamResponse, n: int, cached: int) -> None:
        await resp.write(self._chunk([], usage=self.usage(n, cached)) + b"data: [DONE]\n\n")
        await resp.write_eof()


async def _prepare(req: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(req)
    return resp


async def completions(sim: Sim, req: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await body_of(req)
    sim.received.add(req.path, await req.text(), body)
    c = sim.cfg.engine
    model = body.get("model") or c.names[0]  # NOTE: vLLM fills in its first served name
    refused = unknown_model(c, model)
    if refused is not None:
        return refused
    model = model if model in c.loras else c.names[0]  # what vLLM answers with: the adapter, or its first name
    ids = _prompt_ids(body, chat, c.max_model_len)
    n = int(body.get("max_tokens") or 16)
    if n < 1:
        raise InvalidArgument(f"max_tokens must be at least 1, got {n}")
    kw: dict[str, Any] = {
        "lora": model if model in c.loras else None,
        "cache_salt": body.get("cache_salt"),
        "report_full": (body.get("extra_args") or {}).get("kv_cache_report_mode") == "full",
    }
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgument(f"priority must be an integer, got {priority!r}")
    if priority != 0 and c.scheduling_policy != "priority":  # NOTE: vLLM's own check and words
        raise InvalidArgument(f"Got priority {priority} but Priority scheduling is not enabled.")
    reply = _Reply(model, chat, ids, tok.synthetic_output(ids, n), created=int(time.time()))
    if sim.loop is None:  # instant: every request runs at once, alone; there is no queue to order
        return await _instant(sim, req, reply, bool(body.get("stream")), kw)
    try:
        ticket = sim.loop.submit(ids, n, priority=priority, **kw)
    except EnginePaused as e:
        return _unavailable(str(e))
    reply.rid = f"cmpl-{ticket.seq.seq_id}"
    try:
        return await _clocked(req, reply, bool(body.get("stream")), ticket)
    finally:
        sim.loop.release(ticket)  # NOTE: also on cancellation (client gone): frees the slot


async def _instant(
    sim: Sim, req: web.Request, reply: _Reply, stream: bool, kw: dict[str, Any]
) -> web.StreamResponse:
    n = len(reply.out)
    try:
        res = await sim.engine.run(reply.ids, max_tokens=n, **kw)
    except (EnginePaused, EngineRestarted) as e:
        return _unavailable(str(e))
    reply.rid = f"cmpl-{sim.engine.queries}"
    if not stream:
        return _j(reply.body(n, "length", res.num_cached_tokens))
    resp = await _prepare(req)
    await reply.write_tokens(resp, 0, n, "length")
    await reply.write_end(resp, n, res.num_cached_tokens)
    return resp


async def _clocked(req: web.Request, reply: _Reply, stream: bool, t: Ticket) -> web.StreamResponse:
    o = await t.next()
    if not stream:
        while o.finish_reason is None:
            o = await t.next()
    if o.finish_reason == "restart":
        return _unavailable("engine restarted while the request waited")
    cached = max(t.seq.num_cached_tokens, 0)
    if not stream:
        return _j(reply.body(o.num_output, o.finish_reason or "length", cached))
    resp = await _prepare(req)
    sent = 0
    while True:
        await reply.write_tokens(resp, sent, o.num_output, o.finish_reason)
        sent = o.num_output
        if o.finish_reason is not None:
            break
        o = await t.next()
        if o.finish_reason == "restart":  # a restarted process drops its connections
            if req.transport is not None:
                req.transport.close()
            return resp
    await reply.write_end(resp, sent, cached)
    return resp
