"""`kvfleet session ls --fleet`: the fleet dashboard of agent sessions.

    kvfleet session ls --fleet [--watch [--interval S]] [--json] [--controller HOST:PORT] [--token T]

Columns: session, tenant, node and actor, kernel backend and device, tokens, bytes held alone and
shared, hit rate (shared prefix tokens / tokens), quarantined spans, lifecycle state and epoch, last active. --watch
refreshes live; --json prints the rows for scripts. KVFLEET_CONTROLLER / KVFLEET_TOKEN are the
defaults of --controller / --token.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.app.cli.cells import cells, show
from fleet.core.errors import KvfleetError
from fleet.sdk.tls_flags import add_client_tls, client_tls


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def _ago(ts: float, now: float) -> str:
    if not ts:
        return "-"
    s = max(0.0, now - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.0f}h ago"


def _kernel(r: Any) -> str:
    """backend/device of the session's kernel ('-' when no live actor answered)."""
    backend, device = getattr(r, "backend", ""), getattr(r, "device", "")
    return f"{backend}/{device}" if backend else "-"


def render_sessions(rows: Sequence[Any], title: str = "kvfleet sessions (fleet)", now: float | None = None) -> Table:
    """The dashboard table (rows: fleet.sdk.sessions.SessionRow)."""
    now = time.time() if now is None else now
    t = Table(title=title, title_justify="left")
    for col, right in (("session", False), ("tenant", False), ("node / host", False), ("kernel", False), ("tokens", True),
                       ("history", True), ("alone", True), ("shared", True), ("hit rate", True), ("quarantined", True),
                       ("state / epoch", False), ("last active", True)):
        t.add_column(col, justify="right" if right else "left", no_wrap=not right and col != "node / host")
    for r in rows:
        style = "red" if r.state == "lost" else "yellow" if r.state == "regenerated" else None
        t.add_row(*cells(r.session_id, r.tenant, f"{r.node[:8]} / {_host(r.actor)}", _kernel(r), f"{r.num_tokens:,}",
                         f"{r.history_tokens:,}" if r.history_tokens else "-", _bytes(r.bytes_alone), _bytes(r.bytes_shared), f"{100 * r.hit_rate:.1f}%",
                         str(r.quarantined_spans), f"{r.state} / {r.epoch}", _ago(r.last_active, now)), style=style)
    if not rows:
        t.add_row("(no sessions)", *[""] * 11)
    return t


def _host(actor: str) -> str:
    """A kernel host's actor name (`host:{scope}-v{N}:{node}`) without the node, shown beside it."""
    return actor.rsplit(":", 1)[0] if actor.startswith("host:") else actor or "-"


def _seconds(text: str) -> float:
    """A finite positive number of seconds (before, `--interval inf` ended the dashboard in an OverflowError)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds above 0")
    return v


def add_ls_options(ls: argparse.ArgumentParser) -> None:
    """The options `session ls` and `worker ls` share: live refresh, JSON, where and as whom."""
    ls.add_argument("--watch", action="store_true", help="refresh live until Ctrl-C")
    ls.add_argument("--interval", type=_seconds, default=1.0, help="seconds between refreshes with --watch")
    ls.add_argument("--count", type=int, default=0, help="with --watch: stop after N refreshes (0: until Ctrl-C)")
    ls.add_argument("--json", action="store_true", help="print as JSON")
    add_connection_options(ls)


def add_connection_options(p: argparse.ArgumentParser) -> None:
    """Where and as whom: the controller, the token and client TLS (every command that calls the controller)."""
    p.add_argument("--controller", default=os.environ.get("KVFLEET_CONTROLLER", "127.0.0.1:50051"))
    p.add_argument("--token", default=os.environ.get("KVFLEET_TOKEN"))
    add_client_tls(p)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfleet session", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list sessions")
    ls.add_argument("--fleet", action="store_true", help="every node of the fleet (default: the controller's node)")
    ls.add_argument("--tenant", default=None, help="operator only: one tenant")
    add_ls_options(ls)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    from fleet.sdk import FleetClient

    console = Console()
    try:
        with FleetClient(args.controller, args.token, **client_tls(args)) as c:
            def rows() -> list[Any]:
                return c.sessions(fleet=args.fleet, tenant=args.tenant)

            if args.json:
                print(json.dumps([r.to_dict() for r in rows()], indent=1))
            elif args.watch:
                watch(console, lambda: render_sessions(rows()), args.interval, args.count)
            else:
                show(console, render_sessions(rows()))
    except KvfleetError as e:
        print(f"kvfleet session ls: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def watch(console: Console, render: Callable[[], Any], interval: float, count: int = 0) -> None:
    """Redraw `render()` in place every `interval` s (it re-polls the controller); `count` > 0 stops
    after that many polls. Shared by `session ls --watch` and `worker ls --watch`."""
    from rich.live import Live

    polls = 1
    with Live(render(), console=console, refresh_per_second=4) as live:
        while not count or polls < count:
            time.sleep(max(0.1, interval))
            live.update(render(), refresh=True)
            polls += 1
