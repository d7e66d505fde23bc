"""A token in steady use never waits for WhoAmI on its request path: the proxy renews its cached answer in the
background once half of auth_cache_s is gone (before: every auth_cache_s one request paid a WhoAmI round trip).
No answer is used past auth_cache_s, and a renewal that finds the token refused drops it at once.

Real controller (auth on, its tokens file edited to revoke a token) and the proxy's own ControlClient; the stub's
WhoAmI is wrapped only to count calls."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.proxy_fleet import count_whoami, start_fleet, until

from controller.auth import hash_token
from fleet.core.errors import Unauthenticated


async def test_a_token_in_steady_use_waits_for_whoami_once(tmp_path: Path) -> None:
    # NOTE: a renewal has half of auth_cache_s to land before the entry expires; at 0.6 s a loaded 2-core machine once
    # took longer than the 0.3 s left (2 of 18 calls waited), so the life is 1.0 s.
    fleet = await start_fleet(tmp_path, auth_cache_s=1.0)
    try:
        control, token = fleet.proxy.control, fleet.tokens["a"]
        calls = count_whoami(control)
        waited, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 3.0:  # a request every 0.1 s for 3 cache lives
            before = calls[0]
            caller = await control.whoami(token)
            waited.append(calls[0] != before)  # this call awaited a WhoAmI itself
            assert caller.tenant == "acme"
            await asyncio.sleep(0.1)
        print(f"{len(waited)} calls over 3.0 s with auth_cache_s 1.0: {sum(waited)} waited for a WhoAmI, "
              f"{calls[0]} WhoAmI RPCs in all")
        assert waited[0] and sum(waited) == 1  # only the first (each cache life's first call before: 3)
        assert calls[0] >= 4  # renewed in the background, about every half life: never used past auth_cache_s
    finally:
        await fleet.stop()


async def test_a_renewal_that_finds_the_token_refused_drops_it(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, auth_cache_s=30.0)
    try:
        control, token = fleet.proxy.control, fleet.tokens["a"]
        assert (await control.whoami(token)).tenant == "acme"
        _, caller = control._callers[token]
        control._callers[token] = (time.monotonic() + 10.0, caller)  # past half its life: the next call renews
        _revoke(tmp_path / "tokens.json", token)  # the controller reloads its tokens file when it changes
        assert (await control.whoami(token)).tenant == "acme"  # still the cached answer (within its life)
        await until(lambda: _gone(control, token), bool, timeout=5.0)  # the renewal was refused: dropped
        with pytest.raises(Unauthenticated):
            await control.whoami(token)  # asked again, refused on this call
    finally:
        await fleet.stop()


def _revoke(tokens_file: Path, token: str) -> None:
    doc = json.loads(tokens_file.read_text())
    doc["tokens"] = [e for e in doc["tokens"] if e["sha256"] != hash_token(token)]
    tokens_file.write_text(json.dumps(doc))


async def _gone(control: Any, token: str) -> bool:
    return token not in control._callers
