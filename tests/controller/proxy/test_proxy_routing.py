"""The turns of one conversation land on the worker holding its prefix; tenants never share warmth."""

from __future__ import annotations

import json
from pathlib import Path

from support.proxy_fleet import BLOCK, MODEL, Fleet, served, start_fleet, until

SYSTEM = "You are a careful assistant. " * 8


async def _turn(fleet: Fleet, messages: list[dict[str, str]], who: str = "a") -> tuple[dict[str, str], dict]:
    status, headers, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                                     "max_tokens": 8}, who)
    assert status == 200, raw
    return headers, json.loads(raw)


async def test_conversation_turns_land_warm_on_the_prefix_holder(fleet: Fleet) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan a trip to Lisbon."}]
    rows = []
    first_worker = None
    for turn in range(4):
        h, body = await _turn(fleet, messages)
        worker, verdict, matched = h["x-kvfleet-worker"], h["x-kvfleet-verdict"], int(h["x-kvfleet-matched-tokens"])
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]  # what the worker itself reused
        prompt = body["usage"]["prompt_tokens"]
        rows.append((turn, worker, verdict, matched, cached, prompt, h["x-kvfleet-epoch"]))
        first_worker = first_worker or worker
        if turn == 0:
            assert verdict == "COLD" and matched == 0 and cached == 0
        else:
            assert (worker, verdict) == (first_worker, "WARM")
            assert matched == cached > 0  # the router's matched length is exactly what the worker reused
            assert matched >= (rows[-2][5] // BLOCK) * BLOCK - BLOCK  # nearly all of the previous turn's prompt
        # the controller learns the new blocks from the worker's KV events (asynchronous), then the user replies
        await until(lambda w=worker: fleet.blocks_known(w), lambda n, p=prompt: n >= p // BLOCK)
        messages = messages + [body["choices"][0]["message"], {"role": "user", "content": f"And day {turn + 2}?"}]
    for t, w, v, m, c, n, e in rows:
        print(f"turn {t} -> {w} {v} matched={m} worker-cached={c} prompt={n} epoch={e}")
    # control: tenant B sends the very same conversation; its cache_salt differs, so nothing is warm for it
    hb, bb = await _turn(fleet, messages, who="b")
    print("tenant B, same text:", hb["x-kvfleet-verdict"], hb["x-kvfleet-matched-tokens"],
          "worker-cached:", bb["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert hb["x-kvfleet-verdict"] == "COLD" and bb["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # every completion went to the chosen worker only; the others got none
    others = [n for n in fleet.sims if n != first_worker and n != hb["x-kvfleet-worker"]]
    assert all(not served(fleet.sims[n], "/v1/chat/completions") for n in others)


async def test_models_health_and_metrics(fleet: Fleet) -> None:
    async with fleet.http.get(fleet.proxy.url + "/v1/models", headers=fleet.headers()) as r:
        models = await r.json()
    assert r.status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    async with fleet.http.get(fleet.proxy.url + "/health") as r:
        health = await r.json()
    assert health == {"status": "ok", "workers": 3, "serving": 3, "directory_error": None,
                      "tokenizer": {"local": None, "parity": {}}}
    status, h, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 2})
    assert status == 200
    async with fleet.http.get(fleet.proxy.url + "/metrics") as r:
        text = await r.text()
    line = f'kvfleet_proxy_requests_total{{status="200",verdict="COLD",worker="{h["x-kvfleet-worker"]}"}} 1.0'
    assert line in text and "kvfleet_proxy_added_latency_seconds_bucket" in text


async def test_lora_cards_are_listed_and_routed_with_the_adapter(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, loras={"sql-lora": "/adapters/sql"})
    try:
        async with fleet.http.get(fleet.proxy.url + "/v1/models", headers=fleet.headers()) as r:
            cards = {m["id"]: m.get("parent") for m in (await r.json())["data"]}
        assert cards == {MODEL: None, "sql-lora": MODEL}
        rows = []
        for _ in range(2):
            status, h, raw = await fleet.post("/v1/completions", {"model": "sql-lora", "prompt": SYSTEM,
                                                                  "max_tokens": 2})
            assert status == 200, raw
            body = json.loads(raw)
            rows.append((h["x-kvfleet-worker"], h["x-kvfleet-verdict"], int(h["x-kvfleet-matched-tokens"]),
                         body["usage"]["prompt_tokens_details"]["cached_tokens"], body["model"]))
            await until(lambda w=h["x-kvfleet-worker"]: fleet.blocks_known(w),
                        lambda n, p=body["usage"]["prompt_tokens"]: n >= p // BLOCK)
        # control: the base model on the same text shares no blocks with the adapter (LoRA is in every block hash)
        status, hb, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": SYSTEM, "max_tokens": 2})
        print("LoRA turns (worker, verdict, matched, worker-cached, model):", rows,
              "| base model, same text:", hb["x-kvfleet-verdict"], hb["x-kvfleet-matched-tokens"])
        # the route claims every whole block; vLLM hits at most prompt - 1 tokens (its last block computed again)
        assert rows[0][1] == "COLD" and rows[1][:2] == (rows[0][0], "WARM")
        n = body["usage"]["prompt_tokens"]
        assert (rows[1][2], rows[1][3]) == (n // BLOCK * BLOCK, (n - 1) // BLOCK * BLOCK)
        assert rows[1][4] == "sql-lora" and hb["x-kvfleet-verdict"] == "COLD"
    finally:
        await fleet.stop()


async def test_a_prompt_embeds_completion_is_routed_by_load_and_forwarded_as_sent(fleet: Fleet) -> None:
    """vLLM (--enable-prompt-embeds) takes `prompt_embeds` in place of a prompt; the proxy has no ids to match, so
    it routes by load (COLD) and forwards the body as sent, the embeddings for the worker to check. Before: 400
    "'prompt' must be a string ...", never forwarded."""
    body = {"model": MODEL, "prompt_embeds": "AAAAAAAAAAA=", "max_tokens": 2}
    status, headers, raw = await fleet.post("/v1/completions", body)
    assert headers.get("x-kvfleet-verdict") == "COLD" and headers.get("x-kvfleet-matched-tokens") == "0", raw
    worker = fleet.sims[headers["x-kvfleet-worker"]]
    assert [s.path for s in served(worker)] == ["/v1/completions"]  # no /tokenize: nothing to tokenize
    print("the stand-in's answer:", status, raw[:120])
    # control: a prompt of neither kind is still the proxy's 400, and reaches no worker
    status, _, raw = await fleet.post("/v1/completions", {"model": MODEL, "max_tokens": 2})
    assert status == 400 and b"prompt" in raw
    assert sum(len(served(s, "/v1/completions")) for s in fleet.sims.values()) == 1
