"""vLLM's stored responses behind the proxy: which worker holds each one.

vLLM keeps a stored response (`/v1/responses`, `store: true`) in the memory of the API server that answered it. A
follow-up naming it (`previous_response_id`), GET /v1/responses/{id} and POST /v1/responses/{id}/cancel are answered
by that server only; any other answers 404 "Response with id '...' not found.". So the proxy pins every response id
a tenant was answered to the worker that answered it (`ResponsePins`, read off the answer's first bytes), and sends
these requests there. A pin it does not have (the proxy restarted, or another replica answered the first request)
is found by asking the model's workers, MAX_ASKED at a time, for the response (GET, which reads it and changes
nothing; a sleeping vLLM's API server answers it too); an id no worker holds is remembered as such for MISS_S.

A response id is what vLLM makes it, a capability: `resp_` and 128 random bits. Whoever holds one can read and
continue that response, on vLLM alone as through the proxy; the pins are kept per tenant so that one tenant's
answers never push out another's, and a lookup is only ever for an id the caller sent. The ids no worker held are
remembered the same way: past their bound, the tenant that sent the most loses its oldest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from controller.owned import OwnedLru
from controller.proxy.errors import ProxyError
from controller.proxy.forward import Opened
from controller.proxy.quarantine import Hit
from controller.proxy.reading import upstream_headers
from controller.proxy.relay import relay
from controller.proxy.targets import Target
from fleet.core.route_types import COLD, RouteDecision

if TYPE_CHECKING:
    from controller.proxy.server import Proxy

log = logging.getLogger("kvfleet.proxy")

# NOTE: the answer's first "id" is the response's: vLLM serialises ResponsesResponse with `id` first, and a stream's
# first event is response.created, whose `response` object starts with it
_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,128})"')
_VALID = re.compile(r"resp_[A-Za-z0-9_\-]{1,128}")
MAX_SCANNED = 64 << 10  # of the answer's first bytes
MAX_ASKED = 16  # workers asked at once for a response no pin names
MISS_S = 5.0  # how long an id no worker held is answered 404 without asking again (an unknown id cost every worker a GET)


def response_id(first: bytes) -> str | None:
    """The response id an answer of /v1/responses begins with, or None."""
    m = _ID.search(first, 0, MAX_SCANNED)
    return m.group(1).decode() if m else None


def valid_id(rid: object) -> str | None:
    """`rid` if it is shaped as vLLM's response ids are (anything else is never looked up), else None."""
    return rid if isinstance(rid, str) and _VALID.fullmatch(rid) else None


class ResponsePins:
    """Response id -> the worker that answered it, per tenant: at most `per_tenant` ids each, least recently used
    first out, and at most `max_tenants` tenants, the least recently active leaving with its pins (about 160 bytes a
    pin: 40 MiB at most with the defaults). An id no worker held is kept apart (`missed`) for `miss_s`: at most
    4 x `per_tenant` of them, all tenants together; past that, the tenant holding the most loses its oldest.
    NOTE: they were one queue, oldest out first: one tenant's stream of made-up ids pushed out every other tenant's,
    whose next request for its own unknown id cost every worker a GET again (tests/controller/proxy/test_proxy_responses.py)."""

    def __init__(self, per_tenant: int = 1024, max_tenants: int = 256, miss_s: float = MISS_S) -> None:
        self.per_tenant, self.max_tenants, self.miss_s = per_tenant, max_tenants, miss_s
        self._pins: OrderedDict[str, OrderedDict[str, str]] = OrderedDict()
        self._misses: OwnedLru[tuple[str, str], float] = OwnedLru(per_tenant * 4)  # (tenant, id) -> when, by tenant

    def missed(self, tenant: str, rid: str, now: float, seen: bool = False) -> bool:
        """Whether no worker held `rid` for the tenant within `miss_s`; `seen`: none did just now (remember it)."""
        key = (tenant, rid)
        if seen:
            self._misses.put(key, tenant, now)
            return True
        when = self._misses.get(key)
        if when is not None and now - when >= self.miss_s:
            self._misses.pop(key)  # NOTE: one aged out and never asked for again stays, its tenant's, until the bound
            return False
        return when is not None

    def num_misses(self) -> int:
        return len(self._misses)

    def pin(self, tenant: str, rid: str, worker: str) -> None:
        pins = self._pins.get(tenant)
        if pins is None:
            pins = self._pins[tenant] = OrderedDict()
            if len(self._pins) > self.max_tenants:
                self._pins.popitem(last=False)
        self._pins.move_to_end(tenant)
        pins[rid] = worker
        pins.move_to_end(rid)
        if len(pins) > self.per_tenant:
            pins.popitem(last=False)

    def get(self, tenant: str, rid: str) -> str | None:
        pins = self._pins.get(tenant)
        w = pins.get(rid) if pins is not None else None
        if w is not None:
            assert pins is not None
            pins.move_to_end(rid)
            self._pins.move_to_end(tenant)  # a tenant reading its pins is active too
        return w

    def forget_worker(self, worker: str) -> None:
        """The worker left the fleet (or restarted): what it stored is gone with its memory."""
        for pins in self._pins.values():
            for rid in [r for r, w in pins.items() if w == worker]:
                del pins[rid]

    def __len__(self) -> int:
        return sum(len(p) for p in self._pins.values())


async def holder(p: Proxy, tenant: str, rid: str, base: str | None, headers: dict[str, str]) -> str | None:
    """The worker holding response `rid`: the tenant's pin, else the first of the model's workers (`base` None: of
    any model; MAX_ASKED at a time) that answers GET /v1/responses/{rid} with 200, pinned then. None: none does
    (remembered for MISS_S; the request then goes where it is routed, and vLLM answers its 404)."""
    w = p.responses.get(tenant, rid)
    if w is not None and p.directory.get(w) is not None:
        return w
    if p.responses.missed(tenant, rid, time.monotonic()):
        return None
    ws = sorted((w for w in p.directory.workers.values() if base is None or w.model == base), key=lambda w: w.name)
    timeout = aiohttp.ClientTimeout(total=p.cfg.tokenize_timeout_s, sock_connect=p.cfg.connect_timeout_s)

    async def ask(name: str, url: str) -> bool:
        try:
            async with p.http.get(f"{url.rstrip('/')}/v1/responses/{rid}", headers=headers, timeout=timeout) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError) as e:  # NOTE: the id is a capability: not logged
            log.info("proxy: asking worker %s for a stored response failed: %s: %s", name, type(e).__name__, e)
            return False

    for k in range(0, len(ws), MAX_ASKED):
        batch = ws[k:k + MAX_ASKED]
        found = await asyncio.gather(*(ask(w.name, w.url) for w in batch))
        for w_info, ok in zip(batch, found, strict=True):
            if ok:
                p.responses.pin(tenant, rid, w_info.name)
                return w_info.name
    p.responses.missed(tenant, rid, time.monotonic(), seen=True)
    return None


async def to_holder(p: Proxy, d: RouteDecision, tenant: str, rid: str, base: str,
                    headers: dict[str, str]) -> RouteDecision:
    """The decision `d` sent first to the worker holding response `rid` (as COLD: the proxy cannot compute the ids of
    a conversation only that worker holds); `d` itself when no worker is known to hold it, or it is `d`'s."""
    w = await holder(p, tenant, rid, base, headers)
    info = p.directory.get(w) if w is not None else None
    if info is None or w == d.worker:
        return d
    rank = next((c.dp_rank for c in d.candidates if c.worker == w), p.directory.first_rank(info.name))
    epoch = next((r.epoch for r in info.ranks if r.dp_rank == rank), 0)
    return d._replace(worker=info.name, url=info.url, dp_rank=rank, verdict=COLD, matched_tokens=0, epoch=epoch)


async def send_on(p: Proxy, req: web.Request, tenant: str, data: bytes) -> web.StreamResponse:
    """GET /v1/responses/{id} or POST /v1/responses/{id}/cancel, sent to the worker holding the response and its
    answer relayed as it comes (a resumed stream too); a 404 in vLLM's words when none holds it."""
    rid = valid_id(req.match_info["response_id"])
    headers = upstream_headers(req)
    w = await holder(p, tenant, rid, None, headers) if rid is not None else None
    info = p.directory.get(w) if w is not None else None
    if info is None:  # vLLM's own words and type (NOTE: the type was the proxy's NotFoundError; review finding)
        raise ProxyError(404, f"Response with id '{req.match_info['response_id'][:200]}' not found.", "response_id",
                         "invalid_request_error")
    epoch = max((r.epoch for r in info.ranks), default=0)
    t_sent = time.perf_counter()
    try:
        resp = await p.http.request(req.method, info.url.rstrip("/") + req.path_qs, data=data or None, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=p.cfg.connect_timeout_s))
        try:
            first = await resp.content.readany()
        except BaseException:
            resp.close()
            raise
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        log.warning("proxy: a stored response's %s on worker %s failed: %s: %s", req.method, info.name,
                    type(e).__name__, e)  # NOTE: not its path: the id is a capability
        raise ProxyError(503, "the worker holding the response did not answer; retry shortly") from None
    opened = Opened(Target(info.name, info.url, COLD, 0, epoch), resp, first, t_sent, time.perf_counter(), 1, ())
    out, _ = await relay(req, opened, {"x-kvfleet-worker": info.name}, p.metrics)
    return out


# the Responses API's input items that carry a tool's output (their `output`: a string or a list of content parts)
TOOL_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output", "computer_call_output",
                          "local_shell_call_output", "mcp_call_output"})
_MESSAGES_AT = re.compile(r"messages\[(\d+)\]\.(?:content|tool_calls\[0\]\.function\.arguments)")
# NOTE: the model's own words in items other than messages, which vLLM renders as an assistant's (its tool calls'
# arguments, a custom tool's input, its reasoning): shown to the quote search as assistant messages, after the rest
_SAID = {"function_call": ("arguments",), "custom_tool_call": ("input",), "reasoning": ("content", "summary")}


def _said(field: str, value: Any) -> dict[str, Any]:
    if field == "arguments":
        return {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": value}}]}
    return {"role": "assistant", "content": value}


def _value(m: dict[str, Any], field: str) -> Any:
    return m["tool_calls"][0]["function"]["arguments"] if field == "arguments" else m.get("content")


def as_chat(body: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[int, str]]] | None:
    """A /v1/responses body's `input` as a chat body the Enforcer reads (controller/proxy/quarantine.py): each tool
    output item a `tool` message, each message item (user, system, developer, assistant) a message, in order, then
    what the model wrote in other items (_SAID) as assistant messages; and, per message, the item and field it came
    from. None: no item carries a tool's output (a string `input`)."""
    items = body.get("input")
    if not isinstance(items, list):
        return None
    msgs: list[dict[str, Any]] = []
    came: list[tuple[int, str]] = []
    said: list[tuple[int, str]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        # NOTE: a type that is not a string (an object, a list) is no item vLLM reads (its 400); looked up in the sets
        # below it was the proxy's 500 (unhashable), found by scripts/fuzz_proxy.py
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            continue
        if kind in TOOL_OUTPUTS:
            msgs.append({"role": "tool", "content": item.get("output")})
            came.append((i, "output"))
        elif kind == "message" and isinstance(item.get("role"), str):
            msgs.append({"role": item["role"], "content": item.get("content")})
            came.append((i, "content"))
        elif kind in _SAID:
            said += [(i, f) for f in _SAID[kind] if item.get(f) is not None]
    if not any(m["role"] == "tool" for m in msgs):
        return None
    msgs += [_said(f, items[i][f]) for i, f in said]
    return {"messages": msgs}, came + said


def chat_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """`as_chat`'s chat alone (None: no tool output)."""
    chat = as_chat(body)
    return None if chat is None else chat[0]


async def judged(p: Proxy, body: dict[str, Any], tenant: str, token: str | None) -> tuple[dict[str, Any], list[Hit]]:
    """A /v1/responses body's tool outputs judged as a chat's tool messages are (each alone, a turn's together,
    assistant messages quoting a withheld one), with the tenant's policy applied to the items they came from; the
    places named are the request's own (`input[7].output`). NOTE: before, a Responses client's tool outputs (the
    OpenAI Agents SDK sends them as function_call_output items) reached the worker unjudged."""
    chat = as_chat(body)
    if chat is None:
        return body, []
    shown, came = chat

    def where(text: str) -> str:
        return _MESSAGES_AT.sub(lambda m: f"input[{came[int(m.group(1))][0]}].{came[int(m.group(1))][1]}", text)

    try:
        out, hits = await p.enforcer.enforce(shown, True, tenant, token)
    except ProxyError as e:
        raise ProxyError(e.status, where(e.message), where(e.param) if e.param else e.param) from None
    if not hits:
        return body, []
    items = list(body["input"])
    for (i, field), old, new in zip(came, shown["messages"], out["messages"], strict=True):
        if _value(new, field) is not _value(old, field):
            items[i] = {**items[i], field: _value(new, field)}
    return {**body, "input": items}, [dataclasses.replace(h, where=where(h.where), reasons=tuple(map(where, h.reasons)))
                                       for h in hits]
