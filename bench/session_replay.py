"""What rebuilding a session costs when its history is longer than what it holds.

An agent appends a tool result or a long answer, uses it, and evicts it: the session stays short while
its op log grows. A session released by the idle reaper, or lost with its host, is rebuilt from that log.
Two ways, side by side in one run on the same logs:

  op by op       `SessionContext.replay`: every logged op through the model again (every token ever
                 appended, and every exact eviction's survivors recomputed)
  ledger + once  `SessionContext.replay_over` on a fresh session: the ledger replayed without the model,
                 then the final tokens prefilled once (what a host's regeneration runs since this bench
                 was written; a log with a reposition eviction that had survivors still goes op by op)

Part 1 times both in this process on the same logs (median of 3), for histories of 10, 30 and 60 cycles
of 4,000 tokens appended and evicted exactly. Part 2 times the real path: a KernelFleet on a local Ray,
a session with 30 cycles released, and its next call (which regenerates it on its host), against the same
history with reposition evictions, which the host must still replay op by op. Digests are checked.

    python bench/session_replay.py [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchdoc import write_section  # noqa: E402

from fleet.core.context import SessionContext  # noqa: E402
from fleet.core.kernel import ByteTokenizer  # noqa: E402
from workers.fleet import KernelFleet  # noqa: E402
from workers.spec import KernelSpec, make_kernel  # noqa: E402

SPEC = KernelSpec(block_size=16)
SYSTEM = "You are agent zero. Answer briefly."
IDS = [(i * 7 + 300) % 512 for i in range(4000)]


def history(ctx: SessionContext, cycles: int) -> None:
    for i in range(cycles):
        piece = ctx.add_output(IDS)
        ctx.add_output([i % 512])
        ctx.evict_piece(piece.piece_id, "exact")
    ctx.add_message("user", " and then?")


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def in_process(cycles_list: list[int]) -> list[dict[str, Any]]:
    kernel = make_kernel(SPEC)
    tok = ByteTokenizer(kernel.config.vocab_size)
    rows = []
    for cycles in cycles_list:
        ctx = SessionContext.new(kernel, tok)
        ctx.add_system(SYSTEM)
        history(ctx, cycles)
        ops, slow, fast = list(ctx.ops), [], []
        for _ in range(3):  # interleaved: the two ways see the same machine
            ts, a = timed(lambda ops=ops: SessionContext.replay(ops, kernel, tok, lambda r: b""))
            tf, b = timed(lambda ops=ops: SessionContext.replay_over(ops, kernel.session(), tok, lambda r: b""))
            assert a.digest() == b.digest() == ctx.digest()
            slow.append(ts)
            fast.append(tf)
        rows.append({"cycles": cycles, "ops": len(ops), "held": len(ctx.session),
                     "computed_slow": a.session.num_computed, "computed_fast": b.session.num_computed,
                     "slow_s": statistics.median(slow), "fast_s": statistics.median(fast)})
        print(rows[-1], flush=True)
    return rows


def on_a_fleet(cycles: int) -> dict[str, Any]:
    ray.init(num_cpus=2, namespace="kvfleet", include_dashboard=False, log_to_driver=False)
    out: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            f = KernelFleet(f"sqlite:///{tmp}/r.db", SPEC, call_timeout_s=300.0)
            try:
                for sid, mode in (("exact", "exact"), ("reposition", "reposition")):
                    f.create_session("t", sid, SYSTEM)
                    for i in range(cycles):
                        piece = f.append_output("t", sid, IDS).result.piece_id
                        f.append_output("t", sid, [i % 512])
                        f.evict("t", sid, piece, mode=mode)
                    f.append("t", sid, " and then?")
                    digest = f.digest("t", sid)
                    f.release_session("t", sid)
                    took, again = timed(lambda sid=sid: f.digest("t", sid))  # the next call regenerates it
                    info = f.info("t", sid)
                    assert again == digest
                    out[sid] = {"s": took, "computed": info["prefilled_tokens"], "held": info["tokens"],
                                "ops": info["replayed_ops"]}
                    print(sid, out[sid], flush=True)
            finally:
                f.shutdown()
    finally:
        ray.shutdown()
    return out


def report(rows: list[dict[str, Any]], fleet: dict[str, Any], cycles: int) -> str:
    lines = [
        "## Rebuilding a session: its history against what it holds (`python bench/session_replay.py`)",
        "",
        "One run on this machine's 2 shared cores. Each history appends 4,000 tokens, then one, then evicts the "
        "4,000 exactly, per cycle; the session ends holding its system prompt, the one-token pieces and a "
        "message. **Part 1**, in one process on the same logs (the demo's synthetic model, numpy, block 16; "
        "median of 3, the two ways interleaved; digests equal): `SessionContext.replay` runs every op through "
        "the model again, `replay_over` on a fresh session replays the ledger and prefills the final tokens once.",
        "",
        "| cycles | ops | tokens held | op by op: computed / s | ledger + once: computed / s | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['cycles']} | {r['ops']} | {r['held']} | {r['computed_slow']:,} / {r['slow_s']:.2f} | "
                     f"{r['computed_fast']:,} / {1000 * r['fast_s']:.1f} ms | {r['slow_s'] / r['fast_s']:,.0f}x |")
    e, p = fleet["exact"], fleet["reposition"]
    lines += [
        "",
        f"**Part 2**, the real path: a KernelFleet on a local Ray (2 CPUs) and SQLite, a session with {cycles} "
        "cycles released by the idle reaper's call, then its next call, which its host answers by regenerating "
        "it (timed from the caller, digest equal to before the release). With exact evictions the host replays "
        f"the ledger and computes {e['computed']:,} tokens in {e['s']:.2f} s; the same history with reposition "
        f"evictions, whose survivors' KV was computed with the span, must go op by op: {p['computed']:,} tokens "
        f"in {p['s']:.2f} s ({p['s'] / e['s']:.0f}x). Both logs hold {e['ops']} ops.",
        "",
        "A tenant's history is bounded apart from this (`--max-history-tokens-per-tenant`, docs/api.md): the "
        "ledger replay still reads every op and re-tokenizes every tool result the log names.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, nargs="+", default=[10, 30, 60])
    ap.add_argument("--fleet-cycles", type=int, default=30)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    rows = in_process(a.cycles)
    fleet = on_a_fleet(a.fleet_cycles)
    body = report(rows, fleet, a.fleet_cycles)
    print(body)
    if not a.no_docs:
        write_section("session-replay", body)


if __name__ == "__main__":
    main()
