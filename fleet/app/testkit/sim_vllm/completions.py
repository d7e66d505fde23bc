"""/v1/completions and /v1/chat/completions of the stand-in, with vLLM 0.33.0's bodies (SSE or not).

Clocked (time_scale > 0): the answer waits for the modelled steps, and a stream sends each token as
the step that made it ends. Headers go out with the first token (a queued request sends nothing),
and a client that leaves frees its slot. Instant (time_scale 0): everything at once, as before.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from fleet.app.testkit.sim_vllm import context, prompts
from fleet.app.testkit.sim_vllm import tokenizer as tok
from fleet.app.testkit.sim_vllm.config import EnginePaused, EngineRestarted, SimEngineConfig
from fleet.app.testkit.sim_vllm.parts import Sim
from fleet.core.errors import InvalidArgument
from fleet.core.lax import lax_bool, reads_prefix_cache, stream_of

if TYPE_CHECKING:
    from fleet.app.testkit.sim_vllm.loop import Ticket
    from fleet.app.testkit.sim_vllm.sched import Output


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
    if "stream" in body:
        try:
            body["stream"] = stream_of(body)   # as vLLM's request models read it (a 400 where they refuse it)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
    return body


def unknown_model(c: SimEngineConfig, model: Any) -> web.Response | None:
    """vLLM's 404 for a model it does not serve (None: it serves it, under one of its names or as a LoRA adapter)."""
    if model in c.names or model in c.loras:
        return None
    return _j({"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "code": 404}}, 404)


def _prompts(body: dict[str, Any], chat: bool, max_model_len: int) -> tuple[list[list[int]], int | None]:
    """What the engine prefills, per prompt: the rendered chat, or each prompt of the completion (a batch has
    several), truncated as the request asks (prompts.py); and the output tokens asked for (None: none named).
    Every prompt is checked against the context length (context.py) before any of them runs."""
    out = context.check_output(body, chat, max_model_len)
    each = [prompts.chat_ids(body)] if chat else prompts.completion_prompts(body.get("prompt"))
    ids = [prompts.truncated(p, body, chat, max_model_len) for p in each]
    if not all(ids):  # NOTE: vLLM refuses an empty prompt
        raise InvalidArgument("The decoder prompt cannot be empty")
    for p in ids:
        context.check_prompt(len(p), out, max_model_len)
    return ids, out


@dataclass(slots=True)
class _Seq:
    """One engine request of the answer: choice `index` (prompt i's j-th of n is i * n + j), its prompt and its
    (deterministic) output ids."""

    index: int
    ids: list[int]
    out: list[int]


@dataclass(slots=True)
class _Reply:
    """One response's fixed parts: what it is, its sequences (one per prompt x n) and its prompts."""

    model: str
    chat: bool
    seqs: list[_Seq]
    prompts: list[list[int]]
    rid: str = ""
    created: int = 0
    continuous: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage in every chunk
    usage_chunk: bool = True  # stream_options.include_usage: the stream ends with a usage chunk (no choices)

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self, outs: list[int], cached: int) -> dict[str, Any]:
        """As vLLM sums it: each prompt's tokens once (not n times), every sequence's output tokens."""
        p, c = sum(len(ids) for ids in self.prompts), sum(outs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def body(self, outs: list[int], fins: list[str], cached: int) -> dict[str, Any]:
        choices = []
        for s, n, fin in zip(self.seqs, outs, fins, strict=True):
            text = tok.detokenize(s.out[:n])
            choices.append({"index": s.index, "message": {"role": "assistant", "content": text}, "finish_reason": fin}
                           if self.chat else {"index": s.index, "text": text, "finish_reason": fin})
        return {"id": self.rid, "object": self.kind, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(outs, cached)}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return f"data: {json.dumps({**chunk, **extra})}\n\n".encode()

    def _piece(self, s: _Seq, i: int | None, fin: str | None, done: int) -> bytes:
        """`s`'s chunk of output id `i` (None: none, the finish alone); `done`: its output ids sent with it."""
        piece = tok.detokenize([s.out[i]]) if i is not None else ""
        choice = ({"index": s.index, "delta": {"content": piece}, "finish_reason": fin} if self.chat
                  else {"index": s.index, "text": piece, "finish_reason": fin})
        if not self.continuous:
            return self._chunk([choice])
        # NOTE: as vLLM's continuous usage: the chunk's own sequence, its prompt and its output so far
        return self._chunk([choice], usage={"prompt_tokens": len(s.ids), "completion_tokens": done,
                                            "total_tokens": len(s.ids) + done})

    async def write_tokens(self, resp: web.StreamResponse, s: _Seq, start: int, end: int, fin: str | None) -> None:
        """One chunk per token out[start:end] of `s`; the last carries `fin` (an empty chunk if none is new)."""
        for i in range(start, end):
            await resp.write(self._piece(s, i, fin if i == end - 1 else None, i + 1))
        if fin is not None and start == end:
            await resp.write(self._piece(s, None, fin, end))

    async def write_end(self, resp: web.StreamResponse, outs: list[int], cached: int) -> None:
        # NOTE: as vLLM, the usage chunk only where stream_options asks for it: it was sent on every stream
        usage = self._chunk([], usage=self.usage(outs, cached)) if self.usage_chunk else b""
        await resp.write(usage + b"data: [DONE]\n\n")
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
    each, out = _prompts(body, chat, c.max_model_len)
    k = prompts.num_choices(body)
    if out is not None and out < 1:
        raise InvalidArgument(f"max_tokens must be at least 1, got {out}")
    extra = body.get("extra_args") or {}
    if not isinstance(extra, dict):  # NOTE: vLLM's `dict[str, Any] | None` (its 400); .get on it was the stand-in's 500
        raise InvalidArgument(f"extra_args must be an object, got {type(extra).__name__}")
    kw: dict[str, Any] = {
        "lora": model if model in c.loras else None,
        "cache_salt": body.get("cache_salt"),
        "report_full": extra.get("kv_cache_report_mode") == "full",
        "skip_cache": not reads_prefix_cache(body, chat),
    }
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgument(f"priority must be an integer, got {priority!r}")
    if priority != 0 and c.scheduling_policy != "priority":  # NOTE: vLLM's own check and words
        raise InvalidArgument(f"Got priority {priority} but Priority scheduling is not enabled.")
    # NOTE: as vLLM: every prompt of a batch is its own engine request, and so is each of its n sequences
    seqs = [_Seq(i * k + j, ids, tok.synthetic_output(ids, context.output_len(out, len(ids), c.max_model_len)))
            for i, ids in enumerate(each) for j in range(k)]
    reply = _Reply(model, chat, seqs, each, created=int(time.time()), continuous=_continuous(body),
                   usage_chunk=_include_usage(body))
    if sim.loop is None:  # instant: every request runs at once, alone; there is no queue to order
        return await _instant(sim, req, reply, stream_of(body), kw)
    tickets: list[Ticket] = []
    try:
        try:
            for s in seqs:
                tickets.append(sim.loop.submit(s.ids, len(s.out), priority=priority, **kw))
        except EnginePaused as e:
            return _unavailable(str(e))
        reply.rid = f"cmpl-{tickets[0].seq.seq_id}"
        return await _clocked(req, reply, stream_of(body), tickets)
    finally:
        for t in tickets:
            sim.loop.release(t)  # NOTE: also on cancellation (client gone): frees the slots


def _include_usage(body: dict[str, Any]) -> bool:
    """Whether vLLM ends the stream with a usage chunk: stream_options given, with include_usage true (its default
    there, as vLLM's StreamOptions has it); no stream_options, no usage chunk."""
    so = body.get("stream_options")
    return isinstance(so, dict) and lax_bool(so.get("include_usage", True)) is True


def _continuous(body: dict[str, Any]) -> bool:
    """Whether vLLM puts usage in every chunk of the stream: stream_options' continuous_usage_stats, with its
    include_usage."""
    so = body.get("stream_options")
    return _include_usage(body) and isinstance(so, dict) and lax_bool(so.get("continuous_usage_stats")) is True


async def _instant(
    sim: Sim, req: web.Request, reply: _Reply, stream: bool, kw: dict[str, Any]
) -> web.StreamResponse:
    cached = []
    for s in reply.seqs:
        try:
            res = await sim.engine.run(s.ids, max_tokens=len(s.out), **kw)
        except (EnginePaused, EngineRestarted) as e:
            return _unavailable(str(e))
        cached.append(res.num_cached_tokens)
    reply.rid = f"cmpl-{sim.engine.queries}"
    outs = [len(s.out) for s in reply.seqs]
    if not stream:  # NOTE: vLLM's answer reports the last prompt's cached tokens, its stream the first's
        return _j(reply.body(outs, ["length"] * len(outs), cached[-1]))
    resp = await _prepare(req)
    for s in reply.seqs:
        await reply.write_tokens(resp, s, 0, len(s.out), "length")
    await reply.write_end(resp, outs, cached[0])
    return resp


async def _finished(t: Ticket) -> Output:
    o = await t.next()
    while o.finish_reason is None:
        o = await t.next()
    return o


async def _clocked(req: web.Request, reply: _Reply, stream: bool, tickets: list[Ticket]) -> web.StreamResponse:
    if not stream:
        done = await asyncio.gather(*(_finished(t) for t in tickets))
        if any(o.finish_reason == "restart" for o in done):
            return _unavailable("engine restarted while the request waited")
        return _j(reply.body([o.num_output for o in done], [o.finish_reason or "length" for o in done],
                             max(tickets[-1].seq.num_cached_tokens, 0)))
    merged: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()

    async def feed(i: int, t: Ticket) -> None:
        while True:
            o = await t.next()
            merged.put_nowait((i, o))
            if o.finish_reason is not None:
                return

    feeders = [asyncio.create_task(feed(i, t)) for i, t in enumerate(tickets)]
    try:
        i, o = await merged.get()  # NOTE: headers go out with the first token of any sequence
        if o.finish_reason == "restart":
            return _unavailable("engine restarted while the request waited")
        resp = await _prepare(req)
        sent, left = [0] * len(tickets), len(tickets)
        while True:
            if o.finish_reason == "restart":  # a restarted process drops its connections
                if req.transport is not None:
                    req.transport.close()
                return resp
            await reply.write_tokens(resp, reply.seqs[i], sent[i], o.num_output, o.finish_reason)
            sent[i] = o.num_output
            left -= o.finish_reason is not None
            if not left:
                break
            i, o = await merged.get()
        await reply.write_end(resp, sent, max(tickets[0].seq.num_cached_tokens, 0))
        return resp
    finally:
        for f in feeders:
            f.cancel()
