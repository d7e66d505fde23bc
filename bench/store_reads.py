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

`--load get` (Redis only): the three threads each get() a 32 MiB blob of their own, back to back, instead.

    python bench/store_reads.py [--store sqlite|redis] [--load put|get] [--against REV] [--seconds 6] [--rounds 2]
                                [--no-docs]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchdoc import write_section  # noqa: E402
from worktree import worktree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WRITERS, BLOB_MIB, READ_EVERY_S = 3, 32, 0.005


def busy(seconds: float, step: Callable[[int], object]) -> int:
    """WRITERS threads running `step(thread index)` back to back for `seconds`; returns the steps done."""
    stop, done = threading.Event(), [0] * WRITERS

    def loop(k: int) -> None:
        while not stop.is_set():
            step(k)
            done[k] += 1

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(WRITERS)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(done)


def write(store: Any, seconds: float, *, collect: bool) -> int:
    """Each thread puts BLOB_MIB blobs (each a tenant of its own); `collect`: the store's GC after each put."""
    def put(k: int) -> None:
        store.put(os.urandom(16) + bytes(BLOB_MIB << 20), f"w{k}-{os.urandom(4).hex()}")
        if collect:
            store.gc()

    return busy(seconds, put)


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


def scenario_redis(seconds: float, load: str) -> dict[str, Any]:
    from fleet.app.redis_server import RedisServer  # noqa: PLC0415 - the tree under test, from PYTHONPATH
    from fleet.cas import open_store  # noqa: PLC0415

    with RedisServer() as srv:
        srv.start()
        store = open_store(srv.url)
        ref = store.put(b"a small blob", "reader")
        writers = subprocess.Popen([sys.executable, __file__, "--writer", srv.url, "--store", "redis", "--load", load,
                                    "--seconds", str(seconds)], stdout=subprocess.PIPE, text=True)
        assert writers.stdout is not None and writers.stdout.readline().strip() == "ready"
        lat = read(store, ref, seconds)
        puts = int(writers.communicate(timeout=120)[0].strip().splitlines()[-1])
        store.close()
    return {"lat_ms": lat, "puts": puts}


def writer_process(url: str, seconds: float, load: str) -> None:
    """put: WRITERS threads putting (GC after each put, lease 0); get: each thread get()s a blob of its own."""
    from fleet.cas import open_store  # noqa: PLC0415

    store = open_store(url, lease_s=0 if load == "put" else 600)
    refs = [store.put(os.urandom(16) + bytes(BLOB_MIB << 20), f"g{k}") for k in range(WRITERS)] if load == "get" else []
    print("ready", flush=True)
    if load == "get":
        print(busy(seconds, lambda k: store.get(refs[k], f"g{k}")), flush=True)
    else:
        print(write(store, seconds, collect=True), flush=True)
    store.close()


def run_tree(tree: Path, seconds: float, backend: str, load: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", "--store", backend, "--load", load,
                          "--seconds", str(seconds)], cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


SETUPS = {
    "sqlite": "on one SQLite store",
    "redis": "on one redis-server (AOF, appendfsync always), in a process of their own, each put followed by "
             "the store's GC (lease 0)",
}
LOADS = {"put": "putting {mib} MiB blobs back to back", "get": "each get()ting a {mib} MiB blob of its own back to back"}


def report(runs: dict[str, list[dict[str, Any]]], seconds: float, backend: str, load: str) -> str:
    setup = SETUPS[backend] if load == "put" else "on one redis-server (AOF, appendfsync always), in a process of their own"
    lines = [f"{WRITERS} threads {LOADS[load].format(mib=BLOB_MIB)} {setup}; a reader "
             f"thread stat()s a small blob every {READ_EVERY_S * 1e3:.0f} ms for {seconds:g} s. Each tree in its "
             f"own process, interleaved, {len(next(iter(runs.values())))} rounds each; shared 2-core machine "
             f"(load {os.getloadavg()[0]:.1f} at the end).", "",
             f"| tree | reads done | stat p50 ms | p99 ms | max ms | {BLOB_MIB} MiB {load}s done |",
             "|---|---:|---:|---:|---:|---:|"]
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
    ap.add_argument("--load", choices=sorted(LOADS), default="put", help="what the busy tenants do (get: redis only)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--writer", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.load == "get" and a.store != "redis":
        ap.error("--load get runs on --store redis only")
    if a.writer:
        writer_process(a.writer, a.seconds, a.load)
        return
    if a.child:
        print(json.dumps(scenario_redis(a.seconds, a.load) if a.store == "redis" else scenario(a.seconds)))
        return
    runs: dict[str, list[dict[str, Any]]] = {"this tree": []}
    if a.against:
        runs[f"at {a.against}"] = []
    with worktree(a.against or "HEAD") as other:
        for _ in range(a.rounds):
            runs["this tree"].append(run_tree(ROOT, a.seconds, a.store, a.load))
            if a.against:
                runs[f"at {a.against}"].append(run_tree(other, a.seconds, a.store, a.load))
    print(body := f"## {TITLES[a.store, a.load][0]} (`python bench/store_reads.py{TITLES[a.store, a.load][2]} "
                  f"--against REV`)\n\n" + report(runs, a.seconds, a.store, a.load))
    if not a.no_docs:
        write_section(TITLES[a.store, a.load][1], body)


# (store, load) -> section title, docs/benchmarks.md section, flags
TITLES = {
    ("sqlite", "put"): ("SQLite store: reads beside large writes", "store-reads", ""),
    ("redis", "put"): ("Redis store: reads beside large writes", "store-reads-redis", " --store redis"),
    ("redis", "get"): ("Redis store: reads beside large reads", "store-reads-redis-get", " --store redis --load get"),
}


if __name__ == "__main__":
    main()
