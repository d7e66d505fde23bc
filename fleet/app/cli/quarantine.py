"""`kvfleet quarantine`: the tool results the proxy withheld, per tenant; operator verdicts.

    kvfleet quarantine ls [--tenant T] [--limit N] [--json] [--watch]   # a tenant token: its own
    kvfleet quarantine set REF QUARANTINED|CLEAN|clear [--reason R]     # operator: a (late) verdict

`ref` is the SHA-256 (hex) of the tool result's bytes, as the proxy's x-kvfleet-quarantined header and
the answer's kvfleet.quarantined field name it. An operator verdict overrides the detector for every later
request that carries those bytes, in every tenant; `clear` drops it (docs/quarantine.md). `ls` shows a ref's first
16 digits (`--json`: whole); `set` takes such a prefix (16 digits or more) of a recent quarantine's ref too.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.app.cli.cells import cells, least_width
from fleet.app.cli.ls_modes import check_watch_flags, listing
from fleet.app.cli.main import INTERRUPTED
from fleet.app.cli.records import records as as_records
from fleet.app.cli.session import add_connection_options, add_ls_options, width_of
from fleet.core.errors import InvalidArgument, KvfleetError
from fleet.core.verdict import CLEAN, QUARANTINED
from fleet.core.whole import whole

COLUMNS = ("tenant", "ref", "action", "source", "reasons", "seen", "last seen")
NUMERIC = frozenset({"seen", "last seen"})
SHORT_REF = 16  # the ref's digits `ls` shows, and the fewest `set` takes
MAX_LISTED = 1000  # the most rows the controller lists (an operator: every tenant's), which `set` resolves against


def render(records: Sequence[Any], now: float | None = None, width: int | None = None) -> Table:
    """One row per (tenant, ref), most recently seen first, for a terminal `width` columns wide (None: as wide as it
    needs): text folds onto more lines and numbers never wrap; where they cannot stay whole, one record per row.
    NOTE: before, text cells were cut with "…" (at 80 columns "acme-res…", "placehol…", the reasons), and at 40
    the counts too (found by review)."""
    now = time.time() if now is None else now
    rows = [cells(r.tenant, r.ref[:SHORT_REF] + "…", r.action, r.source, ", ".join(r.reasons), str(r.num_seen),
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


def as_data(records: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"tenant": r.tenant, "ref": r.ref, "action": r.action, "source": r.source, "reasons": list(r.reasons),
             "num_seen": r.num_seen, "first_seen": r.first_seen, "last_seen": r.last_seen} for r in records]


def resolve_ref(ref: str, known: Sequence[str]) -> str:
    """The whole ref `ref` names: itself when 64 digits long (the controller checks it), else the one ref of `known`
    it begins (at least SHORT_REF hex digits; a trailing "…", as `ls` prints it, is dropped). NOTE: `ls` showed 16
    digits and `set` took only the whole 64, so a ref copied from the table was refused (found by review).

    Raises:
        InvalidArgument: too short or not hex, no ref of `known` begins so, or more than one does (naming them).
    """
    prefix = ref.removesuffix("…").lower()
    if len(prefix) == 64:
        return prefix
    if len(prefix) < SHORT_REF or any(c not in "0123456789abcdef" for c in prefix):
        raise InvalidArgument(f"ref {ref[:80]!r}: give the 64 hex digits of the bytes' SHA-256, or the first "
                              f"{SHORT_REF} or more as `kvfleet quarantine ls` shows them")
    matches = sorted({k for k in known if k.startswith(prefix)})
    if len(matches) > 1:
        raise InvalidArgument(f"ref {prefix}… is more than one quarantined tool result's: {', '.join(matches)}; "
                              "give more digits")
    if not matches:
        raise InvalidArgument(f"ref {prefix}… begins no ref of the {len(known)} most recent quarantined tool results; "
                              "give the whole ref (`kvfleet quarantine ls --json` lists them)")
    return matches[0]




def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfleet quarantine", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="recent quarantined tool results")
    ls.add_argument("--tenant", default="", help="operator: one tenant (default: every tenant)")
    ls.add_argument("--limit", type=whole(1, MAX_LISTED), default=100, help="at most this many rows, 1-1000 (default 100)")
    add_ls_options(ls)
    st = sub.add_parser("set", help="operator: set or clear a verdict on a tool result's bytes")
    st.add_argument("ref", help="SHA-256 (hex) of the tool result's bytes, or its first 16+ digits as ls shows them")
    st.add_argument("verdict", choices=(QUARANTINED, CLEAN, "clear"))
    st.add_argument("--reason", action="append", default=[], help="why (repeatable)")
    add_connection_options(st)  # NOTE: not ls's --watch/--interval/--count/--json: a verdict is set once, one line
    args = p.parse_args(argv)
    if args.cmd == "ls":
        check_watch_flags(ls, args)
    return args


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
                known = [] if len(args.ref) == 64 else [r.ref for r in c.list_quarantines(limit=MAX_LISTED)]
                ref = resolve_ref(args.ref, known)
                c.set_verdict(ref, "" if args.verdict == "clear" else args.verdict, reasons=args.reason)
                print(f"{ref}: {args.verdict}")
                return 0

            def records() -> Any:
                return c.list_quarantines(tenant=args.tenant, limit=args.limit)

            listing(args, console, lambda: as_data(records()), lambda: render(records(), width=width_of(console)))
    except KvfleetError as e:
        print(f"kvfleet quarantine {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return INTERRUPTED
    return 0
