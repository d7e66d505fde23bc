"""A batched completions request's later prompts are tokenized one /tokenize call each (vLLM's takes one prompt), at
most BATCH_TOKENIZE_AT_ONCE at a time per tenant, all of the tenant's batches together: the workers' API servers
are shared by every tenant, so one tenant's batches never hold more of them. NOTE: the bound was per request: a
tenant's three batches in flight ran 24 calls at once (any number, more batches), each a call every other tenant's
/tokenize queued beside on the workers. Real sims, controller and proxy; the workers hold the calls until released."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from support.proxy_fleet import MODEL, start_fleet, until

from controller.proxy.batch_prompts import BATCH_TOKENIZE_AT_ONCE


async def test_one_tenants_batches_tokenize_at_most_their_share_and_another_tenant_is_not_queued(
        tmp_path: Path) -> None:
    release, held = asyncio.Event(), []

    def holding(sim: Any) -> Any:
        @web.middleware
        async def hold(req: web.Request, handler: Any) -> web.StreamResponse:
            if req.path == "/tokenize":
                prompt = str((await req.json()).get("prompt", ""))
                if prompt.startswith("held"):
                    held.append(prompt)
                    await release.wait()
            return await handler(req)  # type: ignore[no-any-return]
        return hold

    fleet = await start_fleet(tmp_path, worker_middleware=holding)
    try:
        def batch(who: str, i: int, n: int) -> dict[str, Any]:
            prompts = [f"first {who} {i} is free."] + [f"held {who} {i} {j} waits." for j in range(n)]
            return {"model": MODEL, "prompt": prompts, "max_tokens": 1}

        flood = [asyncio.create_task(fleet.post("/v1/completions", batch("a", i, 9))) for i in range(3)]
        await until(lambda: asyncio.sleep(0, len(held)), lambda n: n >= BATCH_TOKENIZE_AT_ONCE)
        other = asyncio.create_task(fleet.post("/v1/completions", batch("b", 0, 1), who="b"))
        # the other tenant's call reaches a worker while the first tenant's are all held: it waits behind none of them
        await until(lambda: asyncio.sleep(0, held), lambda h: any(p.startswith("held b") for p in h))
        await asyncio.sleep(0.3)  # what the flood would add, had it more calls at once (NOTE: 24 before)
        mine = [p for p in held if p.startswith("held a")]
        print("held at once:", len(mine), "of tenant a;", len(held) - len(mine), "of tenant b")
        assert len(mine) == BATCH_TOKENIZE_AT_ONCE
        release.set()
        for status, _, raw in await asyncio.gather(*flood, other):
            assert status == 200 and len(json.loads(raw)["choices"]) in (2, 10), raw
        assert len([p for p in held if p.startswith("held a")]) == 27  # control: every later prompt was tokenized
    finally:
        release.set()
        await fleet.stop()
