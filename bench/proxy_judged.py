"""What judging a turn's tool results together costs the proxy's request path (issue #28).

A real controller (rules + learned), proxy and one `sim-vllm` stand-in on loopback. The same agent
conversation, two shapes, requests interleaved one by one so both see the same machine:

    separate   two tool results in two turns (assistant messages between): each judged alone, 1 judge call
    one turn   the same two results as one turn (two consecutive tool messages): also judged joined, a
               second judge call for the joined text

Each conversation is sent once untimed (first inspections), then `--calls` times: the steady state of an
agent resending its history (every verdict served from the verdict cache). Reported: time to the complete
(non-streamed, 4-token) answer, p50 / p99 in ms, and one turn / separate.

    python bench/proxy_judged.py [--calls 100] [--write-doc]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.router import RouterConfig  # noqa: E402
from fleet.app.testkit.stack import StackConfig, start_stack  # noqa: E402

MODEL = "sim-model"
SYSTEM = "You are a research assistant. Use the tools; answer briefly and cite the tool you used. " * 4
A = "Search results: 1. kvfleet routes requests to the worker holding their prefix. 2. vLLM serves models. " * 4
B = "Weather in Paris: 18C, light rain, wind 12 km/h from the west, humidity 81%, sunset 19:42. " * 4


def call(i: int) -> dict[str, Any]:
    return {"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": "{}"}}


def separate() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Look both up."},
            {"role": "assistant", "content": "", "tool_calls": [call(0)]},
            {"role": "tool", "tool_call_id": "c0", "content": A},
            {"role": "assistant", "content": "", "tool_calls": [call(1)]},
            {"role": "tool", "tool_call_id": "c1", "content": B}]


def one_turn() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Look both up."},
            {"role": "assistant", "content": "", "tool_calls": [call(0), call(1)]},
            {"role": "tool", "tool_call_id": "c0", "content": A},
            {"role": "tool", "tool_call_id": "c1", "content": B}]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000


async def run(calls: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as d:
        stack = await start_stack(StackConfig(
            store_url=f"sqlite:///{Path(d) / 'kv.db'}", state_dir=d, workers=1, num_blocks=2048, block_size=16,
            model=MODEL, tenants=("acme",), operator="ops", operator_name="", sessions=False, metrics=True,
            controller={"detector_layers": ("rules", "learned")}, proxy={"first_byte_timeout_s": 1.0},
            router=RouterConfig(reconcile_interval_s=0.5)))
        assert stack.proxy is not None
        await stack.client.close()
        headers = {"Authorization": f"Bearer {stack.tokens['acme']}"}
        shapes = {"separate": separate(), "one turn": one_turn()}
        out: dict[str, list[float]] = {k: [] for k in shapes}
        try:
            async with aiohttp.ClientSession() as http:
                async def post(msgs: list[dict[str, Any]]) -> float:
                    t0 = time.perf_counter()
                    async with http.post(f"{stack.proxy.url}/v1/chat/completions", headers=headers,
                                         json={"model": MODEL, "messages": msgs, "max_tokens": 4}) as r:
                        await r.read()
                        assert r.status == 200, r.status
                    return time.perf_counter() - t0

                for msgs in shapes.values():
                    await post(msgs)  # first inspections, untimed
                for _ in range(calls):
                    for name, msgs in shapes.items():
                        out[name].append(await post(msgs))
        finally:
            await stack.stop()
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--write-doc", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()
    out = asyncio.run(run(args.calls))
    s, t = out["separate"], out["one turn"]
    body = "\n".join([
        f"{os.cpu_count()} cores; `python bench/proxy_judged.py --calls {args.calls}`; time to a complete 4-token "
        "answer through the proxy, verdicts cached (an agent resending its history), requests interleaved:", "",
        "| shape | judge calls | p50 ms | p99 ms |", "|---|---|---|---|",
        f"| two tool results in two turns | 1 | {pct(s, .5):.1f} | {pct(s, .99):.1f} |",
        f"| the same two in one turn (also judged joined) | 2 | {pct(t, .5):.1f} | {pct(t, .99):.1f} |",
        f"| one turn / separate | | {pct(t, .5) / pct(s, .5):.2f}x | {pct(t, .99) / pct(s, .99):.2f}x |"])
    print(body)
    if args.write_doc:
        sys.path.insert(0, str(ROOT / "bench"))
        from benchdoc import write_section

        write_section("proxy_judged", "## A turn's tool results judged together (bench/proxy_judged.py)\n\n" + body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
