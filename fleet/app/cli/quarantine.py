"""`kvfleet quarantine`: the tool results the proxy withheld, per tenant; operator verdicts.

    kvfleet quarantine ls [--tenant T] [--limit N] [--json] [--watch]   # a tenant token: its own
    kvfleet quarantine set REF QUARANTINED|CLEAN|clear [--reason R]     # operator: a (late) verdict

`ref` is the SHA-256 (hex) of the tool result's bytes, as the proxy's x-kvfleet-quarantined header and
the answer's kvfleet.quarantined field name it. An operator verdict overrides the detector for every later
request that carries those bytes, in every tenant; `clear` drops it (docs/quarantine.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.app.cli.cells import cells, least_width, show
from fleet.app.cli.records import records as as_records
from fleet.app.cli.session import INTERRUPTED, add_connection_options, add_ls_options, width_of
from fleet.core.errors import KvfleetError
from fleet.core.verdict import CLEAN, QUARANTINED

COLUMNS = ("tenant", "ref", "action", "source", "reasons", "seen", "last seen")
NUMERIC = frozenset({"seen", "last seen"})


def render(records: Sequence[Any], now: float | None = None, width: int | None = None) -> Table:
    """One row per (tenant, ref), most recently seen first, for a terminal `width` columns wide (None: as wide as it
    needs): text folds onto more lines and numbers never wrap; where they cannot stay whole, one record per row.
    NOTE: before, text cells were cut with "…" (at 80 columns "acme-res…", "placehol…", the reasons), and at 40
    the counts too (found by review)."""
    now = time.time() if now is None else now
    rows = [cells(r.tenant, r.ref[:16] + "…", r.action, r.source, ", ".join(r.reasons), str(r.num_seen),
                  f"{max(now - r.last_seen, 0):.0f}s ago") for r in records]
    title = "quarantined tool results"
    if width is not None and least_width(COLUMNS, rows, [c in NUMERIC for c in COLUMNS]) > width:
        return as_records(title, COLUMNS, rows, "(none)")
    t = Table(title=title, title_justify="left")
    for col in COLUMNS:
        t.add_column(col, justify="right" if col in NUMERIC else "left", no_wrap=col in NUMERIC, overflow="fold")
    for row in rows:
        t.add_row(*row)
    if not records:
        t.add_row("(none)", *[""] * 6)
    return t


def as_json(records: Sequence[Any]) -> str:
    return json.dumps([{"tenant": r.tenant, "ref": r.ref, "action": r.action, "source": r.source,
                        "reasons": list(r.reasons), "num_seen": r.num_seen, "first_seen": r.first_seen,
                        "last_seen": r.last_seen} for r in records], indent=1)


def _limit(text: str) -> int:
    """--limit: 1..1000 (the controller answers at most 1000 rows; the field is unsigned)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= 1000:
        raise argparse.ArgumentTypeError(f"{n}: expected 1 to 1000")
    return n


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfleet quarantine", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="recent quarantined tool results")
    ls.add_argument("--tenant", default="", help="operator: one tenant (default: every tenant)")
    ls.add_argument("--limit", type=_limit, default=100, help="at most this many rows, 1-1000 (default 100)")
    add_ls_options(ls)
    st = sub.add_parser("set", help="operator: set or clear a verdict on a tool result's bytes")
    st.add_argument("ref", help="SHA-256 (hex) of the tool result's bytes")
    st.add_argument("verdict", choices=(QUARANTINED, CLEAN, "clear"))
    st.add_argument("--reason", action="append", default=[], help="why (repeatable)")
    add_connection_options(st)  # NOTE: not ls's --watch/--interval/--count/--json: a verdict is set once, one line
    return p.parse_args(argv)


def _client(args: argparse.Namespace) -> Any:
    """The client, with every TLS flag as session.py passes them. NOTE: before, TLS was passed only with --tls or
    --tls-ca, so --tls-cert/--tls-key alone (mutual TLS) were ignored and the call went out in plaintext."""
    from fleet.sdk import FleetClient
    from fleet.sdk.tls_flags import client_tls

    return FleetClient(args.controller, args.token, **client_tls(args))


def main(argv: list[str]) -> int:
    args = parse(argv)
    console = Console()
    try:
        with _client(args) as c:
            if args.cmd == "set":
                c.set_verdict(args.ref, "" if args.verdict == "clear" else args.verdict, reasons=args.reason)
                print(f"{args.ref}: {args.verdict}")
                return 0

            def records() -> Any:
                return c.list_quarantines(tenant=args.tenant, limit=args.limit)

            if args.json:
                print(as_json(records()))
            elif args.watch:
                from fleet.app.cli.session import watch

                watch(console, lambda: render(records(), width=width_of(console)), args.interval, args.count)
            else:
                show(console, render(records(), width=width_of(console)))
    except KvfleetError as e:
        print(f"kvfleet quarantine {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return INTERRUPTED
    return 0
