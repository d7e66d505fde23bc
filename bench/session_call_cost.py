"""Cost of one session call (bench 4): through gRPC and Ray, through Ray, and a bare Ray actor call.

Side by side in one run, same machine, same single-token append, samples interleaved call by call
(so a noisy neighbour slows every path alike):
  bare ping      an empty async Ray actor method (the floor of any actor call)
  bare append    a Ray actor holding a kernel session, append without op log or registry
  fleet append   KernelFleet.append: registry lookup, named-actor lookup, op log write before ack
  gRPC append    FleetClient.append -> controller (SessionService, 127.0.0.1) -> KernelFleet.append
                 (with and without the logits in the reply)

Then the memory of 8 forks of a long session: sharing the parent's blocks (KernelFleet.fork)
vs each fork replaying the parent's log (share=False, a private copy each).

    python bench/session_call_cost.py [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray

from workers.fleet import KernelFleet
from workers.spec import KernelSpec, make_kernel

SPEC = KernelSpec(block_size=16)
PROMPT = "You are agent zero. Answer briefly."
NUM_FORKS = 8


@ray.remote(num_cpus=0.05)
class BareActor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.session = make_kernel(KernelSpec.from_dict(spec)).session()
        self.session.append(list(PROMPT.encode()))

    async def ping(self) -> str:
        return "ok"

    async def append(self, tokens: list[int]) -> Any:
        return self.session.append(tokens)


def interleaved(fns: dict[str, Callable[[], Any]], calls: int) -> dict[str, float]:
    """Median µs per call of each fn; one call of each per round, so all see the same machine."""
    for fn in fns.values():
        for _ in range(10):
            fn()                                      # warm-up
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


@contextmanager
def controller(store_url: str) -> Iterator[str]:
    """A controller (auth off) serving on 127.0.0.1 from a background event loop; yields its address."""
    from controller.config import ControllerConfig
    from controller.server import build_server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = ControllerConfig(listen="127.0.0.1:0", store_url=store_url)
    ctl = asyncio.run_coroutine_threadsafe(build_server(cfg), loop).result(60)
    try:
        yield str(ctl.address)
    finally:
        asyncio.run_coroutine_threadsafe(ctl.stop(grace=1), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def call_costs(tmp: str, calls: int) -> list[tuple[str, float]]:
    from fleet.sdk import FleetClient

    bare = BareActor.remote(SPEC.to_dict())  # type: ignore[attr-defined]
    fleet = KernelFleet(f"sqlite:///{tmp}/direct.db", SPEC)
    fleet.create_session("bench", "s", PROMPT)
    with controller(f"sqlite:///{tmp}/controller.db") as address:
        client = FleetClient(address, timeout=60.0)
        client.create_session("s", PROMPT)
        client.create_session("s2", PROMPT)
        us = interleaved({
            "ping": lambda: ray.get(bare.ping.remote()),
            "bare": lambda: ray.get(bare.append.remote([42])),
            "fleet": lambda: fleet.append("bench", "s", [42]),
            "grpc": lambda: client.append("s", [42]),
            "grpc_logits": lambda: client.append("s2", [42], return_logits=True),
        }, calls)
        client.close()
    fleet.shutdown()
    ray.kill(bare)
    return [("bare Ray actor ping", us["ping"]), ("bare Ray actor kernel append", us["bare"]),
            ("KernelFleet.append (SessionContext, op log; logits back)", us["fleet"]),
            ("gRPC FleetClient.append → controller → KernelFleet (no logits)", us["grpc"]),
            ("gRPC FleetClient.append (logits back)", us["grpc_logits"])]


def _span(ns: list[int]) -> str:
    return f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"


def fork_memory(tmp: str) -> dict[str, Any]:
    """8 forks of a long session, sharing vs replaying: bytes held, median seconds per fork."""
    fleet = KernelFleet(f"sqlite:///{tmp}/forks.db", SPEC)
    text = "".join(random.Random(1).choices("abcdefgh ijklmnop.", k=1500))
    fleet.create_session("bench", "root", PROMPT)
    fleet.append("bench", "root", text)
    out: dict[str, Any] = {"tokens": len(fleet.tokens("bench", "root")), "suffix": []}
    for mode, share in (("shared", True), ("replayed", False)):
        secs, ids = [], [f"{mode}{i}" for i in range(NUM_FORKS)]
        for i, child in enumerate(ids):
            t0 = time.perf_counter()
            fleet.fork("bench", "root", child, share=share)
            secs.append(time.perf_counter() - t0)
            before = len(fleet.tokens("bench", child))
            fleet.append("bench", child, f" branch {i}: try the next step.")
            out["suffix"].append(len(fleet.tokens("bench", child)) - before)
        rows = [fleet.info("bench", c) for c in ids]
        shared_once = max(r["bytes_shared"] for r in rows)   # every fork adopts the same object-store blocks
        out[mode] = {"alone": sum(r["bytes_alone"] for r in rows), "shared": shared_once,
                     "total": sum(r["bytes_alone"] for r in rows) + shared_once, "s": statistics.median(secs)}
    root = fleet.info("bench", "root")
    out["root"] = root["bytes_alone"] + root["bytes_shared"]
    fleet.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    ray.init(num_cpus=2, namespace="kvfleet", include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        rows = call_costs(tmp, args.calls)
        forks = fork_memory(tmp)
    ray.shutdown()
    bare_append, fleet_append = rows[1][1], rows[2][1]
    md = "\n".join(["| call | median µs | × bare append | × KernelFleet.append |", "|---|---|---|---|"] +
                   [f"| {name} | {us:.0f} | {us / bare_append:.2f} | {us / fleet_append:.2f} |" for name, us in rows])
    sh, rp = forks["shared"], forks["replayed"]
    fk = "\n".join([
        "| 8 forks | bytes held alone (Σ forks) | shared, once | total | × sharing | median s per fork |",
        "|---|---|---|---|---|---|",
        f"| sharing the parent's blocks | {sh['alone']:,} | {sh['shared']:,} | {sh['total']:,} | 1.00 | {sh['s']:.2f} |",
        f"| replaying the parent's log (share=False) | {rp['alone']:,} | {rp['shared']:,} | {rp['total']:,} | "
        f"{rp['total'] / sh['total']:.2f} | {rp['s']:.2f} |"])
    print(md, fk, sep="\n\n")
    from benchdoc import write_section

    write_section("session-call", f"""
## Session call cost through gRPC and Ray (`python bench/session_call_cost.py`)

Median of {args.calls} single-token appends per path (tiny synthetic model, numpy backend, SQLite
stores), all measured in one run on the same machine, samples interleaved call by call. The fleet
call adds the op-log write that must land before the reply (the actor handle is cached after the
first call); the gRPC call adds the SDK, a loopback gRPC hop and the controller's SessionService,
which calls the same KernelFleet off its event loop.

{md}

Fork memory: {NUM_FORKS} forks of a {forks['tokens']}-token session, each then appending its own
{_span(forks['suffix'])}-token suffix (KV bytes from each session's `memory()`; "shared, once" is the object-store
copy of the parent's blocks that every sharing fork adopted; the parent itself holds
{forks['root']:,} B either way). Sharing costs about the prefix once plus {NUM_FORKS} suffixes; replay
costs {NUM_FORKS} full copies and recomputes the prefix in every fork. The time of a fork is mostly
the start of its actor (a new Ray worker process), so on this tiny model the two take about as long.

{fk}
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
