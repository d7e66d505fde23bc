"""Inputs scripts/fuzz_proxy.py found mishandled by the proxy, each sent to a real fleet (controller, stand-ins, proxy).
"""

from __future__ import annotations

from pathlib import Path

from support.proxy_fleet import MODEL, proxy_released, served, start_fleet


async def test_a_responses_item_whose_type_is_not_a_string_is_the_workers_to_refuse(tmp_path: Path) -> None:
    """An /v1/responses `input` item whose `type` is an object (or a list) is no item vLLM reads. The proxy looked it
    up in its sets of tool-output types to judge it: unhashable, a TypeError and the proxy's 500. Now it is forwarded
    as sent (vLLM answers its 400), its tool output beside it still judged, and the route released."""
    fleet = await start_fleet(tmp_path, num_workers=1)
    try:
        for odd in ({}, ["function_call_output"]):
            body = {"model": MODEL, "max_output_tokens": 4,
                    "input": [{"type": odd, "output": "x"}, {"type": "function_call_output", "output": "sunny"},
                              {"role": "user", "content": "and tomorrow?"}]}
            status, headers, raw = await fleet.post("/v1/responses", body)
            assert status < 500, raw
            assert "x-kvfleet-worker" in headers, (status, raw)  # the worker's answer, relayed
        assert len(served(fleet.sims["w0"], "/v1/responses")) == 2
        judged = [s for m in fleet.proxy.metrics.judged.collect() for s in m.samples if s.name.endswith("_total")]
        assert sum(s.value for s in judged) == 2  # "sunny", once per request
        await proxy_released(fleet, 2)
    finally:
        await fleet.stop()
