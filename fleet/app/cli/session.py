"""`kvfleet session ls --fleet`: the fleet dashboard of agent sessions.

    kvfleet session ls --fleet [--watch [--interval S] [--count N]] [--json] [--controller HOST:PORT] [--token T]

Columns: session, tenant, node and actor, kernel backend and device, tokens, bytes held alone and
shared, hit rate (shared prefix tokens / tokens), quarantined spans, lifecycle state and epoch, last active. --watch
refreshes live; --json prints the rows for scripts (with --watch: one JSON line per refresh). KVFLEET_CONTROLLER / KVFLEET_TOKEN are the
defaults of --controller / --token.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleet.app.cli.cells import cell, cells
from fleet.app.cli.ls_modes import check_watch_flags, listing
from fleet.app.cli.main import INTERRUPTED
from fleet.app.cli.records import records
from fleet.core.errors import KvfleetError
from fleet.core.whole import whole
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


Cell = Callable[[Any, float], str]
# (header, cell, numeric): numeric cells never wrap and keep their whole width (before, at 80 columns the
# numbers were squeezed to "…"); text cells fold onto more lines
FULL: tuple[tuple[str, Cell, bool], ...] = (
    ("session", lambda r, now: r.session_id, False),
    ("tenant", lambda r, now: r.tenant, False),
    ("node / host", lambda r, now: f"{r.node[:8]} / {_host(r.actor)}", False),
    ("kernel", lambda r, now: _kernel(r), False),
    ("tokens", lambda r, now: f"{r.num_tokens:,}", True),
    ("history", lambda r, now: f"{r.history_tokens:,}" if r.history_tokens else "-", True),
    ("alone", lambda r, now: _bytes(r.bytes_alone), True),
    ("shared", lambda r, now: _bytes(r.bytes_shared), True),
    ("hit rate", lambda r, now: f"{100 * r.hit_rate:.1f}%", True),
    ("quarantined", lambda r, now: str(r.quarantined_spans), True),
    ("state / epoch", lambda r, now: f"{r.state} / {r.epoch}", False),
    ("last active", lambda r, now: _ago(r.last_active, now), True),
)
_COL = {c[0]: c for c in FULL}
# Narrow terminals: node/host, then kernel go; below that, related numbers fold into two-line cells
FOLDED: tuple[tuple[str, Cell, bool], ...] = (
    _COL["session"], _COL["tenant"],
    ("tokens\nhistory", lambda r, now: f"{_COL['tokens'][1](r, now)}\n{_COL['history'][1](r, now)}", True),
    ("alone\nshared", lambda r, now: f"{_bytes(r.bytes_alone)}\n{_bytes(r.bytes_shared)}", True),
    ("hit\nrate", _COL["hit rate"][1], True), ("quar.", _COL["quarantined"][1], True),
    ("state /\nepoch", _COL["state / epoch"][1], False), ("last\nactive", _COL["last active"][1], True),
)
LAYOUTS = (FULL, tuple(c for c in FULL if c[0] != "node / host"),
           tuple(c for c in FULL if c[0] not in ("node / host", "kernel")), FOLDED)
TEXT_MIN = 6  # the least width a text column is given when choosing a layout
RECORDS_TEXT_MIN = 3  # narrower still than FOLDED with text columns this wide: one record per session


def layout_for(rows: Sequence[Any], width: int | None, now: float) -> tuple[tuple[str, Cell, bool], ...]:
    """The widest layout whose numbers fit whole in `width` columns (None: as wide as it needs, FULL)."""
    if width is None:
        return FULL
    for cols in LAYOUTS:
        if _need(cols, rows, now, folded=cols is FOLDED) <= width:
            return cols
    return FOLDED


def _need(cols: Sequence[tuple[str, Cell, bool]], rows: Sequence[Any], now: float, folded: bool,
          text_min: int = TEXT_MIN) -> int:
    """Columns the table takes with every number whole and each text column `text_min` wide."""
    def widest(col: tuple[str, Cell, bool]) -> int:
        texts = [col[0], *(col[1](r, now) for r in rows)]
        return max(len(line) for t in texts for line in t.split("\n"))

    cells_w = sum(widest(c) if c[2] else text_min for c in cols)
    return cells_w + (len(cols) + 1 if folded else 3 * len(cols) + 1)  # borders (+ padding 1 each side unfolded)


def render_sessions(rows: Sequence[Any], title: str | Text = "kvfleet sessions", now: float | None = None,
                    width: int | None = None) -> Table:
    """The dashboard table (rows: fleet.sdk.sessions.SessionRow) for a terminal `width` columns wide (None: as
    wide as it needs): node/host, then kernel are left out, then numbers folded two to a cell, and below that each
    session is a record (fleet/app/cli/records.py), so that no number is ever cut."""
    now = time.time() if now is None else now
    cols = layout_for(rows, width, now)
    if width is not None and _need(FOLDED, rows, now, folded=True, text_min=RECORDS_TEXT_MIN) > width:  # records
        return records(title, [h for h, _, _ in FULL], [[cell(get(r, now)) for _, get, _ in FULL] for r in rows],
                       "(no sessions)", [_style(r) for r in rows])
    folded = cols is FOLDED
    t = Table(title=title, title_justify="left", padding=(0, 0) if folded else (0, 1), show_lines=folded)
    for head, _, numeric in cols:
        t.add_column(head, justify="right" if numeric else "left", no_wrap=numeric, overflow="fold")
    for r in rows:
        t.add_row(*(_cell(get(r, now), numeric) for _, get, numeric in cols), style=_style(r))
    if not rows:
        t.add_row("(no sessions)", *[""] * (len(cols) - 1))
    return t


def listing_title(caller: Any, fleet: bool, tenant: str | None) -> Text:
    """What the listing is: whose sessions (the caller's own, as a tenant; one tenant's or every tenant's, as the
    operator) and where from (every node, or the controller's node). `caller`: fleet.sdk.types.Caller (WhoAmI).
    NOTE: the title said "kvfleet sessions (fleet)" whatever was listed: without --fleet, or for a tenant token
    (found by review)."""
    where = "fleet-wide" if fleet else "the controller's node only"
    if caller.role == "operator":
        whose = f"tenant {tenant}" if tenant else "every tenant"
    else:
        whose = f"tenant {caller.tenant} (yours)"
    return cell(f"kvfleet sessions: {whose}, {where}")  # the tenant as sent, as a cell shows it


def _style(r: Any) -> str | None:
    return "red" if r.state == "lost" else "yellow" if r.state == "regenerated" else None


def _cell(value: str, numeric: bool) -> Text:
    """A numeric cell's lines (ours: digits and units) kept as lines; a text cell shown as sent (cells.cell)."""
    return Text("\n").join(cells(*value.split("\n"))) if numeric else cell(value)


def width_of(console: Console) -> int | None:
    """The width a dashboard is laid out for: the terminal's, or None (as wide as it needs) into a pipe."""
    return console.width if console.is_terminal else None


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
    ls.add_argument("--interval", type=_seconds, default=None, help="with --watch: seconds between refreshes (default 1)")
    ls.add_argument("--count", type=whole(zero_means="until Ctrl-C"), default=None,
                    help="with --watch: stop after N refreshes (0: until Ctrl-C)")
    ls.add_argument("--json", action="store_true", help="print as JSON (with --watch: one JSON line per refresh)")
    add_connection_options(ls)


def add_connection_options(p: argparse.ArgumentParser) -> None:
    """Where and as whom: the controller, the token and client TLS (every command that calls the controller)."""
    p.add_argument("--controller", default=os.environ.get("KVFLEET_CONTROLLER", "127.0.0.1:50051"),
                   help="the controller's HOST:PORT (env KVFLEET_CONTROLLER; default 127.0.0.1:50051)")
    p.add_argument("--token", default=os.environ.get("KVFLEET_TOKEN"),
                   help="your bearer token (env KVFLEET_TOKEN; not needed with the controller's auth off)")
    add_client_tls(p)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfleet session", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list sessions")
    ls.add_argument("--fleet", action="store_true", help="every node of the fleet (default: the controller's node)")
    ls.add_argument("--tenant", default=None, help="operator only: one tenant")
    add_ls_options(ls)
    args = p.parse_args(argv)
    check_watch_flags(ls, args)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    from fleet.sdk import FleetClient

    console = Console()
    try:
        with FleetClient(args.controller, args.token, **client_tls(args)) as c:
            def rows() -> list[Any]:
                return c.sessions(fleet=args.fleet, tenant=args.tenant)

            def as_data() -> list[dict[str, Any]]:
                return [r.to_dict() for r in rows()]

            @functools.cache
            def title() -> Text:  # asked once, in the first frame (a Ctrl-C there ends a --watch as one later does)
                return listing_title(c.whoami(), args.fleet, args.tenant)

            def table() -> Table:
                return render_sessions(rows(), title=title(), width=width_of(console))

            listing(args, console, as_data, table)
    except KvfleetError as e:
        print(f"kvfleet session ls: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return INTERRUPTED
    return 0


