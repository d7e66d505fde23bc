"""The proxy holds the controller's WhoAmI answer of each token it has seen (controller/proxy/callers.py), a bounded
number of them. One tenant using many tokens (one per end user of its app) must not push out another tenant's answer:
that tenant's next request would wait for a WhoAmI again, in the one share of the tokens not known yet.

NOTE: past the bound, every answer was dropped at once: the fifth token of bravo's app dropped acme's answer too.

Real controller (auth on; tokens minted into its tokens file, which it reads again when it changes), the proxy in
front of stand-ins; its ControlClient's WhoAmI is wrapped only to count calls."""

from __future__ import annotations

from pathlib import Path

from support.proxy_fleet import count_whoami, start_fleet

from controller.auth import mint_token
from controller.proxy.callers import KnownCallers


async def test_one_tenants_many_tokens_never_push_out_another_tenants_answer(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, auth_cache_s=3600.0)  # no answer ages out in the test
    try:
        control = fleet.proxy.control
        control._callers = KnownCallers(cap=4)
        bravo = [mint_token(tmp_path / "tokens.json", "bravo", "tenant", f"bravo-user-{i}") for i in range(5)]
        calls = count_whoami(control)

        async def version(token: str) -> int:
            async with fleet.http.get(fleet.proxy.url + "/version", headers={"Authorization": f"Bearer {token}"}) as r:
                return r.status

        assert await version(fleet.tokens["a"]) == 200 and calls[0] == 1
        for token in bravo:  # one more than the bound holds
            assert await version(token) == 200
        assert calls[0] == 6 and len(control._callers) == 4
        assert fleet.tokens["a"] in control._callers  # NOTE: before, dropped with every other answer
        assert await version(fleet.tokens["a"]) == 200 and calls[0] == 6  # acme's next request asks no WhoAmI
        assert bravo[0] not in control._callers  # control: the bound binds, on bravo's own oldest
        assert await version(bravo[0]) == 200 and calls[0] == 7
    finally:
        await fleet.stop()
