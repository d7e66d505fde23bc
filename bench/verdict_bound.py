"""What the per-tenant bound on cached verdicts costs on the request path, on SQLite and Redis, side by side.

A verdict-cache miss writes one entry. Before the bound it was `kv_put` (SQLite INSERT OR REPLACE, Redis HSET); now
it is `kv_put_bounded` (the count and the insert in one transaction / one EVALSHA), and a tenant with a heavy layer
reads `kv_len` once per first sighting of a clean text. On SQLite every kv insert also runs the key-count trigger:
measured against a file without it. Each call is timed on a fresh key of a namespace already holding `--rows` keys
(a full-sized tenant); the contenders alternate per round (`--rounds`), and the medians of the rounds' medians are
reported with their ranges. Also: the Redis memory one verdict entry takes in a tenant's hash (INFO used_memory).

    python bench/verdict_bound.py [--rows 100000] [--calls 2000] [--rounds 3] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchdoc import write_section  # noqa: E402

from fleet.app.redis_server import RedisServer  # noqa: E402
from fleet.cas import open_store  # noqa: E402

VALUE = json.dumps({"quarantined": False, "reasons": [], "score": 0.0, "learned_score": 0.0123,
                    "encoder_score": None, "used": 1.7e9}, sort_keys=True).encode()


def _key(i: int) -> str:
    return f"{i:064x}:det-0123456789ab.0123456789ab"


def _fill(store: object, ns: str, rows: int) -> None:
    for i in range(rows):
        store.kv_put(ns, _key(i), VALUE)  # type: ignore[attr-defined]


def _time(fn: Callable[[int], object], start: int, calls: int) -> float:
    """Median microseconds of `calls` calls of fn(i), i from `start` (fresh keys)."""
    out = []
    for i in range(start, start + calls):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def _cells(store: object, ns: str, rows: int, calls: int, rounds: int, bare: object | None) -> dict[str, list[float]]:
    cells: dict[str, list[float]] = {}
    nxt = [rows + 1]
    put_name = "kv_put (with the count trigger)" if bare is not None else "kv_put (the miss's write before)"
    contenders: dict[str, Callable[[int], object]] = {
        put_name: lambda i: store.kv_put(ns, _key(i), VALUE),  # type: ignore[attr-defined]
        "kv_put_bounded (the miss's write now)": lambda i: store.kv_put_bounded(ns, _key(i), VALUE, 10**9),  # type: ignore[attr-defined]
        "kv_len (once per first clean sighting, heavy layer only)": lambda i: store.kv_len(ns),  # type: ignore[attr-defined]
    }
    if bare is not None:
        contenders["kv_put on a file without the count trigger (the tree before)"] = lambda i: bare.kv_put(ns, _key(i), VALUE)  # type: ignore[attr-defined]
    for _ in range(rounds):
        for name, fn in contenders.items():
            cells.setdefault(name, []).append(_time(fn, nxt[0], calls))
            nxt[0] += calls
    return cells


def _sqlite(rows: int, calls: int, rounds: int) -> dict[str, list[float]]:
    d = tempfile.mkdtemp(prefix="kvf-vbound-")
    store, bare = open_store(f"sqlite:///{d}/a.db"), open_store(f"sqlite:///{d}/b.db")
    bare._db.executescript("DROP TRIGGER kv_count_in; DROP TRIGGER kv_count_out;")  # type: ignore[attr-defined]
    try:
        for s in (store, bare):
            _fill(s, "quarantine.verdicts/acme", rows)
        return _cells(store, "quarantine.verdicts/acme", rows, calls, rounds, bare)
    finally:
        store.close()
        bare.close()


def _redis(rows: int, calls: int, rounds: int) -> tuple[dict[str, list[float]], float]:
    with RedisServer() as srv:
        srv.start()
        store = open_store(srv.url)
        try:
            before = int(store.r.info("memory")["used_memory"])  # type: ignore[attr-defined]
            _fill(store, "quarantine.verdicts/acme", rows)
            per_entry = (int(store.r.info("memory")["used_memory"]) - before) / rows  # type: ignore[attr-defined]
            return _cells(store, "quarantine.verdicts/acme", rows, calls, rounds, None), per_entry
        finally:
            store.close()


def _table(cells: dict[str, list[float]]) -> list[str]:
    return [f"| {name} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |" for name, v in cells.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    lite = _sqlite(a.rows, a.calls, a.rounds)
    red, per_entry = _redis(a.rows, a.calls, a.rounds)
    body = "\n".join([
        "## Verdict cache: the per-tenant bound's cost (`python bench/verdict_bound.py`)", "",
        f"One call on a fresh key of a tenant's verdict namespace holding {a.rows:,} keys; median of each round's "
        f"median over {a.calls:,} calls, {a.rounds} rounds interleaved (range across rounds), microseconds. "
        "One process, loopback Redis (AOF as `fleet/app/redis_server.py` runs it).", "",
        "| SQLite | median us | range |", "|---|---|---|", *_table(lite), "",
        "| Redis | median us | range |", "|---|---|---|", *_table(red), "",
        f"Redis memory per verdict entry in a tenant's hash: {per_entry:.0f} B "
        f"(250,000 entries: {250_000 * per_entry / 1e6:.0f} MB).",
    ])
    print(body)
    if not a.no_docs:
        write_section("verdict-bound", body)


if __name__ == "__main__":
    main()
