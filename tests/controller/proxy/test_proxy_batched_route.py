"""A batched completions request (`prompt` a list of prompts) is routed by all of its prompts: vLLM runs each prompt
of a batch as its own engine request, with its own prefix-cache hit, on the worker the batch goes to. So the batch
goes where the whole of it is warmest, and the controller records every prompt as placed there (its demand ledger's
conversations, the rank's block-pool shadow). Before, the proxy sent the first prompt alone: a batch whose later
prompts were warm on one worker went by its cold first prompt, and the ledgers knew nothing of the later prompts."""

from __future__ import annotations

import json
from typing import Any

from support.proxy_fleet import BLOCK, MODEL, Fleet, until

from controller.batch_route import MAX_BATCH_PROMPTS
from controller.demand import Conversation
from fleet.api.kvfleet.v1 import route_pb2
from fleet.core.block_hash import external_chain

WARM = " ".join(f"warm{i} is here." for i in range(60))  # 240 ids: 15 blocks
COLD = " ".join(f"cold{i} is new." for i in range(40))
OTHER = " ".join(f"other{i} is apart." for i in range(40))


async def _post(fleet: Fleet, prompt: Any, fresh: int) -> tuple[str, str, int, dict[str, Any]]:
    """(worker, verdict, matched, usage) of one completion, once the `fresh` new blocks the worker stored for it
    reached the controller (KV events arrive asynchronously)."""
    before = {w: await fleet.blocks_known(w) for w in fleet.sims}
    status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert status == 200, raw
    worker, usage = h["x-kvfleet-worker"], json.loads(raw)["usage"]
    await until(lambda: fleet.blocks_known(worker), lambda n: n >= before[worker] + fresh)
    return worker, h["x-kvfleet-verdict"], int(h["x-kvfleet-matched-tokens"]), usage


def _blocks(ids: list[int]) -> int:
    return len(ids) // BLOCK


async def _ids(fleet: Fleet, text: str) -> list[int]:
    sim = next(iter(fleet.sims.values()))
    async with fleet.http.post(sim.url + "/tokenize", json={"model": MODEL, "prompt": text}) as r:
        return list((await r.json())["tokens"])


def _conversation(fleet: Fleet, ids: list[int]) -> Conversation | None:
    """The controller's demand-ledger record of the conversation whose prompt `ids` is (tenant acme's), or None."""
    router = fleet.ctl.ctx.router
    assert router is not None
    v = next(iter(router._workers.values())).view()
    assert v.hash_cfg is not None
    chain = external_chain(v.hash_cfg, ids, lora=None, cache_salt=fleet.ctl.ctx.auth.cache_salt("acme"))
    prev = router.demand.previous(chain)
    return prev[1] if prev is not None and prev[0] == chain[-1] else None


async def test_a_batch_goes_where_its_later_prompts_are_warm(fleet: Fleet) -> None:
    cold, warm, other = [await _ids(fleet, t) for t in (COLD, WARM, OTHER)]
    holder, verdict, _, _ = await _post(fleet, WARM, _blocks(warm))
    assert verdict == "COLD" and len(warm) == 240
    # the first prompt is cold everywhere; the second is warm on `holder` alone
    worker, verdict, matched, usage = await _post(fleet, [COLD, WARM], _blocks(cold))
    print("batch:", worker, verdict, matched, usage, "holder:", holder)
    # NOTE: before the fix: routed by COLD alone, to a worker holding fewer blocks than `holder` (the tie-break), COLD
    assert (worker, verdict, matched) == (holder, "WARM", 240)
    # the worker reused the second prompt (vLLM reports a non-streamed batch's last prompt's cached tokens), all but
    # its last block: vLLM hits at most prompt - 1 tokens, so a fully cached prompt of whole blocks computes it again
    assert usage["prompt_tokens_details"]["cached_tokens"] == 240 - BLOCK
    # control: a batch whose prompts are cold everywhere claims nothing
    _, verdict, matched, _ = await _post(fleet, [OTHER, OTHER + " too"], _blocks(other))
    assert (verdict, matched) == ("COLD", 0)


async def test_after_a_batch_its_second_prompt_follows_up_warm_where_the_batch_went(fleet: Fleet) -> None:
    first, second = await _ids(fleet, COLD), await _ids(fleet, WARM)
    worker, verdict, _, _ = await _post(fleet, [first, second], _blocks(first) + _blocks(second))  # ids: no /tokenize
    assert verdict == "COLD"
    # the controller's working set holds the second prompt's conversation where the batch went
    conv = _conversation(fleet, second)
    print("after the batch:", worker, conv)
    assert conv is not None and conv.key == (worker, 0) and conv.num_blocks == _blocks(second)  # NOTE: None before
    follow = second + await _ids(fleet, " And then some more words to make a block or two of a new turn.")
    w2, verdict, matched, usage = await _post(fleet, follow, _blocks(follow) - _blocks(second))
    print("follow-up:", w2, verdict, matched, usage)
    assert (w2, verdict, matched) == (worker, "WARM", _blocks(second) * BLOCK)
    assert usage["prompt_tokens_details"]["cached_tokens"] == matched
    conv = _conversation(fleet, follow)
    # its next turn, not a new conversation (NOTE: before the fix, turns == 1: the ledger had no record of the batch's)
    assert conv is not None and conv.key == (worker, 0) and conv.turns == 2


async def test_a_batch_of_one_routes_as_its_prompt_alone(fleet: Fleet) -> None:
    warm = await _ids(fleet, WARM)
    holder, _, _, _ = await _post(fleet, WARM, _blocks(warm))
    alone = await _post(fleet, WARM, 0)
    one = await _post(fleet, [WARM], 0)
    assert alone[:3] == one[:3] == (holder, "WARM", 240)
    conv = _conversation(fleet, warm)
    assert conv is not None and conv.key == (holder, 0) and conv.turns == 3


async def test_a_route_with_no_batch_is_unchanged(fleet: Fleet) -> None:
    """An old proxy's Route (no `batch`) is routed by its ids alone, as before; the field's absence is a batch of one."""
    ids = await _ids(fleet, WARM)
    holder, _, _, _ = await _post(fleet, WARM, _blocks(ids))
    control, token = fleet.proxy.control, fleet.tokens["a"]
    assert not route_pb2.RouteRequest(token_ids=ids, model=MODEL).batch
    plain = await control.route(ids, MODEL, lora=None, token=token)
    assert (plain.worker, plain.verdict, plain.matched_tokens) == (holder, "WARM", 240)
    with_cold = await control.route(await _ids(fleet, COLD), MODEL, lora=None, token=token, batch=[ids])
    assert (with_cold.worker, with_cold.verdict, with_cold.matched_tokens) == (holder, "WARM", 240)
    for d in (plain, with_cold):
        control.release_soon(d.route_id, token)


async def test_a_batch_over_the_route_token_limit_is_routed_by_its_leading_prompts_that_fit(fleet: Fleet) -> None:
    """vLLM takes a batch whose prompts each fit the model, however many tokens they make together; --max-route-tokens
    bounds a Route, not a request. NOTE: before, the controller refused the whole Route and the proxy answered 400
    ("route of N tokens is over the controller's limit") for a batch vLLM runs."""
    cold, warm, other = [await _ids(fleet, t) for t in (COLD, WARM, OTHER)]
    holder, _, _, _ = await _post(fleet, WARM, _blocks(warm))
    fleet.ctl.ctx.max_route_tokens = len(cold) + len(warm) + len(other) - 1  # the first two fit, the third does not
    status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": [COLD, WARM, OTHER],
                                                          "max_tokens": 2})
    assert status == 200, raw
    assert len(json.loads(raw)["choices"]) == 3  # sent whole
    assert (h["x-kvfleet-worker"], h["x-kvfleet-verdict"], h["x-kvfleet-matched-tokens"]) == (holder, "WARM", "240")
    # control: a first prompt over the limit alone is still refused, as a single prompt is
    fleet.ctl.ctx.max_route_tokens = len(cold) - 1
    status, _, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": [COLD, WARM], "max_tokens": 2})
    assert status == 400 and b"--max-route-tokens" in raw, raw


async def test_a_route_past_the_batch_bound_is_routed_by_its_first_prompts(fleet: Fleet) -> None:
    """A Route's batch is looked at up to MAX_BATCH_PROMPTS prompts (one route's work on the controller's event loop,
    which every tenant shares, is bounded); the prompts past it are not refused, and not counted. NOTE: before, a
    Route over the bound was refused InvalidArgument, so a client with a larger bound than the controller's got no
    route at all."""
    cold, warm = await _ids(fleet, COLD), await _ids(fleet, WARM)
    holder, _, _, _ = await _post(fleet, WARM, _blocks(warm))
    control, token = fleet.proxy.control, fleet.tokens["a"]
    inside = [cold] * (MAX_BATCH_PROMPTS - 2) + [warm]  # the warm prompt is the last one looked at
    d = await control.route(cold, MODEL, lora=None, token=token, batch=inside + [warm] * 5)
    assert (d.worker, d.verdict, d.matched_tokens) == (holder, "WARM", 240)  # one warm prompt counted, not six
    control.release_soon(d.route_id, token)
    # control: the warm prompt just past the bound is not looked at
    d = await control.route(cold, MODEL, lora=None, token=token, batch=[cold] * (MAX_BATCH_PROMPTS - 1) + [warm])
    assert (d.verdict, d.matched_tokens) == ("COLD", 0)
    control.release_soon(d.route_id, token)
