"""Where a saved fleet_routing run's requests went and what they prefilled, phase by phase and session by session.

    python bench/peers/placement.py RUN.json --cell demo/tight [--contenders kvfleet,vllm-kv_aware] [--sessions 50:150]

RUN.json is what `bench/fleet_routing.py --json` saved. Phases are the trace's lifecycle hazards: before the sleep,
asleep, woken, after the reset (by the issued count at which the bench fires each). A request's prefill here is its
prompt less the tokens its worker reported cached; the preempted requests' recompute, which the stand-ins count apart,
is the contender's table figure less the sum of these. (The bench wakes the slept worker at its wake fraction only
once the sleep has lasted its shortest window, and at the latest at the reset's fraction, the reset then following the
wake; a run saved with --reset-in-sleep, or before that rule, may have its reset inside the sleep: the events line says
when each action came.) `--sessions A:B` prints, for the requests issued from A to B,
one column per session: the worker each went to (kvfleet's records name it; the peers' do not) and its prefill / prompt.
This is how docs/benchmarks.md's request-by-request accounts were read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from peers.summary import summarize  # noqa: E402

FRACTIONS = ("sleep_at", "wake_at", "reset_at")


def phase_names(cell: dict[str, Any]) -> list[str]:
    """The phases by the share of the trace's requests issued: 0 to the sleep's fraction, ... , the reset's to 100%."""
    f = [0.0, *(cell["workload"][k] for k in FRACTIONS), 1.0]
    return [f"issued {100 * a:.0f}-{100 * b:.0f}%" for a, b in zip(f, f[1:], strict=False)]


def phases(cell: dict[str, Any], run: dict[str, Any]) -> list[int]:
    """Prefilled tokens of the requests issued in each phase (records only: without the preempted recompute)."""
    wl = cell["workload"]
    n = wl["requests"]
    bounds = [int(wl[k] * n) for k in FRACTIONS]
    out = [0] * (len(bounds) + 1)
    for r in run["records"]:
        # NOTE: a request that failed before its worker answered has no counts; it is left out here (the table's total
        # has whatever the worker computed for it)
        if r["prompt_tokens"] is not None and r["cached_tokens"] is not None:
            out[sum(r["issued"] >= b for b in bounds)] += r["prompt_tokens"] - r["cached_tokens"]
    return out


def timeline(run: dict[str, Any], lo: int, hi: int) -> list[str]:
    recs = sorted(run["records"], key=lambda r: r["issued"])
    sessions = sorted({r["session"] for r in recs})
    lines = ["req     t_s " + " ".join(f"{s[-12:]:>14s}" for s in sessions)]
    for r in recs:
        if lo <= r["issued"] < hi:
            row = [""] * len(sessions)
            row[sessions.index(r["session"])] = (
                f"{r.get('worker') or '?'}:{r['prompt_tokens'] - r['cached_tokens']}/{r['prompt_tokens']}")
            lines.append(f"{r['issued']:3d} {r['issued_s']:7.2f} " + " ".join(f"{v:>14s}" for v in row))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("--cell", required=True, help="workload/cache, e.g. demo/tight")
    p.add_argument("--contenders", default="", help="comma-separated (default: every one in the run)")
    p.add_argument("--sessions", default="", metavar="A:B", help="the session columns for requests A..B-1")
    a = p.parse_args(argv)
    d = json.loads(a.run.read_text())
    cell = next((c for c in d["cells"] if f"{c['workload']['name']}/{c['cache']}" == a.cell), None)
    if cell is None:
        raise SystemExit(f"no cell {a.cell!r} in {a.run}")
    want = [x for x in a.contenders.split(",") if x]
    for run in cell["runs"]:
        if want and run["contender"] not in want:
            continue
        ph, total = phases(cell, run), summarize(run)["prefilled"]
        events = ", ".join(f"{e['verb']} {e['worker']} at request {e['at_request']} ({e['t_s']:.2f} s)"
                           for e in run["events"])
        print(f"{run['contender']}: prefilled {total:,} (recomputed after preemption {total - sum(ph):,}); by phase "
              + ", ".join(f"{name} {v:,}" for name, v in zip(phase_names(cell), ph, strict=True)) + f"; {events}")
        if a.sessions:
            lo, hi = (int(x) for x in a.sessions.split(":"))
            print("\n".join(timeline(run, lo, hi)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
