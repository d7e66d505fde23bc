"""`kvfleet witness`: run the kernel's exactness witnesses live and print them with their controls.

    kvfleet witness [--backend numpy|torch] [--device cpu|cuda] [--threads N] [--no-hf] [--json]

Exit status 0 when every witness ran and holds; 1 when one fails or could not run (the row says
"not run" and what to install); 2 on bad arguments; 130 on Ctrl-C
(fleet/app/cli/main.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from fleet.app.cli.sigint import sigint_as_interrupt
from fleet.core.errors import KvfleetError


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return "nan" if math.isnan(x) else ("0" if x == 0.0 else f"{x:.3e}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfleet witness", description="run the KV kernel exactness witnesses live"
    )
    p.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] with --backend torch")
    p.add_argument("--threads", type=int, default=1, help="BLAS/intra-op threads the kernel pins (default 1)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face parity witness")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _table(env: dict[str, Any], rows: list[Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        title=f"kvfleet kernel witnesses — backend={env['backend']} device={env['device']} "
        f"threads={env['threads']}\nCPU: {env['cpu']} · {env['blas']} · tile={env['tile_size']} "
        f"block={env['block_size']}"
    )
    for col in ("witness", "claim", "max|Δ|", "control", "1-ulp control", "status", "note"):
        t.add_column(col)
    style = {"holds": "[green]holds[/]", "FAILS": "[red]FAILS[/]", "not run": "[yellow]not run[/]"}
    for r in rows:
        t.add_row(
            escape(r.name),
            r.claim,
            _fmt(r.value),
            _fmt(r.control),
            _fmt(r.ulp_control),
            style[r.status],
            escape(r.note),
        )
    console = Console()
    if not console.is_terminal:  # piped or captured: no 80-column wrap of the witness names
        console = Console(width=200)
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        # NOTE: a Ctrl-C in numpy's or torch's init (they load here) became their ImportError: a traceback, exit 1
        with sigint_as_interrupt():
            from fleet.core.kernel.exactness import environment, run_checks

            env = environment(args.backend, args.device, args.threads)
            rows = run_checks(args.backend, args.device, args.threads, hf=not args.no_hf)
    except KvfleetError as e:
        print(f"kvfleet witness: {e}", file=sys.stderr)
        return 2
    ok = all(r.ok for r in rows)
    if args.json:
        print(json.dumps({"env": env, "ok": ok, "witnesses": [r.as_dict() for r in rows]}, indent=2))
    else:
        _table(env, rows)
    for r in rows:
        if not r.ran:
            print(f"kvfleet witness: {r.name}: {r.note}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
