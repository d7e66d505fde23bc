"""The fleet routing harness itself, on a tiny trace: real stand-ins, the sticky router and a real
kvfleet controller + proxy (separate processes), the lifecycle actions behind their backs.
The peer routers from PyPI are not needed (bench/fleet_routing.py runs them)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import fleet_routing as fr  # noqa: E402
from peers.launch import CONTENDERS  # noqa: E402
from peers.report import report  # noqa: E402
from peers.summary import summarize  # noqa: E402
from routing_trace import agents  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.mark.slow
async def test_sticky_and_kvfleet_run_the_trace_and_the_counts_add_up(tmp_path: Path) -> None:
    wl = agents("smoke", 0, num_agents=4, num_workers=2, turns=3, think_s=0.02, system_words=120)
    opt = fr.Options(timeout_s=5.0, sleep_min_s=0.3, sleep_max_s=2.0, think_s=0.02)
    cell = {"workload": wl.describe(), "cache": "tight", "num_blocks": 256, "runs": []}
    for name in ("sticky", "kvfleet"):
        (tmp_path / name).mkdir()
        r = await fr.run_one(CONTENDERS[name], wl, 256, opt, tmp_path / name)
        assert "unavailable" not in r, r.get("unavailable")
        assert [x["status"] for x in r["records"]] == [200] * wl.num_requests
        assert [x["finish_reason"] for x in r["records"]] == ["length"] * wl.num_requests
        assert sorted((e["verb"], e["ok"]) for e in r["events"]) == [
            ("reset_prefix_cache", True),
            ("sleep", True),
            ("wake_up", True),
        ], r["events"]
        s = summarize(r)
        # every prompt ran once on some worker (a request to the sleeper waited, or was retried by kvfleet's proxy),
        # and the shared system prompt was reused. A retried request may have started on the worker it left (the
        # proxy probes a worker whose first byte is late; a loaded machine once counted 859 tokens more than the
        # prompts): it counts at most once more per extra attempt. Sticky never retries.
        again_at_most = sum((x["prompt_tokens"] or 0) * (x["attempts"] - 1) for x in r["records"])
        print(f"{name}: queries {s['queries']:,}, prompts {wl.prompt_tokens():,}, retried "
              f"{sum(x['attempts'] > 1 for x in r['records'])} (their extra attempts' prompts {again_at_most:,})")
        assert wl.prompt_tokens() <= s["queries"] <= wl.prompt_tokens() + again_at_most
        again = sum(w["recomputed"] for w in r["workers"].values())  # prompts the reset preempted, computed again
        assert 0 < s["prefilled"] - again < s["queries"] and again >= 0 and s["recomputed"] == again
        assert sum(w["arrivals"] for w in r["workers"].values()) >= wl.num_requests
        if name == "kvfleet":
            assert {x["verdict"] for x in r["records"]} <= {"WARM", "COLD"}
            assert s["warm"] > 0 and s["stale_warm"] is not None
        cell["runs"].append(r)
    doc = report(
        {
            "cells": [cell],
            "commit": "test",
            "quick": True,
            "took_s": 1.0,
            "max_tokens": fr.MAX_TOKENS,
            "options": {"think_s": 0.02, "sleep_min_s": 0.3, "sleep_max_s": 2.0, "timeout_s": 5.0},
            "versions": {"vllm-router": "-", "sglang-router": "-"},
            "sim_config": {"block_size": 16},
        }
    )
    assert "| sticky |" in doc and "| kvfleet |" in doc
    for r in cell["runs"]:  # each total with the part a preemption made the workers compute again
        s = summarize(r)
        assert f"| {r['contender']} | {s['prefilled']:,} ({s['recomputed']:,}) |" in doc


async def test_the_mooncake_slice_replays_open_loop_and_shares_prefixes_as_its_hash_ids_say(
    tmp_path: Path,
) -> None:
    """The committed trace slice (bench/data/) replays at its (compressed) timestamps through a real
    router; requests whose hash ids share leading blocks share stand-in blocks, so the workers hit."""
    import mooncake

    data = BENCH / "data" / "mooncake_conversation_1500.jsonl"
    assert data.stat().st_size < 2 << 20 and (BENCH / "data" / "LICENSE-APACHE").exists()
    wl = mooncake.mooncake("mooncake", num_requests=40)
    assert [t for t, _ in wl.arrivals] == sorted(t for t, _ in wl.arrivals) and wl.arrivals[-1][0] > 1.0
    # requests 0 and 1 share hash id 0 (one 512-token block): the same 16 leading words
    a, b = (wl.sessions[i].turns[0][0].split() for i in (0, 1))
    assert a[:16] == b[:16] and a[16:32] != b[16:32]
    opt = fr.Options(timeout_s=5.0, sleep_min_s=0.3, sleep_max_s=2.0, think_s=0.0)
    r = await fr.run_one(CONTENDERS["sticky"], wl, 256, opt, tmp_path)
    assert "unavailable" not in r, r.get("unavailable")
    assert [x["status"] for x in r["records"]] == [200] * 40
    # none was ended by the sleep: a 200 stream can still end with finish_reason "abort"
    assert [x["finish_reason"] for x in r["records"]] == ["length"] * 40
    assert sorted(x["issued"] for x in r["records"]) == list(range(1, 41))
    s = summarize(r)
    again = sum(w["recomputed"] for w in r["workers"].values())  # prompts the reset preempted, computed again
    assert s["queries"] == wl.prompt_tokens() and 0 < s["prefilled"] - again < s["queries"] and again >= 0


def test_agents_tools_send_each_tool_result_as_a_tool_message() -> None:
    """agents-tools: the same kind of turns as agents16x4, each turn's tool result in its own `role: tool`
    message before the instruction (the proxy judges those; a user message it never judges)."""
    from routing_trace import workload

    s = workload("agents-tools", quick=True).sessions[0]
    msgs = s.messages(2)
    roles = [m["role"] for m in msgs]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant", "tool", "user"], roles
    tools = [m["content"] for m in msgs if m["role"] == "tool"]
    assert [t.split(":")[0] for t in tools] == ["tool result 1", "tool result 2"]
    assert all(m["content"].startswith("instruction: ") for m in msgs[4::3])
    plain = s.__class__(s.session_id, s.tenant, s.system, s.turns, s.think_s)     # control: tool_role off
    assert [m["role"] for m in plain.messages(2)] == ["system", "user", "assistant", "user", "assistant", "user"]


async def test_the_no_hazards_control_runs_the_trace_with_no_lifecycle_action(tmp_path: Path) -> None:
    # the control behind --no-hazards: the same trace, every request answered, nothing slept or reset
    wl = agents("smoke", 0, num_agents=4, num_workers=2, turns=3, think_s=0.02, system_words=120)
    opt = fr.Options(timeout_s=5.0, sleep_min_s=0.3, sleep_max_s=2.0, think_s=0.02, hazards=False)
    r = await fr.run_one(CONTENDERS["sticky"], wl, 256, opt, tmp_path)
    assert [x["status"] for x in r["records"]] == [200] * wl.num_requests
    assert r["events"] == []
    assert sum(w["recomputed"] for w in r["workers"].values()) == 0  # no reset preempted anything
    doc = report(
        {
            "cells": [{"workload": wl.describe(), "cache": "tight", "num_blocks": 256, "runs": [r]}],
            "commit": "test",
            "quick": True,
            "took_s": 1.0,
            "max_tokens": fr.MAX_TOKENS,
            "options": dataclasses.asdict(opt),
            "versions": {"vllm-router": "-", "sglang-router": "-"},
            "sim_config": {"block_size": 16},
        }
    )
    assert "A control run (`--no-hazards`)" in doc.splitlines()[2]  # the report says the hazards were off
