"""A small read's latency on the store beside large writes, this tree against another, side by side.

SQLite (`--store sqlite`, the default): one store file (WAL, synchronous FULL, the embedded default). Three
writer threads put 32 MiB blobs back to back (each under a tenant of its own, so no quota stops them); one
reader thread stat()s a small blob every 5 ms and times each call.

Redis (`--store redis`): a real redis-server with AOF on and `appendfsync always`, as the Helm chart runs it
(fleet/app/redis_server.py). The three writer threads run in a process of their own, as the review's
reproduction did; each writer's store has a lease of 0 and runs the store's GC after each put, so Redis holds
a few blobs, not every blob the run wrote. The reader thread is as above, in the measuring process.

Each tree runs in its own process (`--against REV`: a git worktree of that revision), one after the other, for
`--seconds` each, `--rounds` times interleaved, so the machine's load is shared.

    python bench/store_reads.py [--store sqlite|redis] [--against REV] [--seconds 6] [--rounds 2] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchdoc import write_section  # noqa: E402
from worktree import worktree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WRITERS, BLOB_MIB, READ_EVERY_S = 3, 32, 0.005


def write(store: Any, seconds: float, *, collect: bool) -> int:
    """WRITERS threads putting BLOB_MIB blobs back to back for `seconds` (each blob a tenant of its own);
    `collect`: run the store's GC after each put. Returns the puts done."""
    stop, puts = threading.Event(), [0] * WRITERS

    def writer(k: int) -> None:
        while not stop.is_set():
            store.put(os.urandom(16) + bytes(BLOB_MIB << 20), f"w{k}-{puts[k]}")
            puts[k] += 1
            if collect:
                store.gc()

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(WRITERS)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(puts)


def read(store: Any, ref: str, seconds: float) -> list[float]:
    """stat() `ref` every READ_EVERY_S for `seconds`; each call's latency in ms."""
    lat, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        store.stat(ref, "reader")
        lat.append((time.perf_counter() - t0) * 1e3)
        time.sleep(READ_EVERY_S)
    return lat


def scenario(seconds: float) -> dict[str, Any]:
    from fleet.cas import open_store  # noqa: PLC0415 - the tree under test, from PYTHONPATH

    with tempfile.TemporaryDirectory(prefix="kvf-store-reads-") as d:
        store = open_store(f"sqlite:///{d}/kv.db")
        ref = store.put(b"a small blob", "reader")
        writers: list[int] = []
        t = threading.Thread(target=lambda: writers.append(write(store, seconds, collect=False)))
        t.start()
        lat = read(store, ref, seconds)
        t.join()
        store.close()
    return {"lat_ms": lat, "puts": writers[0]}


def scenario_redis(seconds: float) -> dict[str, Any]:
    from fleet.app.redis_server import RedisServer  # noqa: PLC0415 - the tree under test, from PYTHONPATH
    from fleet.cas import open_store  # noqa: PLC0415

    with RedisServer() as srv:
        srv.start()
        store = open_store(srv.url)
        ref = store.put(b"a small blob", "reader")
        writers = subprocess.Popen([sys.executable, __file__, "--writer", srv.url, "--seconds", str(seconds)],
                                   stdout=subprocess.PIPE, text=True)
        assert writers.stdout is not None and writers.stdout.readline().strip() == "ready"
        lat = read(store, ref, seconds)
        puts = int(writers.communicate(timeout=120)[0].strip().splitlines()[-1])
        store.close()
    return {"lat_ms": lat, "puts": puts}


def writer_process(url: str, seconds: float) -> None:
    from fleet.cas import open_store  # noqa: PLC0415

    store = open_store(url, lease_s=0)
    print("ready", flush=True)
    print(write(store, seconds, collect=True), flush=True)
    store.close()


def run_tree(tree: Path, seconds: float, backend: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", "--store", backend, "--seconds", str(seconds)], cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


SETUPS = {
    "sqlite": "on one SQLite store",
    "redis": "on one redis-server (AOF, appendfsync always), in a process of their own, each put followed by "
             "the store's GC (lease 0)",
}


def report(runs: dict[str, list[dict[str, Any]]], seconds: float, backend: str) -> str:
    lines = [f"{WRITERS} writer threads putting {BLOB_MIB} MiB blobs back to back {SETUPS[backend]}; a reader "
             f"thread stat()s a small blob every {READ_EVERY_S * 1e3:.0f} ms for {seconds:g} s. Each tree in its "
             f"own process, interleaved, {len(next(iter(runs.values())))} rounds each; shared 2-core machine "
             f"(load {os.getloadavg()[0]:.1f} at the end).", "",
             "| tree | reads done | stat p50 ms | p99 ms | max ms | 32 MiB puts done |", "|---|---:|---:|---:|---:|---:|"]
    for name, rs in runs.items():
        lat = sorted(x for r in rs for x in r["lat_ms"])
        lines.append(f"| {name} | {len(lat)} | {statistics.median(lat):.2f} | {lat[int(0.99 * (len(lat) - 1))]:.1f} | "
                     f"{lat[-1]:.1f} | {sum(r['puts'] for r in rs)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=None, help="a git revision to run beside this tree")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--store", choices=sorted(SETUPS), default="sqlite", help="the backend under the reads")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--writer", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.writer:
        writer_process(a.writer, a.seconds)
        return
    if a.child:
        print(json.dumps((scenario_redis if a.store == "redis" else scenario)(a.seconds)))
        return
    runs: dict[str, list[dict[str, Any]]] = {"this tree": []}
    if a.against:
        runs[f"at {a.against}"] = []
    with worktree(a.against or "HEAD") as other:
        for _ in range(a.rounds):
            runs["this tree"].append(run_tree(ROOT, a.seconds, a.store))
            if a.against:
                runs[f"at {a.against}"].append(run_tree(other, a.seconds, a.store))
    title, section = (("Redis store", "store-reads-redis") if a.store == "redis" else ("SQLite store", "store-reads"))
    flag = " --store redis" if a.store == "redis" else ""
    body = f"## {title}: reads beside large writes (`python bench/store_reads.py{flag} --against REV`)\n\n" + \
           report(runs, a.seconds, a.store)
    print(body)
    if not a.no_docs:
        write_section(section, body)


if __name__ == "__main__":
    main()
