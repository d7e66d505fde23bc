"""`kvfleet up`: the controller, local Ray and the embedded store in one command (until Ctrl-C).

    kvfleet up                                   # sqlite under ./var, local Ray, 127.0.0.1:50051
    kvfleet up --store redis://127.0.0.1:6379/0 --ray-address 10.0.0.2:6379
    kvfleet up --sim-workers 2                   # also two vLLM stand-ins, registered
    kvfleet up --route-queue-weight 1.0          # placement weights, as `kvfleet controller` (docs/routing.md)
    kvfleet up --gc-interval 60                  # the store's GC every minute (default 300 s; 0: off)

Prints the controller's address and an operator token (minted into STATE_DIR/tokens.json), and
the commands to look at the fleet. With --json, stdout holds that one JSON line and nothing else: the status lines
and what Ray prints (a worker's death) go to stderr.

NOTE: Ray's driver prints the errors the cluster publishes (a worker died, ...) on stdout, in colour, whatever
`log_to_driver` says (that flag covers the workers' own output, and is off here): with --json those lines followed
the JSON line on stdout and broke a script reading it as JSON lines (found by review). Ray has no option to send
them elsewhere, so --json points sys.stdout at stderr for the run, which is where Ray's thread looks them up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fleet.app.cli.up_checks import check_can_start
from fleet.core.errors import InvalidArgument, KvfleetError
from fleet.core.whole import whole

if TYPE_CHECKING:
    from fleet.app.testkit.stack import Stack




def _listen(text: str) -> str:
    """--listen: HOST:PORT, the port 0-65535, as the controller takes it. NOTE: before, a bad port was refused by the
    controller's config, after the local Ray (about 10 s) and the state dir had been made (found by review)."""
    from controller.config import listen_error

    if (why := listen_error(text)) is not None:
        raise argparse.ArgumentTypeError(why)
    return text


def parse(argv: list[str]) -> argparse.Namespace:
    from controller.edge import add_edge_flags
    from controller.kernel_placement import add_kernel_flags
    from controller.node_flags import add_node_flags
    from controller.quotas import add_session_flags
    from controller.route_flags import add_cost_flags
    from controller.store_gc import add_gc_flag

    p = argparse.ArgumentParser(prog="kvfleet up", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--listen", type=_listen, default="127.0.0.1:50051", help="HOST:PORT of the controller (port 0: any free)"
    )
    p.add_argument("--state-dir", default="./var", help="where the embedded store and the tokens file live")
    p.add_argument(
        "--store",
        default=None,
        help="store URL (default: sqlite:///STATE_DIR/kvfleet.db); redis://… uses a real Redis",
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument("--num-cpus", type=whole(), default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--sim-workers", type=whole(), default=0, help="also start N vLLM stand-ins and register them")
    p.add_argument("--tenant", default="local", help="tenant of the extra tenant token printed")
    p.add_argument("--json", action="store_true", help="print the endpoints and tokens as one JSON line")
    add_cost_flags(p, os.environ)  # KVFLEET_ROUTE_*, as `kvfleet controller` reads them
    add_kernel_flags(p)
    # NOTE: both read {} here: `KVFLEET_NODE_KV_BYTES=… kvfleet up` and the edge limits' KVFLEET_UPLOAD_MIN_RATE, …
    # (docs/deploy.md, section 10: "flags on kvfleet controller are also on kvfleet up") were ignored without a word
    add_edge_flags(p, os.environ)
    add_session_flags(p)
    add_node_flags(p, os.environ)
    add_gc_flag(p, os.environ)  # NOTE: {} here left KVFLEET_GC_INTERVAL / KVFLEET_VERDICT_TTL unread (review finding)
    return p.parse_args(argv)


def controller_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """ControllerConfig fields from `kvfleet up`'s flags (edge limits, GC schedule, verdict TTL); raises
    InvalidArgument, naming the flag, on a bad value (before anything starts)."""
    from controller.edge import edge_config_from
    from controller.store_gc import gc_interval_from, verdict_ttl_from

    return {**edge_config_from(args), "gc_interval_s": gc_interval_from(args), "verdict_ttl_s": verdict_ttl_from(args)}


async def serve(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the fleet until SIGINT/SIGTERM; `out`: where --json's line goes (default: stdout)."""
    from controller.kernel_placement import kernel_overrides_from, set_kernel_placement
    from controller.quotas import session_limits_from
    from controller.route_flags import cost_config_from
    from fleet.app.testkit.stack import StackConfig, start_stack

    cost = cost_config_from(args)  # bad weights fail before anything starts
    kernel = kernel_overrides_from(args)
    overrides = controller_overrides(args)
    limits = session_limits_from(args)
    await asyncio.to_thread(check_can_start, args.listen, args.store)  # before Ray and the state dir (up_checks.py)
    state = Path(args.state_dir).expanduser().resolve()
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # NOTE: was a traceback (found by review)
        raise InvalidArgument(f"--state-dir {args.state_dir}: cannot use it as a directory ({e.strerror or e})") from None
    store = args.store or f"sqlite:///{state / 'kvfleet.db'}"
    cfg = StackConfig(
        store_url=store,
        state_dir=str(state),
        listen=args.listen,
        workers=args.sim_workers,
        tenants=(args.tenant,),
        ray_address=args.ray_address,
        ray_num_cpus=args.num_cpus,
        own_ray_tree=not args.ray_address,  # a local Ray, started here, is ours: its process tree goes when we go
        controller=overrides,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # NOTE: before the start: Ctrl-C while Ray comes up stops it
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    stack = await _start_unless_stopped(start_stack(cfg), stop)
    if stack is None:
        print("kvfleet up: stopped before the fleet came up", flush=True)
        return 0
    stack.ctl.ctx.need_router().set_cost_config(cost)
    await asyncio.to_thread(set_kernel_placement, stack.ctl.ctx.store, kernel)  # before the first session
    stack.ctl.ctx.session_limits = limits  # before any session call: the fleet reads them when it starts
    stack.ctl.ctx.node_kv_bytes = args.node_kv_bytes
    stack.ctl.ctx.node_max_sessions = args.node_max_sessions
    _announce(args, stack, store, out or sys.stdout)
    await stop.wait()
    print("kvfleet up: stopping (controller, stand-ins, Ray)", flush=True)
    await stack.stop()
    return 0


async def _start_unless_stopped(start: Coroutine[Any, Any, Stack], stop: asyncio.Event) -> Stack | None:
    """The started stack, or None when `stop` is set first: the start is then cancelled (start_stack stops what
    it started). NOTE: the signal handlers used to be installed after the start, so Ctrl-C during a slow
    `ray.init` did nothing."""
    task = asyncio.ensure_future(start)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _announce(args: argparse.Namespace, stack: Stack, store: str, out: TextIO) -> None:
    from controller.servicers.fleet import redact

    addr = stack.ctl.address
    info = {
        "controller": addr,
        "store": redact(store),
        "operator_token": stack.operator_token,
        "tenant": args.tenant,
        "tenant_token": stack.tenant_token,
        "workers": {n: s.url for n, s in stack.sims.items()},
    }
    if args.json:
        print(json.dumps(info), file=out, flush=True)
        return
    print(
        f"kvfleet up: controller on {addr}; store {redact(store)}; Ray {'at ' + args.ray_address if args.ray_address else 'local'}"
    )
    print(f"operator token: {stack.operator_token}")
    print(f"tenant token ({args.tenant}): {stack.tenant_token}")
    for n, s in stack.sims.items():
        print(f"stand-in worker {n}: {s.url}")
    print(
        f"try:  KVFLEET_CONTROLLER={addr} KVFLEET_TOKEN={stack.operator_token} kvfleet session ls --fleet --watch"
    )
    print("      (same env) kvfleet worker ls        Ctrl-C stops everything", flush=True)


def main(argv: list[str]) -> int:
    from controller.main import quiet_ray_signals

    quiet_ray_signals()  # a stop longer than 3 s must not end in Ray's SIGABRT (see there)
    args = parse(argv)
    out = sys.stdout
    if args.json:  # stdout is the JSON line's alone: everything else printed from here on goes to stderr
        sys.stdout = sys.stderr
    try:
        return asyncio.run(serve(args, out))
    except KvfleetError as e:
        print(f"kvfleet up: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        sys.stdout = out
