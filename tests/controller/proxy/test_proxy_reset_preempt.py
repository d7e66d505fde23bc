"""The SDK's reset with reset_running_requests=true, through gRPC: the request running there is preempted and
computed again, and its client still gets its whole answer (no drain, no failover). Real parts: a controller,
clocked sim-vllm workers, a proxy in front; the verb goes through the SDK, as an operator's would.
"""

from __future__ import annotations

import asyncio
import json

from support.proxy_fleet import MODEL, start_fleet, until

PROMPT = "Summarise the incident timeline for the storage outage, one line per event. " * 2


async def test_the_sdks_preempting_reset_recomputes_the_running_request_and_answers_it(tmp_path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw={"time_scale": 1.0, "decode_base_s": 0.01})
    try:
        task = asyncio.create_task(fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 80}))

        async def running() -> str | None:
            return next((n for n, s in fleet.sims.items() if s.engine.sched.in_flight()), None)

        x = await until(running, lambda n: n is not None, timeout=5.0)
        w = await fleet.op.lifecycle(x, "reset_prefix_cache", reset_running_requests=True)
        assert w.kv == "forgotten" and w.serving
        status, headers, body = await task
        assert status == 200 and headers.get("x-kvfleet-attempts", "1") == "1"  # answered where it ran
        assert json.loads(body)["choices"][0]["finish_reason"] == "length"
        assert fleet.sims[x].engine.preempted_prefill > 0  # computed again after the preemption
    finally:
        await fleet.stop()
