"""A completions prompt's /tokenize requests, and the ids of a batched prompt's later prompts.

A batched completions prompt (a list of prompts) is tokenized prompt by prompt (vLLM's /tokenize takes one): the
first as any prompt (tokenize.tokenize_request), the others (batch_ids) one call per distinct prompt the cache does
not hold, BATCH_TOKENIZE_AT_ONCE at a time per tenant (Tokenizer.batch_lanes), each cached as a prompt of its own;
the route carries them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any

import msgspec

from controller.batch_route import MAX_BATCH_PROMPTS
from controller.edge import DEFAULT_MAX_ROUTE_TOKENS
from controller.keyed_slots import KeyedSlots
from controller.proxy.errors import ProxyError
from fleet.core.lax import lax_token_ids

# a batch's prompts tokenized at once (vLLM's /tokenize takes one prompt: one call per distinct prompt not cached)
BATCH_TOKENIZE_AT_ONCE = 8
# NOTE: the most tokens of a batch's prompts a Route carries: the controller's default --max-route-tokens, which keeps
# the Route within its default --grpc-max-receive-bytes (4 MiB: about 3 bytes an id). The later prompts past it are
# left out of the route (batch_route.within; a controller with a lower limit leaves out more), the batch sent whole.
ROUTE_TOKENS = DEFAULT_MAX_ROUTE_TOKENS
# vLLM's `list[Annotated[int, Field(ge=0)]]`, below 2**32: every id the router takes (its ids are 4 bytes)
MAX_ID = (1 << 32) - 1
TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]]
SHAPES = "'prompt' must be a string, a list of token ids, or a list of those"
# Tokenizer.ids_of: (one /tokenize request or its ids, the body, the registered model, the tenant) -> the ids
IdsOf = Callable[[dict[str, Any] | list[int], dict[str, Any], str, str], Awaitable[Sequence[int]]]


def _ids(p: Any, where: str) -> list[int] | None:
    """`p` as token ids (a non-empty list of what vLLM reads as ids, fleet.core.lax.lax_token_ids), else None.

    NOTE: msgspec checks and copies the list in C: 1M ids take about 10 ms where a Python loop took 110 ms on
    the proxy's one event loop (the project machine, one process), which every tenant's requests share. Only a list
    it refuses is read id by id, as vLLM's pydantic reads it: 1000.0, "1000" and true are ids (1000, 1000, 1).
    NOTE: such a list was the proxy's 400 where vLLM serves it (a client holding its ids as floats: JavaScript,
    numpy); 1000.5, "a" or -1 is still a 400, now naming the element (`where`: the prompt's place in the body).

    Raises:
        ProxyError: a list with an element vLLM does not read as a token id (400).
    """
    if not isinstance(p, list) or not p:
        return None
    try:
        return msgspec.convert(p, TOKEN_IDS, strict=True)
    except msgspec.ValidationError:
        pass
    try:  # NOTE: numbers only (no bool, no string), then msgspec's lax int: its whole floats are pydantic's
        msgspec.convert(p, list[float], strict=True)
        return msgspec.convert(p, TOKEN_IDS, strict=False)  # 100k floats: about 5 ms, 42 in the loop below
    except msgspec.ValidationError:
        pass
    try:
        ids = lax_token_ids(p)
    except ValueError as e:
        raise ProxyError(400, f"{SHAPES}: {where}{e}", where) from None
    # NOTE: an id of 2**32 or more passed here and was refused by the route's packing, a 400 naming no element
    if (top := max(ids)) > MAX_ID:
        raise ProxyError(400, f"{SHAPES}: {where}[{ids.index(top)}] is {top}, over the largest token id the router "
                              f"takes ({MAX_ID})", where)
    return ids


def batch_of(p: Any) -> list[Any] | None:
    """A completions `prompt` that is a batch (a non-empty list of prompts: all strings, or all lists of ids), else
    None. NOTE: as vLLM's union reads it: a list mixing strings and numbers is one prompt of ids (["12", 7]: 12, 7),
    which the first element's type alone called a batch of strings (the proxy's 400, vLLM's 200)."""
    if not isinstance(p, list) or not p:
        return None
    return p if all(isinstance(q, str) for q in p) or all(isinstance(q, list) for q in p) else None


def prompt_request(body: dict[str, Any], p: Any, where: str = "prompt") -> dict[str, Any] | list[int]:
    """One completions prompt's /tokenize body, or its ids when it is ids already. `where`: its place in the body
    (prompt, or prompt[i] of a batch)."""
    ids = _ids(p, where)
    if ids is not None:
        return ids
    if p == []:  # NOTE: named as a shape error, which a list of token-id lists holding an empty one is not (review)
        raise ProxyError(400, "The decoder prompt cannot be empty: 'prompt' (or a prompt of its batch) is an empty "
                              "list of token ids; send at least one id", "prompt")
    if not isinstance(p, str):
        raise ProxyError(400, SHAPES, "prompt")
    out: dict[str, Any] = {"model": body["model"], "prompt": p}
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


def batch_requests(body: dict[str, Any], chat: bool) -> list[dict[str, Any] | list[int]]:
    """A batched completions request's later prompts (after the first: tokenize.tokenize_request), as it gives
    the first: routed with it, at most batch_route.MAX_BATCH_PROMPTS prompts in all (a larger batch is routed by its
    first ones, and sent whole). [] for anything else."""
    p = None if chat else batch_of(body.get("prompt"))
    return [] if p is None else [prompt_request(body, q, f"prompt[{i}]")
                                 for i, q in enumerate(p[1:MAX_BATCH_PROMPTS], 1)]


async def batch_ids(ids_of: IdsOf, lanes: KeyedSlots, body: dict[str, Any], chat: bool, base: str,
                    tenant: str) -> list[Sequence[int]]:
    """The ids of a batched completions request's later prompts (batch_requests; [] when it is no batch): one
    /tokenize per distinct prompt the cache does not hold, each in one of the
    tenant's `lanes` (at most BATCH_TOKENIZE_AT_ONCE of them: all of the tenant's batches share them).

    NOTE: the bound was per request: a tenant's batches in flight ran 8 calls each at once, as many as it sent
    batches, on the workers' API servers that every tenant's /tokenize shares (3 batches: 24 calls;
    tests/controller/proxy/test_proxy_batch_tokenize_lanes.py)."""
    reqs = batch_requests(body, chat)
    if not reqs:
        return []
    # NOTE: the /tokenize bodies differ by their prompt alone
    # NOTE: all at once, the tenant's lanes bounding how many run (it went in chunks of BATCH_TOKENIZE_AT_ONCE as
    # well: a second bound on the same calls, and each chunk waited for its slowest call before the next began)
    todo = {r["prompt"]: r for r in reqs if isinstance(r, dict)}
    tasks = [asyncio.ensure_future(_in_lane(lanes, ids_of, r, body, base, tenant)) for r in todo.values()]
    try:
        got = dict(zip(todo, await asyncio.gather(*tasks), strict=True))
    except BaseException:  # NOTE: one failed (the request's error), or the client went away: the rest stop
        for t in tasks:
            t.cancel()
        raise
    return [r if isinstance(r, list) else got[r["prompt"]] for r in reqs]


async def _in_lane(lanes: KeyedSlots, ids_of: IdsOf, req: dict[str, Any], body: dict[str, Any], base: str,
                   tenant: str) -> Sequence[int]:
    async with lanes.hold(tenant, None, "a batch's /tokenize"):
        return await ids_of(req, body, base, tenant)
