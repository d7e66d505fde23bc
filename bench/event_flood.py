"""A flooding KV-event replay endpoint against another tenant's WhoAmI (`python bench/event_flood.py`).

The issue #31 item 1 reproduction at full scale, side by side in one run: a real controller (auth
on, sqlite store) with an honest sim-vllm worker; another tenant's WhoAmI every 10 ms from its own
thread while a second worker registers, (a) with an honest replay endpoint (the control) and (b)
with one that answers every replay request with 19,000 batches of 600 `AllBlocksCleared` events
(inside the default batch and byte caps of one replay), then 2 s more (several tail polls).
Reports WhoAmI p50 / p99 / max, the flooding worker's status, and the events refused; writes its
section of docs/benchmarks.md (`bench:event-flood`). The test (tests/controller/test_event_flood.py)
runs the same scenario with 1,500 batches.

Cost of the guard: a budget check per batch (a sum over its events) and a clock read per event
slice; the flood itself costs one budget's worth of events (200,000; an AllBlocksCleared counts
1,000) before the worker is faulty and its events are no longer decoded.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.kv_flood import run_flood  # noqa: E402


def _row(name: str, r: dict[str, Any]) -> str:
    phase, serving = r["rows"][("flooder", 0)]
    return (f"| {name} | {r['register_s']:.2f} | {len(r['latencies'])} | {r['p50'] * 1e3:.1f} | {r['p99'] * 1e3:.1f} | "
            f"{r['max'] * 1e3:.0f} | {len(r['errors'])} | {phase}, serving={serving} | {int(r['over_budget'] or 0):,} |")


def section(control: dict[str, Any], flood: dict[str, Any], batches: int, events: int) -> str:
    ratio = flood["p99"] / control["p99"] if control["p99"] else float("nan")
    return "\n".join([
        "## KV-event flood: another tenant's WhoAmI (`bench/event_flood.py`)",
        "",
        f"A worker registers whose replay socket answers every request with {batches:,} batches of {events} "
        "`AllBlocksCleared` events; another tenant calls WhoAmI every 10 ms meanwhile (and 2 s after, "
        "over several tail polls). Control: the same worker with an honest replay endpoint. One run, this "
        "machine (2 cores, shared).",
        "",
        "| run | RegisterWorker s | WhoAmI calls | p50 ms | p99 ms | max ms | errors | flooding worker | events refused |",
        "|---|---|---|---|---|---|---|---|---|",
        _row("control (honest replay)", control),
        _row(f"flood ({batches:,} x {events})", flood),
        "",
        f"WhoAmI p99 under the flood / control: {ratio:.2f}x. Before the fix (same flood, 4,000 batches, "
        "issue #31): RegisterWorker took 21 s and WhoAmI 20.6 s; at 19,000 batches WhoAmI hit its 60 s deadline.",
    ])


async def bench(batches: int, events: int) -> tuple[dict[str, Any], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as w, tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        await run_flood(Path(w), 0, window_s=0.5)  # warm-up: imports, first connections (not reported)
        control = await run_flood(Path(a), 0)
        flood = await run_flood(Path(b), batches, events=events)
    return control, flood


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=19_000)
    ap.add_argument("--events", type=int, default=600)
    ap.add_argument("--no-docs", action="store_true", help="print the section, do not write docs/benchmarks.md")
    args = ap.parse_args(argv)
    control, flood = asyncio.run(bench(args.batches, args.events))
    text = section(control, flood, args.batches, args.events)
    print(text)
    if not args.no_docs:
        sys.path.insert(0, str(ROOT / "bench"))
        from benchdoc import write_section

        write_section("event-flood", text, ROOT / "docs" / "benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
