"""One tenant floods the quarantine judge; does another tenant stay fast? (issue #28, tenants isolated)

A real `kvfleet controller` process (SQLite store, loopback gRPC). Tenant acme judges with the heaviest opt-in
policy (rules, learned and the encoder: torch, which releases the GIL inside its ops); tenant bravo with
rules + learned. Two phases per configuration, in one run:

    idle    bravo alone, in a loop: WhoAmI, PutBlob (1 KiB, new bytes), JudgeToolResults (1 new 1 KiB text)
    flood   the same loop while acme keeps 5 JudgeToolResults calls of 24 distinct 1 KiB texts in flight
            (a new call as soon as one returns): the judge threads never idle

Reported: bravo's p50 / p99 per call in each phase and their ratio (flood / idle), acme's texts judged
per second, and the controller process's CPU-seconds per second (from /proc). Configurations:
`default` (--judge-threads 2, 1 job in flight per tenant, 0.5 CPU-s/s per tenant; acme's requests wait for
rules + learned, the encoder runs in its lane in the background), `no budget` (--judge-cpu-per-tenant 0),
and `encoder only, inline` (acme's detector is the encoder alone, so every one of its texts is judged by
the encoder before its call returns: the GIL-heaviest load). The question it answers: are threads in the controller process enough, or must
judging move to another process? (docs/quarantine_path.md reads the answer from this table.)

    python bench/judge_isolation.py [--seconds 20] [--write-doc]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.auth import mint_token  # noqa: E402
from fleet.api.kvfleet.v1 import blobs_pb2, fleet_pb2  # noqa: E402
from fleet.api.kvfleet.v1 import quarantine_pb2 as qpb  # noqa: E402
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub  # noqa: E402
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub  # noqa: E402
from fleet.api.kvfleet.v1.quarantine_pb2_grpc import QuarantineServiceStub  # noqa: E402

WORDS = ("order shipped report value error line config user data file result json item status queue build "
         "deploy timeout retry cache index token worker prefix block hash the a of to and in for").split()
ACME = "rules,learned,encoder"
CONFIGS = {  # name: (acme's detector, extra controller flags)
    "default": (ACME, []),
    "no budget": (ACME, ["--judge-cpu-per-tenant", "0"]),
    "encoder only, inline": ("encoder", []),  # no fast layer: each of acme's texts waits for the encoder
}


def text(rnd: random.Random, size: int = 1024) -> bytes:
    return " ".join(rnd.choice(WORDS) for _ in range(size // 4)).encode()[:size]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """utime + stime of process `pid`, in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def bravo_loop(ch: grpc.aio.Channel, token: str, seconds: float, rnd: random.Random) -> dict[str, list[float]]:
    fleet, blobs, q = FleetServiceStub(ch), BlobServiceStub(ch), QuarantineServiceStub(ch)
    out: dict[str, list[float]] = {"WhoAmI": [], "PutBlob": [], "JudgeToolResults": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        await fleet.WhoAmI(fleet_pb2.WhoAmIRequest(), metadata=md(token))
        out["WhoAmI"].append(time.perf_counter() - t0)
        data = text(rnd)

        async def put(data: bytes = data) -> Any:
            yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(data)))
            yield blobs_pb2.PutBlobRequest(chunk=data)

        t0 = time.perf_counter()
        await blobs.PutBlob(put(), metadata=md(token))
        out["PutBlob"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await q.JudgeToolResults(qpb.JudgeToolResultsRequest(results=[text(rnd)], action="placeholder"),
                                 metadata=md(token))
        out["JudgeToolResults"].append(time.perf_counter() - t0)
    return out


async def flood(ch: grpc.aio.Channel, token: str, stop: asyncio.Event, rnd: random.Random) -> int:
    q, judged = QuarantineServiceStub(ch), 0

    async def one() -> None:
        nonlocal judged
        while not stop.is_set():
            r = await q.JudgeToolResults(qpb.JudgeToolResultsRequest(results=[text(rnd) for _ in range(24)],
                                                                     action="placeholder"), metadata=md(token))
            judged += len(r.judgements)

    tasks = [asyncio.ensure_future(one()) for _ in range(5)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return judged


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000


async def run_config(name: str, acme: str, extra: list[str], seconds: float, tmp: Path) -> dict[str, Any]:
    tokens = tmp / f"tokens-{abs(hash(name))}.json"
    a, b = mint_token(tokens, "acme", "tenant"), mint_token(tokens, "bravo", "tenant")
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from controller.main import main; sys.exit(main(sys.argv[1:]))",
           "--listen", f"127.0.0.1:{port}", "--store", f"sqlite:///{tmp / f'kv-{abs(hash(name))}.db'}",
           "--tokens-file", str(tokens), "--detector-layers", "rules,learned",
           "--detector-tenant", f"acme={acme}", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    rnd = random.Random(7)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            for _ in range(600):
                try:
                    await FleetServiceStub(ch).WhoAmI(fleet_pb2.WhoAmIRequest(), metadata=md(b), timeout=1)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)
            q = QuarantineServiceStub(ch)
            t0 = time.perf_counter()
            for tok in (a, b):  # builds the Judge: every detector, the encoder included
                await q.JudgeToolResults(qpb.JudgeToolResultsRequest(results=[text(rnd)], action="placeholder"),
                                         metadata=md(tok), timeout=600)
            load_s = time.perf_counter() - t0
            await asyncio.sleep(5.0)  # the warm-up's background encoder job
            c0, w0 = cpu_s(proc.pid), time.perf_counter()
            idle = await bravo_loop(ch, b, seconds / 2, rnd)
            idle_cpu = (cpu_s(proc.pid) - c0) / (time.perf_counter() - w0)
            stop = asyncio.Event()
            flooding = asyncio.ensure_future(flood(ch, a, stop, rnd))
            await asyncio.sleep(2.0)  # the judge threads are busy
            c0, w0 = cpu_s(proc.pid), time.perf_counter()
            busy = await bravo_loop(ch, b, seconds, rnd)
            wall = time.perf_counter() - w0
            busy_cpu = (cpu_s(proc.pid) - c0) / wall
            stop.set()
            judged = await flooding
        return {"name": name, "load_s": load_s, "idle": idle, "busy": busy, "idle_cpu": idle_cpu,
                "busy_cpu": busy_cpu, "acme_per_s": judged / (wall + 2.0)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def report(results: list[dict[str, Any]], seconds: float) -> str:
    lines = [f"bravo's calls, p50 / p99 in ms (idle phase {seconds / 2:.0f} s, flood phase {seconds:.0f} s), "
             "and flood / idle:", "",
             "| config | call | idle p50 / p99 | flood p50 / p99 | ratio p50 / p99 | calls (flood) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for op in ("WhoAmI", "PutBlob", "JudgeToolResults"):
            i, f = r["idle"][op], r["busy"][op]
            lines.append(f"| {r['name']} | {op} | {pct(i, .5):.1f} / {pct(i, .99):.1f} | {pct(f, .5):.1f} / "
                         f"{pct(f, .99):.1f} | {pct(f, .5) / pct(i, .5):.1f}x / {pct(f, .99) / pct(i, .99):.1f}x "
                         f"| {len(f)} |")
    lines += ["", "| config | acme's texts judged per s (flood) | controller CPU-s per s, idle / flood | "
              "first call (detectors load) |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['acme_per_s']:.1f} | {r['idle_cpu']:.2f} / {r['busy_cpu']:.2f} | "
              f"{r['load_s']:.1f} s |" for r in results]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the flood phase (idle: half)")
    ap.add_argument("--write-doc", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        results = [asyncio.run(run_config(n, acme, extra, args.seconds, Path(d)))
                   for n, (acme, extra) in CONFIGS.items()]
    body = report(results, args.seconds)
    print(body)
    if args.write_doc:
        sys.path.insert(0, str(ROOT / "bench"))
        from benchdoc import write_section

        write_section("judge_isolation", "## Judge isolation (bench/judge_isolation.py)\n\n"
                      f"{os.cpu_count()} cores; `python bench/judge_isolation.py --seconds {args.seconds:g}`.\n\n"
                      + body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
