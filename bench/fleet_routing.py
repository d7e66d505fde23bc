"""Fleet routing: kvfleet's router against real, independently written routers, side by side in one run.

    ./dev.sh bench fleet_routing                    # the full matrix (~10-15 min on 2 cores); writes the docs
    ./dev.sh bench fleet_routing --quick            # a few minutes, validation only (no docs)
    python bench/fleet_routing.py --contenders kvfleet,sticky --workloads agents16x4 --caches tight --no-docs
    ./dev.sh bench fleet_routing --cells mooncake/tight --driver aiperf   # AIPerf sends the trace's requests
    ./dev.sh bench fleet_routing --cells short-chats/tight --no-hazards --json X   # the control: no sleep or reset

For every cell (workload x per-worker cache size) each contender gets FRESH `kvfleet sim-vllm`
workers built from the same config, and the same trace: agents whose conversations grow turn by
turn, each request re-sending the whole history as OpenAI chat messages, streamed. At fixed points
of the trace (fractions of its requests issued) one worker is slept (level 1, mode=wait: those in
flight finish, new ones wait for the wake; peers/launch.py SLEEP_MODE) and woken, and one
worker's prefix cache is reset; behind every router's back (HTTP straight to the worker), except
for "kvfleet-ctl", whose actions go through the kvfleet controller. Contenders: bench/peers/launch.py.

Figures per contender: prefilled tokens and hit rate from the workers' own counters, client-side
time to first token (first SSE event), completed requests/s, per-worker request and token
shares, requests timed out (--timeout), requests the worker aborted (a 200 stream whose last
finish_reason is "abort": not completed) and requests that reached a sleeping worker (counted at the
worker), and, for kvfleet's routers, stale warm routes (a WARM verdict whose matched tokens the
worker did not actually have cached: its usage.cached_tokens < the verdict's matched tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from peers import launch, summary  # noqa: E402
from peers.launch import CONTENDERS, Running, Spec, Unavailable  # noqa: E402
from peers.repeats import merge  # noqa: E402
from peers.report import plot, report  # noqa: E402
from peers.summary import prefilled  # noqa: E402
from peers.workers import MODEL, RESET_TARGETS, SimFleet, engine_config  # noqa: E402
from routing_trace import CACHES, WORKLOADS, Session, Workload, workload  # noqa: E402

DEFAULT_CELLS = (
    ("agents16x4", "ample"),
    ("agents16x4", "tight"),
    ("agents16x4", "very-tight"),
    ("demo", "tight"),
    ("agents16x8", "tight"),
    ("tenants2", "tight"),
    ("cold-burst", "tight"),
)
QUICK_CELLS = (("agents16x4", "tight"), ("cold-burst", "tight"))
BLOCK_SIZE = summary.BLOCK_SIZE  # the stand-ins' (bench/peers/summary.py: the stale-route rule needs it)
MAX_TOKENS = 16
# NOTE: applied only where the stand-in has the field: its clock in real time, as `kvfleet sim-vllm` serves
SIM_DEFAULTS: dict[str, Any] = {"time_scale": 1.0}
# a kvfleet contender run again with other proxy settings (--first-byte-timeouts): its name -> the proxy's env
VARIANT_ENV: dict[str, dict[str, str]] = {}
PROXY_COUNTERS = {  # counter -> (short name, the label it is summed by)
    "kvfleet_proxy_sleep_probes_total": ("probes", "observed"),
    "kvfleet_proxy_retries_total": ("retries", "reason"),
    "kvfleet_proxy_skipped_workers_total": ("skips", "reason"),
    "kvfleet_proxy_tool_results_judged_total": ("judged", "verdict"),  # role: tool results (agents-tools)
    "kvfleet_proxy_quarantined_tool_results_total": ("withheld", "action"),
}


@dataclass(slots=True)
class Record:
    """One request as the client saw it. status: HTTP status, 0 = timed out, -1 = connection error."""

    session: str
    turn: int
    status: int = 0
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    verdict: str | None = None  # kvfleet's route verdict (WARM/COLD), from its response headers
    matched_tokens: int = 0
    attempts: int = 1
    error: str = ""
    issued: int = 0  # its place in issue order (lifecycle events carry the same count: at_request)
    issued_s: float | None = None  # when, seconds into the run (lifecycle events carry t_s, when they ended)
    finish_reason: str | None = None  # the stream's last one; "abort": the worker ended it unfinished
    worker: str | None = None  # where kvfleet's proxy (x-kvfleet-worker) or the blind front (x-blind-worker) sent it


@dataclass(slots=True)
class Options:
    timeout_s: float = 10.0
    sleep_min_s: float = 1.5
    sleep_max_s: float = 8.0
    seed: int = 0
    think_s: float = 0.1
    sim_opts: dict[str, Any] = field(default_factory=dict)
    driver: str = "bench"  # "aiperf": trace workloads are replayed by AIPerf (bench/peers/aiperf_driver.py)
    aiperf: str = "aiperf"  # its executable (the bench keeps it in its own virtualenv)
    hazards: bool = True  # False: no sleep, wake or reset behind the routers' backs (a control run)
    # the worker the reset hits: "received", the awake one that received the most requests since the start (requests
    # that reached a sleeping worker count, so the target depends on where each router sent them); "cached", the
    # awake one holding the most cached blocks, the reset that costs each router the most (bench/peers/workers.py)
    reset_target: str = "cached"
    # True: the sleep window ends at the latest when the reset is due, and the reset follows the wake, so every router
    # meets the sleep, the wake and the reset in that order (Driver._sleep_window); False: the reset fires at its point
    # even while a worker sleeps (the rule before round forty-two, --reset-in-sleep)
    wake_before_reset: bool = True


def usage_of(raw: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens) from the SSE stream's usage chunk, if it has one."""
    for line in reversed(raw.decode(errors="replace").split("\n\n")):
        if line.startswith("data: {") and '"usage"' in line:
            u = json.loads(line[6:]).get("usage") or {}
            return u.get("prompt_tokens"), (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    return None, None


def finish_of(raw: bytes) -> str | None:
    """The last finish_reason the SSE stream carried (None: it carried none)."""
    for line in reversed(raw.decode(errors="replace").split("\n\n")):
        if line.startswith("data: {") and '"finish_reason"' in line:
            for c in json.loads(line[6:]).get("choices") or []:
                if c.get("finish_reason"):
                    return str(c["finish_reason"])
    return None


class Driver:
    """Runs one trace against one running contender; lifecycle actions fire as requests are issued."""

    def __init__(self, wl: Workload, run: Running, fleet: SimFleet, opt: Options) -> None:
        self.wl, self.run, self.fleet, self.opt = wl, run, fleet, opt
        n = wl.num_requests
        self.sleep_n, self.wake_n, self.reset_n = (
            max(1, math.ceil(f * n)) if opt.hazards else -1 for f in (wl.sleep_at, wl.wake_at, wl.reset_at)
        )
        self.issued = 0
        self.records: list[Record] = []
        self.events: list[dict[str, Any]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._done = False
        self._t0 = 0.0
        self._slept = False  # the sleep window is open: a reset due now waits for the wake
        self._reset_due = False

    async def drive(self) -> float:
        """Run every session to its end; returns the wall time from the first request to the last answer."""
        self._t0 = time.monotonic()
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as self.http:
            if self.wl.arrivals:  # open loop: a replayed trace's requests at their own times
                await asyncio.gather(*(self._at(t, self.wl.sessions[i]) for t, i in self.wl.arrivals))
            else:
                await asyncio.gather(*(self._session(s) for s in self.wl.sessions))
            wall = time.monotonic() - self._t0
            self._done = True
            await asyncio.wait_for(asyncio.gather(*self._tasks), self.opt.sleep_max_s + 30)
        return wall

    def note_cleared(self) -> None:
        """Each reset: when its worker published the AllBlocksCleared (`cleared_s`, seconds into the run), where it
        did. vLLM sends it with the next engine step, after that step's forward pass (docs/reference/vllm-surfaces.md
        1.4), so it reaches a router that long after the reset answered (bench/peers/summary.py stale_raced)."""
        for e in self.events:
            if e["verb"] != "reset_prefix_cache" or not e.get("ok"):
                continue
            start = self._t0 + e["t_s"] - e.get("took_s", 0.0)
            t = next((t for t in self.fleet.sims[e["worker"]].cleared_at if t >= start), None)
            if t is not None:
                e["cleared_s"] = round(t - self._t0, 3)

    async def follow(self, sender: Awaitable[Any]) -> None:
        """Another load generator (`sender`) sends the trace's requests: from the first one that reaches a
        worker, count them as issued on the trace's schedule, so the lifecycle actions fire as under drive()."""
        task = asyncio.ensure_future(sender)
        base = self.fleet.arrived()
        while self.fleet.arrived() == base and not task.done():
            await asyncio.sleep(0.002)
        self._t0 = time.monotonic()

        async def on_schedule() -> None:
            for t_s, _ in self.wl.arrivals:
                await asyncio.sleep(max(0.0, self._t0 + t_s - time.monotonic()))
                self._issue()

        counting = asyncio.create_task(on_schedule())
        try:
            await task
        finally:
            counting.cancel()
            self._done = True
        await asyncio.wait_for(asyncio.gather(*self._tasks), self.opt.sleep_max_s + 30)

    async def _session(self, s: Session) -> None:
        for t in range(len(s.turns)):
            await asyncio.sleep(s.think_s[t])
            self._issue()
            n, at = self.issued, round(time.monotonic() - self._t0, 3)
            self.records.append(await self._send(s, t))
            self.records[-1].issued, self.records[-1].issued_s = n, at

    async def _at(self, t_s: float, s: Session) -> None:
        await asyncio.sleep(max(0.0, self._t0 + t_s - time.monotonic()))
        self._issue()
        n, at = self.issued, round(time.monotonic() - self._t0, 3)
        self.records.append(await self._send(s, 0))
        self.records[-1].issued, self.records[-1].issued_s = n, at

    def _issue(self) -> None:
        self.issued += 1
        if self.issued == self.sleep_n:
            self._slept = True
            self._tasks.append(asyncio.create_task(self._sleep_window()))
        if self.issued == self.reset_n:
            if self._slept and self.opt.wake_before_reset:
                self._reset_due = True  # _sleep_window wakes the worker now, then resets: sleep, wake, reset in order
            else:
                self._reset()

    def _reset(self) -> None:
        target = self.fleet.busiest(self.opt.reset_target)
        self._tasks.append(asyncio.create_task(self._action("reset_prefix_cache", target)))

    async def _action(self, verb: str, worker: str) -> None:
        """One lifecycle action; an HTTP call that times out (a loaded machine) is tried twice more,
        then recorded as failed (the run goes on; the report shows the event)."""
        ev: dict[str, Any] = {"verb": verb, "worker": worker, "ok": False}
        for _ in range(3):
            try:
                ev = await self.run.lifecycle(verb, worker, self.fleet)
                break
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                ev["error"] = f"{type(e).__name__}: {e}"[:200]
        self.events.append({**ev, "at_request": self.issued, "t_s": round(time.monotonic() - self._t0, 3)})

    async def _sleep_window(self) -> None:
        """Sleep the busiest worker; wake it once the wake point of the trace was issued and at least
        sleep_min_s went by, or after sleep_max_s (or when every session is done), and at the latest when the
        reset is due, which then follows the wake.

        NOTE: before, a router that issued its requests from the sleep to the reset point within sleep_min_s (one that
        kept its agents off the slept worker, so none of them waited) had the reset while a worker still slept, on one of
        fewer awake workers, each carrying more sessions: a harder hazard than the slower routers met
        (agents16x4/very-tight, docs/benchmarks.md). Every router now meets sleep, wake and reset in that order, the
        reset at its own point of the trace."""
        w = self.fleet.busiest()
        await self._action("sleep", w)
        t = time.monotonic()
        while not self._done and not self._reset_due:  # _reset_due: only with opt.wake_before_reset
            el = time.monotonic() - t
            if el >= self.opt.sleep_max_s or (self.issued >= self.wake_n and el >= self.opt.sleep_min_s):
                break
            await asyncio.sleep(0.02)
        await self._action("wake_up", w)
        self.events[-1]["slept_s"] = round(time.monotonic() - t, 3)
        self._slept = False
        if self._reset_due:
            self.events[-1]["cut_by_reset"] = True
            self._reset_due = False
            self._reset()

    async def _send(self, s: Session, t: int) -> Record:
        rec = Record(s.session_id, t)
        body = {
            "model": MODEL,
            "messages": s.messages(t),
            "max_tokens": MAX_TOKENS,
            "stream": True,
            # NOTE: vLLM sends a stream's usage chunk (prompt and cached tokens) only when asked; the stand-in always
            # did, so the bench never asked, and against vLLM itself it would have read no cached tokens
            "stream_options": {"include_usage": True},
            "user": s.session_id,
        }
        headers = {**self.run.headers(s.tenant), "x-session-id": s.session_id}
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.opt.timeout_s):
                async with self.http.post(
                    self.run.url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    rec.status = r.status
                    h = r.headers
                    rec.verdict = h.get("x-kvfleet-verdict") or h.get("x-blind-verdict")
                    rec.matched_tokens = int(
                        h.get("x-kvfleet-matched-tokens") or h.get("x-blind-matched-tokens") or 0
                    )
                    rec.attempts = int(h.get("x-kvfleet-attempts") or 1)
                    # NOTE: the blind front names its worker in its own header; without it every kvfleet-blind record
                    # had no worker, so none of its stale warm routes could be counted raced (summary.stale_raced)
                    rec.worker = h.get("x-kvfleet-worker") or h.get("x-blind-worker")
                    first = await r.content.readuntil(b"\n\n") if r.status == 200 else b""
                    rec.ttft_s = time.perf_counter() - t0 if first else None
                    raw = first + await r.read()
                    rec.total_s = time.perf_counter() - t0
                    if r.status == 200:
                        rec.prompt_tokens, rec.cached_tokens = usage_of(raw)
                        rec.finish_reason = finish_of(raw)
                        if rec.finish_reason == "abort":  # a 200 stream the worker ended unfinished
                            rec.error = "the worker aborted the request (finish_reason abort)"
                    else:
                        rec.error = raw[:200].decode(errors="replace")
        except TimeoutError:
            rec.status, rec.error = 0, f"no complete answer within {self.opt.timeout_s}s"
        except (aiohttp.ClientError, OSError, ValueError) as e:
            rec.status, rec.error = -1, f"{type(e).__name__}: {e}"[:200]
        return rec


async def sim_ttft(fleet: SimFleet, http: aiohttp.ClientSession) -> dict[float, float]:
    """The workers' own TTFT histogram (vllm:time_to_first_token_seconds), summed: {le: cumulative count};
    empty when the stand-in does not export one."""
    out: dict[float, float] = {}
    for url in fleet.urls():
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        for line in text.splitlines():
            if line.startswith("vllm:time_to_first_token_seconds_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                key = float("inf") if le == "+Inf" else float(le)
                out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


async def proxy_counters(url: str, http: aiohttp.ClientSession) -> dict[str, float]:
    """The proxy's sleep probes by what they observed, its failovers and skipped workers by reason, summed
    over workers: {"probes asleep": n, "retries timeout": n, "skips suspect": n, ...}."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in PROXY_COUNTERS:
            short, label = PROXY_COUNTERS[name]
            key = f"{short} " + line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


def variants(specs: list[Spec], timeouts: str, named: list[str] | None = None) -> list[Spec]:
    """`specs`, each kvfleet contender followed by a copy per --first-byte-timeouts value, named NAME@fbtVALUE, and
    one per --variant TAG:VAR=VALUE[;VAR=VALUE] (the controller and proxy read their flags from KVFLEET_ variables),
    named NAME@TAG."""
    extra: list[tuple[str, dict[str, str], str]] = []
    for v in filter(None, timeouts.split(",")):
        extra.append((f"fbt{float(v):g}", {"KVFLEET_PROXY_FIRST_BYTE_TIMEOUT": f"{float(v):g}"},
                      f"--first-byte-timeout {v}"))
    for item in named or []:
        tag, sep, assigns = item.partition(":")
        env = dict(a.split("=", 1) for a in assigns.split(";") if "=" in a)
        if not sep or not tag or not env or not all(k.startswith("KVFLEET_") for k in env):
            raise SystemExit(f"--variant {item!r}: expected TAG:KVFLEET_VAR=VALUE[;KVFLEET_VAR=VALUE]")
        extra.append((tag, env, " ".join(f"{k}={v}" for k, v in env.items())))
    out = []
    for spec in specs:
        out.append(spec)
        if spec.kind != "kvfleet":
            continue
        for tag, env, said in extra:
            name = f"{spec.name}@{tag}"
            VARIANT_ENV[name] = env
            out.append(dataclasses.replace(spec, name=name, label=f"{spec.label}, {said}"))
    return out


async def warm_up(run: Running, tenants: tuple[str, ...], timeout_s: float = 30.0) -> None:
    """Until one tiny request per tenant answers 200 (shorter than a block: it caches nothing)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        for tenant in tenants:
            while True:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
                try:
                    async with http.post(
                        run.url + "/v1/chat/completions",
                        json=body,
                        headers=run.headers(tenant),
                        timeout=aiohttp.ClientTimeout(total=3),
                    ) as r:
                        if r.status == 200:
                            break
                        last = f"{r.status} {(await r.text())[:200]}"
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    last = repr(e)
                if time.monotonic() > deadline or not run.alive():
                    raise Unavailable(
                        f"no successful request within {timeout_s:.0f}s (last: {last}); {run.log_tail(400)}"
                    )
                await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)  # KV-event subscribers connected and caught up


async def run_one(spec: Spec, wl: Workload, num_blocks: int, opt: Options, tmp: Path) -> dict[str, Any]:
    cfg, _ = engine_config(num_blocks, BLOCK_SIZE, opt.sim_opts, SIM_DEFAULTS)
    fleet = await SimFleet.start(wl.num_workers, cfg)
    out: dict[str, Any] = {"contender": spec.name, "label": spec.label, "kind": spec.kind, "via": spec.via,
                           "timeout_s": opt.timeout_s}
    try:
        env = VARIANT_ENV.get(spec.name, {})
        try:
            os.environ.update(env)  # NOTE: read by the controller and proxy processes launch.start spawns
            run = await launch.start(spec, fleet, tmp, wl.tenants)
        except Unavailable as e:
            return {**out, "unavailable": str(e)}
        finally:
            for k in env:
                os.environ.pop(k, None)
        run.command = [*(f"{k}={v}" for k, v in env.items()), *run.command]
        try:
            await warm_up(run, wl.tenants)
            async with aiohttp.ClientSession() as http:
                h0 = await sim_ttft(fleet, http)
                await fleet.snapshot(http)
                d = Driver(wl, run, fleet, opt)
                if opt.driver == "aiperf" and wl.arrivals:
                    from mooncake import SOURCE as trace_source
                    from mooncake import load as load_trace
                    from peers import aiperf_driver

                    ran = await aiperf_driver.drive(d, opt.aiperf, tmp, load_trace(trace_source, wl.num_requests),
                                                    MODEL, MAX_TOKENS)
                    d.records, wall = [Record(**r) for r in ran.records], ran.wall_s
                    out["driver"] = {"name": "aiperf", "version": ran.version, "command": ran.command}
                else:
                    wall = await d.drive()
                d.note_cleared()
                h1 = await sim_ttft(fleet, http)
                stats = await fleet.stats(http)
                if spec.kind == "kvfleet":
                    out["proxy_counters"] = await proxy_counters(run.url, http)
            if any(r.status != 200 for r in d.records):  # keep what the contender logged, to explain it
                out["log_tail"] = run.log_tail(3000)
        except Unavailable as e:
            return {**out, "unavailable": str(e)}
        finally:
            await run.stop()
        return {
            **out,
            "command": run.command,
            "wall_s": wall,
            "events": d.events,
            "records": [asdict(r) for r in d.records],
            "workers": {n: asdict(s) for n, s in stats.items()},
            "sim_ttft": {str(k): h1.get(k, 0) - h0.get(k, 0) for k in h1},
        }
    finally:
        await fleet.stop()


async def run_all(
    cells: list[tuple[str, str]], contenders: list[Spec], opt: Options, quick: bool, repeat: int = 1
) -> dict[str, Any]:
    """Every contender on every cell, `repeat` times in a row per cell, the contenders' order rotating with the
    cell and the repeat so that no contender always runs first (the machine drifts)."""
    results: dict[str, Any] = {"cells": [], "repeats": repeat}
    with tempfile.TemporaryDirectory(prefix="fleet_routing_") as tmp:
        for i, (wname, size) in enumerate(cells):
            wl = workload(wname, opt.seed, quick=quick, think_s=opt.think_s)
            nb = wl.cache_blocks(size, BLOCK_SIZE)
            cell: dict[str, Any] = {"workload": wl.describe(), "cache": size, "num_blocks": nb, "runs": []}
            for k in range(repeat):
                turn = (i + k) % len(contenders)
                for spec in contenders[turn:] + contenders[:turn]:
                    t0 = time.monotonic()
                    state = Path(tmp) / f"{i}-{k}-{spec.name}"  # a fresh store and tokens file per run
                    state.mkdir()
                    r = await run_one(spec, wl, nb, opt, state)
                    cell["runs"].append(r)
                    print(progress(wname, size, r, time.monotonic() - t0), flush=True)
            cell["runs"].sort(key=lambda r: [c.name for c in contenders].index(r["contender"]))  # stable: runs in order
            results["cells"].append(cell)
    return results


def progress(wname: str, size: str, r: dict[str, Any], took: float) -> str:
    head = f"{wname:11s} {size:10s} {r['contender']:19s}"
    if "unavailable" in r:
        return f"{head} UNAVAILABLE: {r['unavailable'][:300]}"
    ws = list(r["workers"].values())
    q, hit = sum(w["queries"] for w in ws), sum(w["hits"] for w in ws)
    ok = sum(x["status"] == 200 for x in r["records"])
    return (
        f"{head} prefilled {prefilled(ws):>9,}  hit {100 * hit / max(q, 1):5.1f}%  ok {ok}/{len(r['records'])}  "
        f"to-sleeping {sum(w['to_sleeping'] for w in ws)}  ({took:.1f}s)"
    )


def parse_cells(a: argparse.Namespace) -> list[tuple[str, str]]:
    if a.cells:
        cells = [tuple(c.split("/", 1)) for c in a.cells.split(",")]
        for c in cells:
            if len(c) != 2 or c[0] not in WORKLOADS or c[1] not in CACHES:
                raise SystemExit(f"--cells takes WORKLOAD/CACHE pairs, got {'/'.join(c)!r}")
        return [(w, c) for w, c in cells]
    if not a.workloads and not a.caches:
        return list(QUICK_CELLS if a.quick else DEFAULT_CELLS)
    ws = a.workloads.split(",") if a.workloads else list(WORKLOADS)
    cs = a.caches.split(",") if a.caches else ["tight"]
    for w in ws:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; expected one of {', '.join(WORKLOADS)}")
    for c in cs:
        if c not in CACHES:
            raise SystemExit(f"unknown cache size {c!r}; expected one of {', '.join(CACHES)}")
    return [(w, c) for w in ws for c in cs]


def parse_sim_opts(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        k, _, v = item.partition("=")
        if not k or not _:
            raise SystemExit(f"--sim-opt takes KEY=VALUE, got {item!r}")
        out[k] = json.loads(v) if v[:1] in "0123456789-[{tf" or v in ("true", "false", "null") else v
    return out


def git_head() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "controller", "fleet")
    return head + (" (plus uncommitted changes under controller/ or fleet/)" if dirty else "")


def section_title(section: str, cells: str | None, driver: str | None, repeats: int = 1) -> str:
    return (
        f"Fleet routing, section {section}: cells {cells or 'default'} "
        "(`./dev.sh bench fleet_routing --cells ... --section " + section
        + (" --driver aiperf" if driver == "aiperf" else "") + (f" --repeat {repeats}" if repeats > 1 else "") + "`)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="two small cells (a few minutes); writes no docs")
    p.add_argument("--contenders", default="all", help=f"comma-separated, from: {', '.join(CONTENDERS)}")
    p.add_argument("--workloads", default="", help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    p.add_argument("--caches", default="", help=f"comma-separated, from: {', '.join(CACHES)} (default tight)")
    p.add_argument(
        "--cells", default="", help="comma-separated WORKLOAD/CACHE pairs, e.g. mooncake/very-tight"
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="a Mooncake-format trace for the mooncake workload "
        "(default: the slice committed in bench/data/)",
    )
    p.add_argument("--section", default="fleet-routing", help="the docs/benchmarks.md section to write")
    p.add_argument(
        "--notes",
        type=Path,
        default=None,
        help="markdown appended to the section (the reasons "
        "behind this run's figures; regenerate with --from-json)",
    )
    p.add_argument(
        "--first-byte-timeouts",
        default="",
        metavar="SECONDS,...",
        help="also run each kvfleet contender with the proxy's --first-byte-timeout at these values, "
        "as contenders named NAME@fbtVALUE (the proxy's default is the plain NAME)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="TAG:VAR=VALUE[;VAR=VALUE]",
        help="also run each kvfleet contender with these KVFLEET_ variables set for its controller and proxy "
        "(their flags, e.g. m96:KVFLEET_ROUTE_AFFINITY_MARGIN=96), as contenders named NAME@TAG; repeatable",
    )
    p.add_argument(
        "--reset-target",
        choices=RESET_TARGETS,
        default="cached",
        help="the awake worker the reset hits: the one holding the most cached blocks (default; ties: the larger "
        "name), or the one that received the most requests since the start (requests that reached it while it "
        "slept count, so a router that sent requests to the slept worker has it reset once woken, empty)",
    )
    p.add_argument(
        "--reset-in-sleep",
        action="store_true",
        help="fire the reset at its point of the trace even while the slept worker has not woken (the rule before "
        "round forty-two: a router that issued its requests faster had the reset during the sleep); by default the "
        "wake comes first, at the latest when the reset is due",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0, help="per-request timeout, seconds")
    p.add_argument("--think-ms", type=float, default=100.0, help="mean pause between an agent's turns")
    p.add_argument("--sleep-min", type=float, default=1.5, help="shortest sleep window, seconds")
    p.add_argument("--sleep-max", type=float, default=8.0, help="longest sleep window, seconds")
    p.add_argument(
        "--no-hazards",
        action="store_true",
        help="a control: no sleep, wake or reset behind the routers' backs (says what the hazards cost each "
        "router); writes no docs",
    )
    p.add_argument(
        "--sim-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a SimEngineConfig field for every stand-in (ignored, with a warning, if it has none)",
    )
    p.add_argument(
        "--driver",
        choices=("bench", "aiperf"),
        default="bench",
        help="who sends a replayed trace's requests (the mooncake workload): this bench, or AIPerf "
        "(bench/peers/aiperf_driver.py; the other workloads always use this bench's driver)",
    )
    p.add_argument("--aiperf", default="aiperf", help="the aiperf executable (for --driver aiperf; ./dev.sh bench "
                   "fleet_routing --driver aiperf installs one in .venv-aiperf)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    p.add_argument(
        "--repeat", type=int, default=1, metavar="N",
        help="run every contender N times per cell; the report gives each figure's median and range",
    )
    p.add_argument(
        "--from-json", type=Path, nargs="+", default=None,
        help="run nothing: report the results saved by --json (several runs of one commit and the same cells: "
        "their medians, as --repeat)",
    )
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    a = p.parse_args(argv)
    if a.trace is not None:
        import mooncake

        mooncake.SOURCE = a.trace
    names = [n for n, s in CONTENDERS.items() if s.in_all] if a.contenders == "all" else a.contenders.split(",")
    bad = [n for n in names if n not in CONTENDERS]
    if bad:
        raise SystemExit(f"unknown contender(s) {bad}; expected some of {', '.join(CONTENDERS)}")
    opt = Options(a.timeout, a.sleep_min, a.sleep_max, a.seed, a.think_ms / 1000, parse_sim_opts(a.sim_opt),
                  a.driver, a.aiperf, not a.no_hazards, a.reset_target, not a.reset_in_sleep)
    cfg, ignored = engine_config(1024, BLOCK_SIZE, opt.sim_opts, SIM_DEFAULTS)
    if ignored:
        print(f"warning: this sim-vllm has no config field(s) {sorted(ignored)}; ignored", file=sys.stderr)
    # NOTE: sglang-router probes each worker over gRPC first; the stand-ins' aiohttp servers log that as an error
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # so that finally blocks and atexit stop everything
    t0 = time.monotonic()
    if a.repeat < 1:
        raise SystemExit(f"--repeat {a.repeat}: at least 1")
    if a.from_json:
        try:
            results = merge([json.loads(f.read_text()) for f in a.from_json])
        except ValueError as e:
            raise SystemExit(f"--from-json: {e}") from None
    else:
        try:
            specs = variants([CONTENDERS[n] for n in names], a.first_byte_timeouts, a.variant)
            results = asyncio.run(run_all(parse_cells(a), specs, opt, a.quick, a.repeat))
        finally:
            launch.kill_all()
        results.update(meta(a, opt, cfg, time.monotonic() - t0))
    if a.json and not a.from_json:
        a.json.write_text(json.dumps(results))
    if a.section != "fleet-routing" and not (a.from_json and results.get("title")):
        # NOTE: from the saved run's own cells and driver, so a run saved with --no-docs publishes the same title
        results["title"] = section_title(a.section, results.get("cells_arg"), results.get("options", {}).get("driver"),
                                         results.get("repeats", 1))
    section = report(results)
    if a.notes is not None:
        section += "\n\n" + a.notes.read_text().strip() + "\n"
    print(section)
    if not results["quick"] and not a.no_docs and results.get("options", {}).get("hazards", True):
        from benchdoc import write_section

        png = a.out.parent / (a.section.replace("-", "_") + ".png")
        plot(results, png)
        write_section(a.section, section.replace("(fleet_routing.png)", f"({png.name})"), a.out)
        print(f"wrote {a.out} (section {a.section}) and {png}")
    return 0


def meta(a: argparse.Namespace, opt: Options, cfg: Any, took: float) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "not installed"

    return {
        "commit": git_head(),
        "quick": a.quick,
        "options": asdict(opt),
        "took_s": took,
        "sim_config": asdict(cfg) | {"num_blocks": "per cell"},
        "max_tokens": MAX_TOKENS,
        "sleep_mode": launch.SLEEP_MODE,
        "reset_mode": launch.RESET_MODE,
        "versions": {p: ver(p) for p in ("vllm-router", "sglang-router")},
        "detector": detector_setting(),
        "cells_arg": a.cells,
    }


def detector_setting() -> str:
    """The quarantine detector kvfleet's controller judged tool results with in this run (the bench
    passes no --detector-layers, so the tree's default)."""
    try:
        from fleet.core.quarantine.detector_config import default_layers

        return "controller default (no --detector-layers): " + ",".join(default_layers())
    except Exception as e:  # the report says so rather than failing the run
        return f"unknown ({type(e).__name__}: {e})"


if __name__ == "__main__":
    sys.exit(main())
