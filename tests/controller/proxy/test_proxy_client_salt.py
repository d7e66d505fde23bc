"""A client's own `cache_salt` (a multi-user app's salt per end user, as vLLM documents it) keeps its users' caches
apart through the proxy, within its tenant's salt.

NOTE: the proxy replaced it with the tenant's salt, so every user of one tenant shared one cache: a prompt that user-1
sent came back to user-2, sent with another salt, with `cached_tokens` 64 of 64 (vLLM alone: 0), the probe vLLM's
salt exists to stop (found by review). Now the controller derives the salt it routes with and answers from the
tenant's and the client's (controller/auth.py), so routes still match the worker's blocks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.proxy_fleet import BLOCK, MODEL, Fleet, start_fleet, until

PROMPT = " ".join(f"word{i}" for i in range(4 * BLOCK))


async def _send(fleet: Fleet, who: str, **extra: Any) -> tuple[int, int, str, dict[str, Any]]:
    """(status, cached_tokens, verdict, the body the worker got) of one completion of PROMPT."""
    status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **extra},
                                      who)
    assert status == 200, raw
    got = json.loads(fleet.sims["w0"].received.items[-1][1])
    return status, json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"], h["x-kvfleet-verdict"], got


async def test_a_clients_own_cache_salt_keeps_its_users_apart(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1)
    auth = fleet.ctl.ctx.auth
    try:
        _, cached, _, first = await _send(fleet, "a", cache_salt="user-1")
        assert cached == 0
        _, cached, _, got = await _send(fleet, "a", cache_salt="user-2")
        assert cached == 0, cached  # before: 64, user-1's prompt
        assert first["cache_salt"] == auth.cache_salt("acme", "user-1") != auth.cache_salt("acme")
        # another tenant naming the same salt gets its own derivation: nothing of acme's
        _, cached, _, got = await _send(fleet, "b", cache_salt="user-1")
        assert cached == 0 and got["cache_salt"] == auth.cache_salt("bravo", "user-1") != auth.cache_salt("acme", "user-1")
        # the same user is routed WARM to its own blocks (the controller hashes with the salt it forwards)
        await until(lambda: fleet.blocks_known("w0"), lambda n: n >= 3 * 4)
        _, cached, verdict, _ = await _send(fleet, "a", cache_salt="user-1")
        assert (cached, verdict) == (3 * BLOCK, "WARM")  # all but the last of its 4 blocks (vLLM: prompt - 1 at most)
        # control: without a salt of its own a client gets its tenant's, as before
        _, cached, _, got = await _send(fleet, "a")
        assert cached == 0 and got["cache_salt"] == auth.cache_salt("acme")
        # what vLLM refuses ("Parameter 'cache_salt' must be a non-empty string if provided.") is a 400, unsent
        before = len(fleet.sims["w0"].received.items)
        for bad in ("", 5, ["x"]):
            status, _, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": bad})
            assert status == 400 and json.loads(raw)["error"]["param"] == "cache_salt", (bad, raw)
        status, _, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": "x" * 1025})
        assert status == 400 and b"cache_salt" in raw, raw  # the controller's bound
        assert len(fleet.sims["w0"].received.items) == before
    finally:
        await fleet.stop()
