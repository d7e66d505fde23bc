"""`kvfleet worker ls`: the vLLM workers the controller routes to, and the kernel nodes.

    kvfleet worker ls [--watch [--interval S]] [--json] [--controller HOST:PORT] [--token T]

vLLM workers, one row per (worker, dp_rank): serving and warm (separate questions), phase, KV
disposition (preserved | forgotten | unknown), epoch, blocks indexed, last KV-event seq, load.
Kernel nodes: sessions, radix prefix cache use, hit rate. The workers need an operator or reader token; the
kernel nodes come from the session listing (operator), asked with a short deadline (NODES_S): when it fails
or is slow (a reader token, the session fleet's Ray down) the workers are shown and the nodes say why not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.table import Table

from fleet.app.cli.cells import cell, cells, least_width, table_width
from fleet.app.cli.ls_modes import check_watch_flags, listing
from fleet.app.cli.main import INTERRUPTED
from fleet.app.cli.records import records
from fleet.app.cli.session import add_ls_options, width_of
from fleet.core.errors import KvfleetError

NODES_S = 8.0  # the kernel nodes' deadline (above the controller's 5 s check of an unreachable Ray)


WORKER_COLUMNS = ("worker", "rank", "url", "model", "serving", "warm", "phase", "kv", "epoch", "blocks", "seq", "load")
NUMERIC = frozenset({"rank", "epoch", "blocks", "seq", "load"})
LEFT_OUT = ("url", "model")  # in this order, where the terminal is too narrow for every column (--json has them)


def render_workers(workers: Sequence[Any], nodes: Sequence[Any], nodes_error: str = "",
                   width: int | None = None) -> Group:
    """Two tables: vLLM workers (fleet.sdk.WorkerInfo) and kernel nodes (fleet.sdk.sessions.NodeRow);
    `nodes_error`: why the kernel nodes could not be listed (shown in their table). For a terminal `width` columns
    wide (None: as wide as it needs) the url, then the model, are left out where every cell would not fit; numbers
    never wrap and text folds, so no number is cut. NOTE: at 80 columns rich squeezed every cell, numbers to
    "123…"."""
    rows = [(cells(x.name, str(r.dp_rank), x.url, x.model, "yes" if r.serving else "NO", "yes" if r.warm else "no",
                   r.phase, r.kv, str(r.epoch), f"{r.num_blocks:,}", str(r.last_seq), f"{r.load:g}"), r.serving)
            for x in workers for r in x.ranks]
    keep = list(WORKER_COLUMNS)

    def needed() -> int:
        return table_width(keep, [[r[WORKER_COLUMNS.index(c)] for c in keep] for r, _ in rows])

    for gone in LEFT_OUT:
        if width is None or needed() <= width:
            break
        keep.remove(gone)
    tight = width is not None and needed() > width
    fold = least_width(keep, [[r[WORKER_COLUMNS.index(c)] for c in keep] for r, _ in rows], [c in NUMERIC for c in keep])
    if width is not None and fold > width:  # not even unpadded with text folded: records, every column
        return Group(records("vLLM workers", WORKER_COLUMNS, [r for r, _ in rows], "(none registered)",
                             [None if serving else "yellow" for _, serving in rows]), _nodes(nodes, nodes_error, width))
    w = Table(title="vLLM workers", title_justify="left", padding=(0, 0) if tight else (0, 1))
    for col in keep:
        w.add_column(col, justify="right" if col in NUMERIC else "left", no_wrap=col in NUMERIC, overflow="fold")
    for row, serving in rows:
        w.add_row(*(row[WORKER_COLUMNS.index(c)] for c in keep), style=None if serving else "yellow")
    if not workers:
        w.add_row("(none registered)", *[""] * (len(keep) - 1))
    return Group(w, _nodes(nodes, nodes_error, width))


def _nodes(nodes: Sequence[Any], nodes_error: str, width: int | None) -> Table:
    """The kernel nodes' table (fleet.sdk.sessions.NodeRow), with why they are not listed below it."""
    node_rows = [cells(x.node[:12], str(x.num_sessions), f"{x.cached_tokens:,}", f"{x.capacity_tokens:,}",
                       f"{x.queried_tokens:,}", f"{x.hit_tokens:,}", str(x.evicted_blocks), f"{100 * x.hit_rate:.1f}%")
                 for x in nodes]
    heads = ("node", "sessions", "cached\ntokens", "capacity", "queried", "hit\ntokens", "evicted\nblocks", "hit\nrate")
    tight = width is not None and table_width(heads, node_rows) > width
    if width is not None and least_width(heads, node_rows, [h != "node" for h in heads]) > width:
        return records("kernel nodes", heads, node_rows,
                       f"(not listed: {nodes_error})" if nodes_error else "(no kernel nodes yet)")
    n = Table(title="kernel nodes", title_justify="left", padding=(0, 0) if tight else (0, 1))
    for col in heads:
        n.add_column(col, justify="left" if col == "node" else "right", no_wrap=True, overflow="fold")
    for row in node_rows:
        n.add_row(*row)
    # NOTE: below the table, where it wraps: a row of the numbers' columns, which never wrap, was cut at 80 columns
    if nodes_error:
        n.caption, n.caption_justify = cell(f"(not listed: {nodes_error})"), "left"
    elif not nodes:
        n.caption, n.caption_justify = "(no kernel nodes yet)", "left"
    return n


def snapshot(c: Any) -> dict[str, Any]:
    """The workers, and the kernel nodes or why they could not be listed (the workers are shown either way).
    NOTE: before, a failed or slow session listing (a reader token; a controller whose Ray does not answer)
    ended `worker ls` with its error, or held it 120 s, and showed no worker."""
    workers = c.workers()
    try:
        return {"workers": workers, "nodes": c.fleet_sessions(fleet=True).nodes, "nodes_error": ""}
    except KvfleetError as e:
        return {"workers": workers, "nodes": [], "nodes_error": f"{type(e).__name__}: {e}"}


def as_data(snap: dict[str, Any]) -> dict[str, Any]:
    from dataclasses import asdict

    out = {"workers": [asdict(w) for w in snap["workers"]], "nodes": [n.to_dict() for n in snap["nodes"]]}
    return {**out, **({"nodes_error": snap["nodes_error"]} if snap["nodes_error"] else {})}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfleet worker", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list vLLM workers and kernel nodes")
    add_ls_options(ls)
    args = p.parse_args(argv)
    check_watch_flags(ls, args)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    from fleet.sdk import FleetClient, RetryPolicy

    console = Console()
    try:
        from fleet.sdk.tls_flags import client_tls

        with FleetClient(args.controller, args.token, session_timeout=NODES_S, retry=RetryPolicy(deadline_s=NODES_S),
                         **client_tls(args)) as c:
            listing(args, console, lambda: as_data(snapshot(c)),
                    lambda: render_workers(**snapshot(c), width=width_of(console)))
    except KvfleetError as e:
        print(f"kvfleet worker ls: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return INTERRUPTED
    return 0
