"""A routed request (POST /v1/completions, /v1/chat/completions and the routes by load alone), from its body to the
worker's answer: what is withheld of it, its token ids, its route, its forwarding and the x-kvfleet-* headers on
the answer relayed (controller/proxy/app.py `Handlers._complete` admits it first)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from controller.batch_route import within
from controller.proxy import lineage, prefill, responses
from controller.proxy.batch_prompts import ROUTE_TOKENS, batch_ids
from controller.proxy.reading import client_salt, read_json, upstream_headers
from controller.proxy.relay import relay
from controller.proxy.tokenize import EncodedBody
from fleet.core.lax import reads_prefix_cache

if TYPE_CHECKING:
    from controller.proxy.quarantine import Hit
    from controller.proxy.server import Proxy
    from controller.proxy.targets import Target

MAX_LISTED_BYTES = 2048  # of a header listing what was withheld; the body's `kvfleet` field lists it all
CHAT, COMPLETION, BY_LOAD = "chat", "completion", "by_load"  # the kinds of routed request (Handlers._complete)


def listed(headers: dict[str, str], name: str, items: list[str]) -> None:
    """`name`: the items, comma-separated, as many as fit MAX_LISTED_BYTES; `name`-count: how many there are.
    NOTE: unbounded, 130 withheld results made a header over aiohttp's 8,190-byte limit (the client could not
    read the answer at all) and 1,100 one over http.client's 65,536."""
    shown: list[str] = []
    size = 0
    for item in items:
        size += len(item) + (1 if shown else 0)
        if size > MAX_LISTED_BYTES:
            break
        shown.append(item)
    headers[name] = ",".join(shown)
    headers[f"{name}-count"] = str(len(items))


def kvfleet_headers(t: Target, num_sends: int, hits: list[Hit]) -> dict[str, str]:
    """The x-kvfleet-* headers of an answer the worker of `t` gave after `num_sends` sends, less `hits`."""
    extra = {
        "x-kvfleet-worker": t.worker,
        "x-kvfleet-verdict": t.verdict,
        "x-kvfleet-matched-tokens": str(t.matched_tokens),
        "x-kvfleet-epoch": str(t.epoch),
        "x-kvfleet-attempts": str(num_sends),
    }
    if refs := list(dict.fromkeys(h.ref for h in hits if h.ref)):
        listed(extra, "x-kvfleet-quarantined", refs)
    if media := [h.where for h in hits if h.source == "media"]:
        listed(extra, "x-kvfleet-withheld-media", media)
    return extra


async def prompt_of(p: Proxy, body: dict[str, Any], kind: str, base: str, tenant: str, token: str | None,
                    path: str = "") -> tuple[dict[str, Any], list[Hit], EncodedBody, Sequence[int], list[Sequence[int]]]:
    """(the body to forward, what was withheld of it, its encoder, the ids to route it by, a batched completions
    request's later prompts' ids). A request routed by load alone has no ids; of those, a /v1/responses request's
    tool outputs are judged (responses.judged)."""
    if kind == BY_LOAD:
        hits: list[Hit] = []
        if path == "/v1/responses":
            body, hits = await responses.judged(p, body, tenant, token)
        return body, hits, EncodedBody(body), [], []
    chat = kind == CHAT
    # NOTE: before tokenizing: what is tokenized, routed and forwarded is the body without quarantined bytes
    body, hits = await p.enforcer.enforce(body, chat, tenant, token)
    if not reads_prefix_cache(body, chat):  # vLLM prefills it whole, whatever a worker holds: routed by load alone
        return body, hits, EncodedBody(body), [], []
    # NOTE: the ids the worker keeps under truncate_prompt_tokens, which /tokenize does not apply
    k = prefill.kept(body, chat, lambda: p.directory.max_model_len(body["model"]))
    enc = EncodedBody(body)  # NOTE: the messages (or prompt) are encoded once, for /tokenize and the worker
    ids = await p.tokenizer.token_ids(body, chat, base, tenant, enc)
    tok = p.tokenizer
    later = await batch_ids(tok.ids_of, tok.batch_lanes, body, chat, base, tenant)  # each truncated as the first
    ids, later = prefill.prefilled(ids, body, k), [prefill.prefilled(b, body, k) for b in later]
    return body, hits, enc, ids, later[:within(len(ids), later, ROUTE_TOKENS)]  # batch_prompts.ROUTE_TOKENS


async def answer(p: Proxy, req: web.Request, kind: str, t0: float, token: str | None, tenant: str,
                 shrink: Callable[[int], None]) -> web.StreamResponse:
    """A routed request's answer: read and tokenize its body, route it, forward it to the worker chosen (moving
    the route where the forwarder fails over), relay the worker's answer, and release the route however it ends."""
    body = await read_json(req, p.cfg.client_body_timeout_s)
    shrink(len(await req.read()))  # NOTE: a chunked body reserved --max-body-bytes until its size was known
    base, lora, body["model"] = p.directory.resolve(body.get("model"))  # a missing model is named, as vLLM does
    salt = client_salt(body)  # the client's own (400 where vLLM refuses it), before any worker is asked
    body, hits, enc, ids, later = await prompt_of(p, body, kind, base, tenant, token, req.path)
    responses_api = req.path == "/v1/responses"
    # NOTE: before any route: a follow-up whose stored conversation holds a result quarantined since is a 409
    chain = await lineage.follow_up(p, body, tenant, token) if responses_api else None
    released = lambda outcome: p.metrics.releases.labels(outcome).inc()  # noqa: E731
    d = await p.control.route(ids, base, lora=lora, token=token, client_salt=salt, batch=later, orphaned=released)
    p.directory.watch.routed(body["model"], {c.worker for c in d.candidates})  # (watch.py: waiters it left out)
    to = d  # where it is sent first (a stored response's holder)
    num_prompt = len(ids) + sum(map(len, later))
    del ids, later  # NOTE: about 9x the body's bytes (Python ints); an answer may stream for minutes
    try:
        if responses_api and (prev := responses.valid_id(body.get("previous_response_id"))):
            # NOTE: inside the try: a client gone during the lookup still releases the route
            to = await responses.to_holder(p, d, tenant, prev, base, upstream_headers(req))
        fwd = (
            {**body, "cache_salt": d.cache_salt} if d.cache_salt else body
        )  # NOTE: the controller's salt always wins: the tenant's, or its derivation with the client's own
        fair = p.fair.claim(tenant, to.worker) if p.fair is not None else contextlib.nullcontext(None)
        with fair as priority:  # the tenant's place in the worker's queue, not the client's (controller/proxy/fair.py)
            if p.fair is not None:
                fwd = p.fair.body(fwd, priority)
            on = [d.worker]  # where the controller's ledger has the route now

            async def moved(t: Target) -> bool:  # skipped or failed over: the controller's ledger and shadow follow
                if not d.route_id or t.worker == on[0]:  # NOTE: told before the send, not at the first byte:
                    return True  # the block-pool shadow must know what the worker runs before the next turn's route
                rank = next((c.dp_rank for c in d.candidates if c.worker == t.worker), p.directory.first_rank(t.worker))
                if not await p.control.move(d.route_id, t.worker, rank, token):
                    return False  # not serving now
                on[0] = t.worker
                return True

            opened = await p.forwarder.open(req.path, enc.encode(fwd), to, base, upstream_headers(req), moved,
                                             body["model"])
            if p.fair is not None and priority and await p.fair.refused(opened):
                opened.resp.close()   # a worker without the priority policy: the same request without one
                fwd = p.fair.body(fwd, None)
                opened = await p.forwarder.open(req.path, enc.encode(fwd), to, base, upstream_headers(req), moved,
                                             body["model"])
            t = opened.target
            if responses_api and opened.resp.status == 200 and (rid := responses.response_id(opened.first)):
                p.responses.pin(tenant, rid, t.worker)
                if chain is not None:
                    p.lineage.add(tenant, rid, chain)
            note = {"quarantined": [h.as_json() for h in hits]} if hits else None
            out, t_first = await relay(req, opened, kvfleet_headers(t, opened.num_sends, hits), p.metrics, note)
            record(p, t, opened.resp.status, num_prompt, (t_first - t0) - (opened.t_first - opened.t_sent))
            return out
    finally:  # answered, failed, or the client went away (cancelled): the worker's in-flight load ends
        if d.route_id:
            p.control.release_soon(d.route_id, token, released)


def record(p: Proxy, t: Any, status: int, num_prompt: int, added_s: float) -> None:
    m = p.metrics
    m.requests.labels(t.worker, t.verdict, str(status)).inc()
    m.matched_tokens.labels(t.worker, t.verdict).inc(t.matched_tokens)
    m.prompt_tokens.labels(t.worker, t.verdict).inc(num_prompt)
    m.added_latency.labels(t.worker, t.verdict).observe(max(added_s, 0.0))
