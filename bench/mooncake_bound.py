"""How many prefill tokens can *any* router save on the Mooncake conversation trace? An offline bound.

The routing bench (bench/fleet_routing.py, cell `mooncake`) replays the trace through real routers and
stand-in workers; this script asks what placement alone could do there, with no clock, no load and no
lifecycle: each worker is an LRU cache of blocks (vLLM's prefix cache evicts its least recently used
free blocks first), each request hits the longest prefix of its block hashes resident on the worker it
is sent to, then its blocks become the most recently used there. Policies:

- `round-robin`: no cache awareness, the floor.
- `affinity`: the worker with the longest resident prefix beyond the request's shared prefix (a block
  seen followed by three different blocks, e.g. the trace's common first block: every worker holds it,
  so it must not glue every request to the first worker), ties to the one that has prefilled least.
  The ideal cache-aware router: it never trades a hit for load (vLLM's kv_aware and kvfleet do).
- `oracle-tiers`: knows the future: a request whose blocks recur later goes to a "keep" tier of workers,
  one that never returns to a separate "scratch" worker unless its prefix is resident elsewhere, so
  one-shots cannot evict conversations that come back (what a perfect return predictor could do).
- `scratch-tier`: the oracle's tiers without the oracle, as an online router could run them: a request with
  nothing beyond its shared prefix resident anywhere (a new conversation, or one whose blocks are gone) goes to
  the scratch worker, any other to its holder (as `affinity`), so it stays on the tier it began on.
- `pooled-lru`: one LRU cache of all workers' blocks together (affinity with perfect sharing).
- `unbounded`: every block ever seen stays (the trace's own reuse; no router can beat it).

A router's prefilled tokens are (1 - hit rate) x prompt tokens, so the most any router can save against
a router with hit rate h is (1 - h) / (1 - h_unbounded); against `affinity` at the same cache size, the
table shows what smarter placement under LRU bought (oracle-tiers) and what only more cache would buy.

    python bench/mooncake_bound.py                       # the committed 1,500-request slice
    python bench/mooncake_bound.py --trace PATH --requests 3000 --no-docs
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402
from mooncake import SOURCE, load  # noqa: E402

Run = tuple[
    int, int, list[dict[str, object]], tuple[float, float], dict[int, float]
]  # requests, distinct blocks, rows, return rates, reuse only from blocks first seen within each window (ms)


class LRU:
    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.prefilled = 0

    def match(self, chain: Sequence[int]) -> int:
        k = 0
        for h in chain:
            if h not in self.blocks:
                break
            k += 1
        return k

    def run(self, chain: Sequence[int], hit: int) -> None:
        self.prefilled += len(chain) - hit
        for h in chain:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        if self.capacity is not None:
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)


def _best(among: Sequence[int], m: list[int], shared: int, workers: list[LRU]) -> int:
    """The longest resident prefix beyond the shared one, then the worker that has prefilled least."""
    return max(among, key=lambda j: (m[j] if m[j] > shared else 0, -workers[j].prefilled))


def replay(rows: list[dict], num_workers: int, capacity: int | None, policy: str) -> dict[str, float]:
    chains: list[list[int]] = [r["hash_ids"] for r in rows]
    last = {}
    for i, c in enumerate(chains):
        for h in c:
            last[h] = i
    recurs = [any(last[h] > i for h in c[1:]) for i, c in enumerate(chains)]
    if policy in ("pooled-lru", "unbounded"):
        workers = [LRU(None if policy == "unbounded" else capacity * num_workers)]
    else:
        workers = [LRU(capacity) for _ in range(num_workers)]
    everyone = range(len(workers))
    after: dict[int, set[int]] = {}
    total = hit = 0
    for i, chain in enumerate(chains):
        m = [w.match(chain) for w in workers]
        shared = 0
        for k, h in enumerate(chain[:-1]):
            nxt = after.setdefault(h, set())
            nxt.add(chain[k + 1])
            if len(nxt) >= 3:
                shared = k + 1

        if policy == "round-robin":
            j = i % len(workers)
        elif policy == "scratch-tier" and len(workers) > 1:
            j = _best(everyone, m, shared, workers)
            if m[j] <= shared:
                j = 0
        elif policy == "oracle-tiers" and len(workers) > 1:
            keep = range(1, len(workers))
            if recurs[i]:
                j = _best(keep, m, shared, workers)
            else:
                j = _best(everyone, m, shared, workers)
                if m[j] <= shared:  # nothing but a shared prefix is resident anywhere
                    j = 0
        else:
            j = _best(everyone, m, shared, workers)
        total += len(chain)
        hit += m[j]
        workers[j].run(chain, m[j])
    loads = [w.prefilled for w in workers]
    return {"hit": hit / total, "blocks": total, "max_load_share": max(loads) / max(1, sum(loads))}


def return_rates(rows: list[dict]) -> tuple[float, float]:
    """Share of first requests (their second block never seen before) and of later turns whose own
    blocks recur later: the signal a router has, at routing time, that a request will come back."""
    chains = [r["hash_ids"] for r in rows]
    last = {h: i for i, c in enumerate(chains) for h in c}
    seen: set[int] = set()
    n = {True: [0, 0], False: [0, 0]}
    for i, c in enumerate(chains):
        later = len(c) > 1 and c[1] in seen
        n[later][0] += 1
        n[later][1] += any(last[h] > i for h in c[1:])
        seen.update(c)
    return n[False][1] / max(1, n[False][0]), n[True][1] / max(1, n[True][0])


FRESH_WINDOWS_MS = (500, 5000)  # trace time; the routing bench's cells run it 10x faster (50 and 500 ms)


def fresh_reuse(rows: list[dict], window_ms: float) -> float:
    """Share of prompt blocks that are reusable (in the request's leading run of blocks seen before) only thanks to a
    block first seen less than `window_ms` earlier: what a router gains at most by crediting blocks still being
    computed (routed, not yet stored) on the worker they went to, as text-matching routers do at route time."""
    first: dict[int, float] = {}
    fresh = total = 0
    for r in rows:
        t, chain = r["timestamp"], r["hash_ids"]
        k = 0
        while k < len(chain) and chain[k] in first:
            k += 1
        fresh += sum(1 for h in chain[:k] if t - first[h] < window_ms)
        total += len(chain)
        for h in chain:
            first.setdefault(h, t)
    return fresh / max(1, total)


POLICIES = ("round-robin", "affinity", "oracle-tiers", "scratch-tier", "pooled-lru", "unbounded")


def table(rows: list[dict], num_workers: int, capacities: Sequence[int]) -> list[dict[str, object]]:
    out = []
    unbounded = replay(rows, num_workers, None, "unbounded")["hit"]
    for cap in capacities:
        res = {p: replay(rows, num_workers, cap, p) for p in POLICIES if p != "unbounded"}
        aff = res["affinity"]["hit"]
        out.append(
            {
                "capacity": cap,
                **{p: round(r["hit"], 4) for p, r in res.items()},
                **{f"{p}_max_share": round(res[p]["max_load_share"], 3) for p in ("oracle-tiers", "scratch-tier")},
                "unbounded": round(unbounded, 4),
                "oracle_vs_affinity": round((1 - aff) / (1 - res["oracle-tiers"]["hit"]), 3),
                "scratch_vs_affinity": round((1 - aff) / (1 - res["scratch-tier"]["hit"]), 3),
                "bound_vs_affinity": round((1 - aff) / (1 - unbounded), 3),
            }
        )
    return out


def section(source: str, num_workers: int, runs: list[Run]) -> str:
    lines = [
        "## Mooncake: what placement alone can save (`bench/mooncake_bound.py`)",
        "",
        f"An offline replay of {source} through {num_workers} per-worker LRU block caches: no clock, no "
        "load, no lifecycle (the module's docstring defines each policy). Hit rate = share of prompt blocks "
        "found resident on the chosen worker. Capacities are per worker, in trace blocks (one trace block is "
        "one 16-token stand-in block in the routing bench's mooncake cells: very-tight 2,285, tight 6,856).",
        "",
        "| requests (distinct blocks) | blocks per worker | round-robin | affinity | oracle-tiers | scratch-tier "
        "| pooled LRU | unbounded | affinity prefill / oracle-tiers | affinity prefill / scratch-tier "
        "| affinity prefill / unbounded | busiest worker's prefill share: oracle-tiers / scratch-tier |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, distinct, out, _, _ in runs:
        for r in out:
            lines.append(
                f"| {n:,} ({distinct:,}) | {r['capacity']:,} | {r['round-robin']:.3f} | {r['affinity']:.3f} | "
                f"{r['oracle-tiers']:.3f} | {r['scratch-tier']:.3f} | {r['pooled-lru']:.3f} | {r['unbounded']:.3f} | "
                f"{r['oracle_vs_affinity']:.3f}x | {r['scratch_vs_affinity']:.3f}x | {r['bound_vs_affinity']:.3f}x | "
                f"{100 * r['oracle-tiers_max_share']:.0f}% / {100 * r['scratch-tier_max_share']:.0f}% |"
            )
    lines.append("")
    for n, _, _, (first, later), _ in runs:
        lines.append(
            f"- Of the first {n:,} requests: {100 * first:.0f}% of first requests and {100 * later:.0f}% "
            "of later turns come back (their own blocks recur later)."
        )
    for n, _, _, _, fresh in runs:
        lines.append(
            f"- Of the first {n:,} requests' prompt blocks, reusable only from a block first seen less than "
            + " / ".join(f"{w / 1000:g} s" for w in fresh) + " before (trace time): "
            + " / ".join(f"{100 * v:.2f}%" for v in fresh.values())
            + ". A router that credits blocks still being computed on their worker (as text-matching routers do at "
            "route time) gains at most that."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=SOURCE)
    ap.add_argument("--requests", default="600,1500", help="comma-separated slice lengths (first N requests)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--capacities", default="1000,2285,4000,6856,12000")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--notes", type=Path, help="markdown appended to the section")
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args(argv)
    caps = [int(c) for c in a.capacities.split(",") if c]
    runs: list[Run] = []
    for n in (int(x) for x in a.requests.split(",") if x):
        rows = load(a.trace, n)
        out = table(rows, a.workers, caps)
        fresh = {w: fresh_reuse(rows, w) for w in FRESH_WINDOWS_MS}
        runs.append((len(rows), len({h for r in rows for h in r["hash_ids"]}), out, return_rates(rows), fresh))
        for r in out:
            print(json.dumps({"requests": len(rows), **r}))
    if a.json:
        a.json.write_text(json.dumps(runs, indent=1))
    src = "the committed slice of the Mooncake conversation trace" if a.trace == SOURCE else a.trace.name
    body = section(src, a.workers, runs)
    if a.notes:
        body += "\n" + a.notes.read_text()
    print(body)
    if not a.no_docs:
        benchdoc.write_section("mooncake-bound", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
