"""How each contender of the fleet routing bench is launched in front of a fresh SimFleet, and stopped.

Every contender is a separate process (or two, for kvfleet) on loopback; the clients send the
same OpenAI chat requests to `Running.url`. Lifecycle actions reach the workers straight over
their HTTP endpoints (behind the router's back), except for the contender whose `via` is
"controller": its actions go through the kvfleet controller's Lifecycle RPC.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from controller.auth import mint_token
from fleet.app.redis_server import free_port
from fleet.app.testkit.stack import register_sims
from fleet.sdk import AsyncFleetClient

from .workers import MODEL, SimFleet

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).resolve().parent
_LIVE: set[subprocess.Popen[bytes]] = set()
# NOTE: vLLM's /sleep defaults to mode=abort, which ends the requests in flight with a 200 stream whose
# finish_reason is "abort"; those still waiting never reach the prefix cache. The bench's sleep is a
# worker going away behind the router's back, not lost requests: "wait" lets those in flight finish
# (the cache is dropped once they have) while new ones wait for the wake, so every prompt runs once.
SLEEP_MODE = "wait"
RESET_MODE = "preempt"  # behind the back the reset preempts what runs there (recorded in the results; see _direct)


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    label: str
    kind: str  # kvfleet | blind | vllm | sglang | sticky
    policy: str = ""
    via: str = "direct"  # how lifecycle actions reach the workers: direct | controller
    proxy_args: tuple[str, ...] = ()  # kvfleet: more flags of `kvfleet proxy`
    # via the controller: its reset drains the worker first (the controller's default) or preempts what runs there
    # (reset_running_requests=true, the action behind the back)
    reset: str = "drain"
    in_all: bool = True  # run by `--contenders all`

    @property
    def is_kvfleet(self) -> bool:
        return self.kind in ("kvfleet", "blind")


CONTENDERS = {
    s.name: s
    for s in (
        Spec("kvfleet", "kvfleet proxy, lifecycle behind its back", "kvfleet"),
        Spec("kvfleet-ctl", "kvfleet proxy, lifecycle through the controller", "kvfleet", via="controller"),
        Spec("kvfleet-ctl-preempt", "kvfleet proxy, lifecycle through the controller, its reset preempting",
             "kvfleet", via="controller", reset="preempt", in_all=False),
        Spec("kvfleet-blind", "kvfleet lifecycle-blind prefix router (fleet/app/testkit/baseline.py)", "blind"),
        Spec("vllm-kv_aware", "vllm-router kv_aware (KV events)", "vllm", "kv_aware"),
        Spec("vllm-cache_aware", "vllm-router cache_aware", "vllm", "cache_aware"),
        Spec("vllm-power_of_two", "vllm-router power_of_two", "vllm", "power_of_two"),
        Spec("vllm-round_robin", "vllm-router round_robin", "vllm", "round_robin"),
        Spec("sglang-cache_aware", "sglang-router cache_aware", "sglang", "cache_aware"),
        Spec("sticky", "session-sticky consistent hash (bench/peers/sticky.py)", "sticky"),
    )
}


class Unavailable(Exception):
    """The contender cannot run here (not installed, or it would not start); the message says why."""


def _kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
    _LIVE.discard(p)


def kill_all() -> None:
    """Stop every process this module started (also run at exit, so an error or Ctrl-C leaves none)."""
    for p in list(_LIVE):
        _kill(p)


atexit.register(kill_all)


def spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        cmd,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    _LIVE.add(p)
    return p


def binary(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


@dataclass(slots=True)
class Running:
    spec: Spec
    url: str
    command: list[str]
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    http: aiohttp.ClientSession
    tenant_headers: dict[str, dict[str, str]] = field(default_factory=dict)
    op: AsyncFleetClient | None = None

    def headers(self, tenant: str) -> dict[str, str]:
        return self.tenant_headers.get(tenant, {})

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    async def lifecycle(self, verb: str, worker: str, fleet: SimFleet) -> dict[str, Any]:
        """Sleep (level 1, mode SLEEP_MODE), wake_up or reset_prefix_cache one worker. Behind the router's back
        the reset preempts the requests running there (`_direct`); through the kvfleet controller the verb drains the
        worker first, or, for a spec whose `reset` is "preempt", preempts the same way (reset_running_requests=true;
        docs/lifecycle.md). A reset answered success:false is asked again, at most 100 times, 20 ms apart."""
        t0, attempts, ok = time.monotonic(), 0, False
        while not ok and attempts < (100 if verb == "reset_prefix_cache" else 1):
            if attempts:
                await asyncio.sleep(0.02)
            attempts += 1
            ok = await (
                self._via_controller(verb, worker)
                if self.spec.via == "controller"
                else self._direct(verb, fleet.sims[worker].url)
            )
        return {
            "verb": verb,
            "worker": worker,
            "via": self.spec.via,
            "ok": ok,
            "attempts": attempts,
            "took_s": round(time.monotonic() - t0, 3),
        }

    async def _direct(self, verb: str, url: str) -> bool:
        # NOTE: the reset preempts what runs there (vLLM's reset_running_requests=true), so it lands when the
        # trace says for every router: a plain reset waits for an idle worker, and asked every 20 ms for up to
        # 2 s it landed at request 166-192 of 192 for kvfleet and never for the routers that keep one worker
        # busy (issue #27, notes of the fleet-routing section)
        path = {"sleep": f"/sleep?level=1&mode={SLEEP_MODE}",
                "reset_prefix_cache": "/reset_prefix_cache?reset_running_requests=true"}.get(verb, "/" + verb)
        async with self.http.post(url + path, timeout=aiohttp.ClientTimeout(total=5)) as r:
            body = await r.json(content_type=None)
            return r.status == 200 and (verb != "reset_prefix_cache" or bool(body.get("success")))

    async def _via_controller(self, verb: str, worker: str) -> bool:
        assert self.op is not None
        sleep = verb == "sleep"
        preempt = verb == "reset_prefix_cache" and self.spec.reset == "preempt"
        w = await self.op.lifecycle(
            worker, verb, level=1 if sleep else None, mode=SLEEP_MODE if sleep else None,
            reset_running_requests=True if preempt else None,
        )
        return verb != "reset_prefix_cache" or w.kv == "forgotten"

    async def stop(self) -> None:
        if self.op is not None:
            with contextlib.suppress(Exception):
                await self.op.close()
        for p in reversed(self.procs):
            await asyncio.to_thread(_kill, p)
        await self.http.close()

    def log_tail(self, n: int = 1500) -> str:
        return "\n".join(f"[{p.name}] " + p.read_text(errors="replace")[-n:] for p in self.logs if p.exists())


async def until_http(
    http: aiohttp.ClientSession,
    url: str,
    procs: list[subprocess.Popen[bytes]],
    ok: Any = None,
    timeout_s: float = 30.0,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise Unavailable(f"exited with status {[p.poll() for p in procs]} before {url} answered")
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200 and (ok is None or ok(await r.json(content_type=None))):
                    return
        await asyncio.sleep(0.1)
    raise Unavailable(f"{url} did not answer 200 within {timeout_s:.0f}s")


async def start(spec: Spec, fleet: SimFleet, tmp: Path, tenants: tuple[str, ...]) -> Running:
    """Launch `spec` in front of `fleet` and wait until it serves (the caller probes with a request)."""
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        if spec.kind == "kvfleet":
            return await _start_kvfleet(spec, fleet, tmp, tenants, http)
        cmd = peer_command(spec, fleet)
        log = tmp / f"{spec.name}.log"
        p = spawn(cmd, log)
        run = Running(spec, f"http://127.0.0.1:{port_of(cmd)}", cmd, [p], [log], http)
        try:
            await until_http(http, run.url + "/health", run.procs)
        except Unavailable as e:
            await run.stop()
            raise Unavailable(f"{e}; log: {log.read_text(errors='replace')[-600:]}") from None
        return run
    except BaseException:
        if not http.closed:
            await http.close()
        raise


def port_of(cmd: list[str]) -> int:
    if "--port" in cmd:
        return int(cmd[cmd.index("--port") + 1])
    return int(cmd[cmd.index("--listen") + 1].rsplit(":", 1)[1])


def peer_command(spec: Spec, fleet: SimFleet) -> list[str]:
    """The command line of a peer router in front of `fleet`: it reads `fleet.urls()`, `fleet.block_size` and
    each of `fleet.sims`' `url`, `kv_events` and `replay` (bench/proxy_load.py passes its own stand-in processes).

    Raises:
        Unavailable: the peer's router is not installed.
    """
    port, urls = free_port(), fleet.urls()
    if spec.kind in ("vllm", "sglang"):
        exe = binary(f"{spec.kind}-router")
        if exe is None:
            raise Unavailable(
                f"{spec.kind}-router is not installed (./dev.sh bench fleet_routing installs it)"
            )
        head = [exe] if spec.kind == "vllm" else [exe, "launch"]
        cmd = [
            *head,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            spec.policy,
            "--worker-urls",
            *urls,
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning" if spec.kind == "vllm" else "warn",
        ]
        if spec.policy == "kv_aware":
            for s in fleet.sims.values():
                cmd += ["--kv-event-source", f"{s.url}={s.kv_events}"]
                if s.replay:
                    cmd += ["--kv-event-replay-source", f"{s.url}={s.replay}"]
            cmd += ["--kv-event-block-size", str(fleet.block_size), "--kv-event-model", MODEL]
        return cmd
    script = {"sticky": "sticky.py", "blind": "blind.py"}[spec.kind]
    workers = urls if spec.kind == "sticky" else [f"{s.url}={s.kv_events}" for s in fleet.sims.values()]
    return [
        sys.executable,
        str(PEERS / script),
        "--listen",
        f"127.0.0.1:{port}",
        *[x for w in workers for x in ("--worker", w)],
    ]


async def _start_kvfleet(
    spec: Spec, fleet: SimFleet, tmp: Path, tenants: tuple[str, ...], http: aiohttp.ClientSession
) -> Running:
    """`kvfleet controller` (auth on, SQLite store) + the workers registered + `kvfleet proxy`, as deployed."""
    tokens = tmp / f"{spec.name}-tokens.json"
    op = mint_token(tokens, "ops", "operator")
    heads = {t: {"Authorization": f"Bearer {mint_token(tokens, t, 'tenant')}"} for t in tenants}
    ctl, listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    kv = sys.executable, "-m", "fleet.app.cli.main"
    c_cmd = [
        *kv,
        "controller",
        "--listen",
        ctl,
        "--store",
        f"sqlite:///{tmp / (spec.name + '.db')}",
        "--tokens-file",
        str(tokens),
        "--metrics-port",
        "-1",
    ]
    p_cmd = [*kv, "proxy", "--controller", ctl, "--listen", listen, *spec.proxy_args, "--token", op]
    logs = [tmp / f"{spec.name}-controller.log", tmp / f"{spec.name}-proxy.log"]
    run = Running(
        spec, f"http://{listen}", [*c_cmd, "&&", *p_cmd[:-1], "OPERATOR_TOKEN"], [], logs, http, heads
    )
    try:
        run.procs.append(spawn(c_cmd, logs[0]))
        run.op = AsyncFleetClient(ctl, token=op)
        await _until(lambda: run.op.whoami(), run.procs)  # type: ignore[union-attr]
        await register_sims(run.op, fleet.sims, MODEL, fleet.block_size)
        await _until(
            run.op.workers, run.procs, lambda ws: len(ws) == len(fleet.sims) and all(w.serving for w in ws)
        )
        run.procs.append(spawn(p_cmd, logs[1]))
        await until_http(http, run.url + "/health", run.procs, lambda h: h.get("serving") == len(fleet.sims))
        return run
    except BaseException as e:
        tail = run.log_tail(600)
        await run.stop()
        if isinstance(e, Exception):
            raise Unavailable(f"kvfleet did not start: {type(e).__name__}: {e}; {tail}") from None
        raise


async def _until(
    fn: Any, procs: list[subprocess.Popen[bytes]], pred: Any = None, timeout_s: float = 30.0
) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise Unavailable(f"a process exited with status {[p.poll() for p in procs]}")
        try:
            last = await fn()
            if pred is None or pred(last):
                return last
        except Exception as e:  # not up yet
            last = e
        await asyncio.sleep(0.1)
    raise Unavailable(f"not ready within {timeout_s:.0f}s (last: {last!r})")
