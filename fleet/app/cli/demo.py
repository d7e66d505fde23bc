"""`kvfleet demo`: the main job on one machine (controller, local Ray, embedded store, vLLM
stand-ins) running an agent fleet workload, then the summary and the fleet dashboard.

    kvfleet demo [--agents 12] [--turns 30] [--workers 4] [--num-blocks 1024] [--json] [--no-peers]

What runs and what every figure means: docs/demo.md. SIGINT or SIGTERM stops it cleanly: the run is
cancelled, so the stand-ins, the controller, the local Ray (its whole process tree, as `kvfleet up`),
a vllm-router child and the temporary directory all go before it exits (128 + the signal's number).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from fleet.app.demo.workload import DemoConfig
from fleet.core.errors import KvfleetError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DemoOutput:
    summary: dict[str, Any]
    sessions: list[Any]   # fleet.sdk.sessions.SessionRow, as the dashboard shows them
    workers: list[Any]
    nodes: list[Any]


async def run_demo(cfg: DemoConfig, console: Console | None = None, ray_address: str | None = None,
                   state_dir: str | None = None, with_peers: bool = True) -> DemoOutput:
    """Start everything, run the workload, summarize; `console` shows progress (None: quiet).
    With `with_peers` and `vllm-router` on PATH, the trace is also replayed live through it."""
    from fleet.app.demo.live import LiveRun
    from fleet.app.demo.peers import replay_vllm_router, vllm_router_binary
    from fleet.app.demo.summary import summarize
    from fleet.app.testkit.stack import StackConfig, settled_workers, start_stack

    with tempfile.TemporaryDirectory(prefix="kvfleet-demo-") as tmp:
        root = Path(state_dir or tmp)
        scfg = StackConfig(store_url=f"sqlite:///{root / 'kvfleet.db'}", state_dir=str(root), workers=cfg.workers,
                           num_blocks=cfg.num_blocks, block_size=cfg.block_size, tenants=(cfg.tenant_name,),
                           ray_address=ray_address,
                           # NOTE: a local Ray started here is ours: its agents went ~60 s after the demo, and
                           # after a SIGKILL of it nothing stopped them (controller/ray_local.py)
                           own_ray_tree=not ray_address)
        total = cfg.agents * cfg.turns + cfg.branches * cfg.branch_turns
        with _progress(console) as prog:
            task = prog.add_task("starting controller, local Ray, store, stand-in workers", total=total)
            stack = await start_stack(scfg)
            try:
                prog.update(task, description=f"{cfg.agents} agents x {cfg.turns} turns")

                def report(msg: str, done: int) -> None:
                    prog.update(task, completed=done, **({"description": msg} if msg else {}))
                    if msg and console is not None:
                        prog.console.log(msg)

                res = await LiveRun(cfg, stack, report).run()
                listing = await stack.admin.fleet_sessions(fleet=True)
                workers = await settled_workers(stack.admin, stack.sims)
            finally:
                await stack.stop()
            peer = None
            if with_peers and vllm_router_binary():
                prog.update(task, description="the same trace through vllm-router kv_aware (fresh stand-ins)")
                peer = await replay_vllm_router(res.trace, cfg.num_blocks, cfg.block_size)
            prog.update(task, description="replaying the trace under the other routings")
            summary = await asyncio.to_thread(summarize, cfg, res, peer)
    return DemoOutput(summary, list(listing.sessions), workers, list(listing.nodes))


class _Quiet:
    console = Console(quiet=True)

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *a: Any, **k: Any) -> int:
        return 0

    def update(self, *a: Any, **k: Any) -> None:
        return None


def _progress(console: Console | None) -> Any:
    if console is None:
        return _Quiet()
    return Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("requests"), TimeElapsedColumn(), console=console, transient=False)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvfleet demo",
        description="The main job on one machine: controller, local Ray, embedded store and vLLM stand-ins, an "
                    "agent fleet workload routed through kvfleet, then the summary beside the same trace under "
                    "session-sticky hashing, greedy longest-prefix with perfect knowledge, a lifecycle-blind prefix "
                    "router, round-robin and (when installed) vLLM's own vllm-router, and the fleet dashboard.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = DemoConfig()
    p.add_argument("--agents", type=int, default=d.agents, help="agent sessions sharing one system prompt")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per agent")
    p.add_argument("--workers", type=int, default=d.workers, help="vLLM stand-in workers (>= 3)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks per stand-in worker")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (progress on stderr)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local one")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--no-peers", action="store_true", help="skip the live vllm-router replay even when installed")
    return p.parse_args(argv)


class Stopped(Exception):
    """The run was cancelled by a signal (`signum`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def until_signalled(coro: Coroutine[Any, Any, T]) -> T:
    """`coro`'s result, or Stopped once SIGINT or SIGTERM cancelled it (its finally blocks ran: the stack
    stopped, the temporary directory removed). Later signals are ignored while it unwinds.

    NOTE: without handlers a SIGTERM ended the process at once, leaving the temporary directory (the store
    and tokens), Ray's agents (~60 s, one listening on a non-loopback address) and a vllm-router child."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    got: list[int] = []

    def stop(signum: int) -> None:
        if not got:
            got.append(signum)
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop, sig)
    try:
        return await task
    except asyncio.CancelledError:
        if got:
            raise Stopped(got[0]) from None
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)


def main(argv: list[str]) -> int:
    from controller.main import quiet_ray_signals

    quiet_ray_signals()  # Ray's own SIGTERM handler would abort a stop that takes over 3 s (see there)
    a = parse(argv)
    try:
        cfg = DemoConfig(agents=a.agents, turns=a.turns, workers=a.workers, num_blocks=a.num_blocks)
    except ValueError as e:
        print(f"kvfleet demo: {e}", file=sys.stderr)
        return 2
    err = Console(stderr=True)
    try:
        out = asyncio.run(until_signalled(run_demo(cfg, None if a.quiet else err, a.ray_address,
                                                   with_peers=not a.no_peers)))
    except Stopped as e:
        print(f"kvfleet demo: stopped by {e}", file=sys.stderr)
        return 128 + e.signum
    except KvfleetError as e:  # NOTE: a bad --ray-address was a traceback and exit 1 (review finding); `up` says one line
        print(f"kvfleet demo: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out.summary, indent=1))
        return 0
    from fleet.app.cli.session import render_sessions
    from fleet.app.cli.worker import render_workers
    from fleet.app.demo.summary import render

    con = Console(width=None if sys.stdout.isatty() else 160)  # piped output: room for every column
    con.print(render(out.summary))
    con.print(render_sessions(out.sessions, title="fleet dashboard (kvfleet session ls --fleet)"))
    con.print(render_workers(out.workers, out.nodes))
    con.print(f"demo finished in {out.summary['wall_s']}s of workload")
    return 0
