"""Cost of one session call through Ray (bench 4): KernelFleet.append vs bare Ray actor calls.

Three calls, side by side in one run, same machine, same single-token append:
  bare ping      an empty async Ray actor method (the floor of any actor call)
  bare append    a Ray actor holding a kernel session, append without op log or registry
  fleet append   KernelFleet.append: registry lookup, named-actor lookup, op log write before ack

    python bench/session_call_cost.py [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ray

from workers.fleet import KernelFleet
from workers.spec import KernelSpec, make_kernel

SPEC = KernelSpec(block_size=16)


@ray.remote(num_cpus=0.05)
class BareActor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.session = make_kernel(KernelSpec.from_dict(spec)).session()
        self.session.append(list(b"You are agent zero. Answer briefly."))

    async def ping(self) -> str:
        return "ok"

    async def append(self, tokens: list[int]) -> Any:
        return self.session.append(tokens)


def timed(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(10):
        fn()                                          # warm-up
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    ray.init(num_cpus=2, namespace="kvfleet", include_dashboard=False, log_to_driver=False)
    bare = BareActor.remote(SPEC.to_dict())
    with tempfile.TemporaryDirectory() as tmp:
        fleet = KernelFleet(f"sqlite:///{tmp}/bench.db", SPEC)
        fleet.create_session("bench", "s", "You are agent zero. Answer briefly.")
        ping = timed(lambda: ray.get(bare.ping.remote()), args.calls)
        bare_append = timed(lambda: ray.get(bare.append.remote([42])), args.calls)
        fleet_append = timed(lambda: fleet.append("bench", "s", [42]), args.calls)
        fleet.shutdown()
    ray.shutdown()
    rows = [("bare Ray actor ping", ping), ("bare Ray actor kernel append", bare_append),
            ("KernelFleet.append (SessionContext, op log)", fleet_append)]
    md = "\n".join(["| call | median µs | × bare append |", "|---|---|---|"] +
                   [f"| {name} | {us:.0f} | {us / bare_append:.2f} |" for name, us in rows])
    print(md)
    from radix_traces import write_section

    write_section("session-call", f"""
## Session call cost through Ray (`python bench/session_call_cost.py`)

Median of {args.calls} single-token appends on one session (tiny synthetic model, numpy
backend, SQLite store), all three measured in one run on the same machine. The fleet call adds
the op-log write that must land before the reply (the actor handle is cached after the first call).

{md}
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
