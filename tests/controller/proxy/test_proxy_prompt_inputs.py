"""The ids the proxy routes by are the ones the worker prefills, for the request fields that change the prompt:
`truncate_prompt_tokens` (the worker keeps the prompt's last k tokens) and a chat's `documents` (rendered by the
template, but not a field of vLLM's /tokenize). A route's WARM claim is checked against what the worker itself
reports cached (usage.prompt_tokens_details.cached_tokens)."""

from __future__ import annotations

import json
from typing import Any

from support.proxy_fleet import BLOCK, MODEL, Fleet, until

TEXT = " ".join(f"word{i} is here." for i in range(60))  # 240 ids: 15 blocks
DOCS = [{"title": "Lisbon", "text": "Lisbon is the capital of Portugal. " * 6}]


async def _send(fleet: Fleet, path: str, body: dict[str, Any]) -> tuple[str, str, int, int, int]:
    """(worker, verdict, matched, cached, prompt_tokens) of one request, once its new blocks reached the controller."""
    before = {w: await fleet.blocks_known(w) for w in fleet.sims}
    held = {w: len(s.engine.cache) for w, s in fleet.sims.items()}
    status, h, raw = await fleet.post(path, {"model": MODEL, "max_tokens": 4, **body})
    assert status == 200, raw
    usage = json.loads(raw)["usage"]
    worker, prompt, cached = h["x-kvfleet-worker"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    # the hashes the worker stored for the first time (a fully cached prompt's last block is stored again, as vLLM
    # recomputes it, but its hash was known already)
    new = len(fleet.sims[worker].engine.cache) - held[worker]
    await until(lambda: fleet.blocks_known(worker), lambda n: n >= before[worker] + new)
    return worker, h["x-kvfleet-verdict"], int(h["x-kvfleet-matched-tokens"]), cached, prompt


async def test_a_truncated_prompt_is_routed_by_the_tokens_the_worker_keeps(fleet: Fleet) -> None:
    w, verdict, _, _, full = await _send(fleet, "/v1/completions", {"prompt": TEXT})
    assert verdict == "COLD" and full == 240
    # the same prompt, truncated to its last 64 tokens: nothing of it is cached anywhere (its first block differs)
    w1, verdict, matched, cached, n = await _send(fleet, "/v1/completions", {"prompt": TEXT, "truncate_prompt_tokens": 64})
    print("truncated, first:", w1, verdict, matched, cached, n)
    assert n == 64 and cached == 0
    assert matched == cached  # NOTE: before the fix: WARM on w, 240 matched (the whole untruncated prompt), 0 cached
    # sent again: the worker that prefilled it holds its 4 blocks, and the route says so
    w2, verdict, matched, cached, n = await _send(fleet, "/v1/completions", {"prompt": TEXT, "truncate_prompt_tokens": 64})
    print("truncated, again:", w2, verdict, matched, cached, n)
    # (vLLM hits at most prompt - 1 tokens: a fully cached prompt of whole blocks computes its last block again)
    assert (w2, verdict, matched, cached) == (w1, "WARM", 64, 64 - BLOCK)
    # control: the untruncated prompt is still warm on its first worker, and so is -1's (it fits the context length)
    w3, verdict, matched, cached, _ = await _send(fleet, "/v1/completions", {"prompt": TEXT})
    assert (w3, verdict, matched, cached) == (w, "WARM", 240, 240 - BLOCK)
    w4, verdict, matched, cached, _ = await _send(fleet, "/v1/completions", {"prompt": TEXT, "truncate_prompt_tokens": -1})
    assert (w4, verdict, matched, cached) == (w, "WARM", 240, 240 - BLOCK)


async def test_a_truncation_the_worker_refuses_is_routed_by_load_and_answered_by_the_worker(fleet: Fleet) -> None:
    await _send(fleet, "/v1/completions", {"prompt": TEXT})
    for bad in (-2, "sixty-four", 1.5):
        status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": TEXT,
                                                             "truncate_prompt_tokens": bad})
        assert status == 400 and "truncate_prompt_tokens" in json.loads(raw)["error"]["message"], raw
        assert (h["x-kvfleet-verdict"], h["x-kvfleet-matched-tokens"]) == ("COLD", "0")  # no claim on its prefix


async def test_a_truncated_chat_is_routed_by_the_tokens_the_worker_keeps(fleet: Fleet) -> None:
    msgs = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Plan a trip."}]
    w, _, _, _, full = await _send(fleet, "/v1/chat/completions", {"messages": msgs})
    body = {"messages": msgs, "truncate_prompt_tokens": full - 40}
    w1, verdict, matched, cached, n = await _send(fleet, "/v1/chat/completions", body)
    print("chat truncated, first:", w1, verdict, matched, cached, n)
    assert n == full - 40 and cached == 0 and matched == cached
    w2, verdict, matched, cached, _ = await _send(fleet, "/v1/chat/completions", body)
    assert (w2, verdict) == (w1, "WARM") and matched == cached == (n // BLOCK) * BLOCK


async def test_chat_documents_are_rendered_for_routing_as_the_worker_renders_them(fleet: Fleet) -> None:
    msgs = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Where should I go?"}]
    w, verdict, _, _, plain = await _send(fleet, "/v1/chat/completions", {"messages": msgs})
    assert verdict == "COLD"
    # the documents come first in the rendered prompt: nothing of the plain conversation's blocks is its prefix
    w1, verdict, matched, cached, n = await _send(fleet, "/v1/chat/completions", {"messages": msgs, "documents": DOCS})
    print("documents, first:", w1, verdict, matched, cached, n)
    assert n > plain and cached == 0
    assert matched == cached  # NOTE: before the fix: WARM on w with the plain conversation's blocks, 0 cached
    w2, verdict, matched, cached, _ = await _send(fleet, "/v1/chat/completions", {"messages": msgs, "documents": DOCS})
    assert (w2, verdict) == (w1, "WARM") and matched == cached == (n // BLOCK) * BLOCK


async def test_chat_template_options_the_proxy_passes_route_warm_exactly(fleet: Fleet) -> None:
    """Control: options vLLM's /tokenize takes (continue_final_message, add_generation_prompt, chat_template_kwargs)
    were already passed; a resend is WARM by exactly what the worker reuses."""
    msgs = [{"role": "system", "content": TEXT}, {"role": "assistant", "content": "Day one: the castle and"}]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False,
            "chat_template_kwargs": {"documents": DOCS}}
    w1, _, _, _, n = await _send(fleet, "/v1/chat/completions", body)
    w2, verdict, matched, cached, _ = await _send(fleet, "/v1/chat/completions", body)
    assert (w2, verdict) == (w1, "WARM") and matched == cached == (n // BLOCK) * BLOCK


async def test_a_media_part_for_a_text_only_model_is_the_workers_400(fleet: Fleet) -> None:
    """The stand-in serves a text-only model, as vLLM refuses media there; the proxy claims nothing for it."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    status, _, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs})
    assert status == 400 and "text-only" in json.loads(raw)["error"]["message"], raw
    assert not any(s.path == "/v1/chat/completions" for sim in fleet.sims.values() for s in sim.seen)  # type: ignore[attr-defined]


async def test_a_request_for_its_prompts_logprobs_claims_no_cache_and_the_stand_in_reads_none(fleet: Fleet) -> None:
    """vLLM prefills the whole prompt of a request asking for its prompt's logprobs (SamplingParams'
    skip_reading_prefix_cache): `prompt_logprobs`, a completion's `echo` with `logprobs`, a chat's `echo` (its
    `top_logprobs` is 0 when left out). The proxy routes it by load alone, with no cached tokens claimed; before, it
    was claimed WARM on the holder of its prefix for all of it (and the stand-in reused its cache for it)."""
    msgs = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Plan a trip."}]
    _, _, _, _, full = await _send(fleet, "/v1/completions", {"prompt": TEXT})
    _, _, _, _, chat_full = await _send(fleet, "/v1/chat/completions", {"messages": msgs})
    cases = [("/v1/completions", {"prompt": TEXT, "prompt_logprobs": 1}),
             ("/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 1}),
             ("/v1/chat/completions", {"messages": msgs, "prompt_logprobs": 0}),
             ("/v1/chat/completions", {"messages": msgs, "echo": "true"})]
    for path, body in cases:  # (their blocks are all held already: nothing new to wait for, as _send does)
        status, h, raw = await fleet.post(path, {"model": MODEL, "max_tokens": 4, **body})
        assert status == 200, raw
        verdict, matched = h["x-kvfleet-verdict"], int(h["x-kvfleet-matched-tokens"])
        cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(path, sorted(body)[-1], verdict, matched, cached)
        assert (verdict, matched, cached) == ("COLD", 0, 0), body
    # control: without them (an echo without logprobs, a chat whose top_logprobs is null), WARM, as cached
    for path, body, n in [("/v1/completions", {"prompt": TEXT, "echo": True}, full),
                          ("/v1/chat/completions", {"messages": msgs, "echo": True, "top_logprobs": None}, chat_full)]:
        got, verdict, matched, cached, _ = await _send(fleet, path, body)
        # the route claims every whole block; vLLM hits at most prompt - 1 tokens (a fully cached prompt of whole
        # blocks computes its last block again)
        # NOTE: on the first holder, or on a worker a request above (routed by load, prefilled whole) left the prompt
        # on: each holds all of it, so either is right (a run saw w1 chosen where w2 held it first, 2 in 10)
        assert (verdict, matched) == ("WARM", n // BLOCK * BLOCK), (got, body)
        assert cached == (n - 1) // BLOCK * BLOCK, body
