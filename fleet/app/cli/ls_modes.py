"""The flags `session ls`, `worker ls` and `quarantine ls` share that only --watch gives a meaning to, and --json
with --watch: one JSON document per refresh, one per line (JSON Lines), each flushed as it is polled.

NOTE: `--count 3` without --watch and `--json --watch` were both taken without a word and listed once, as if
neither flag had been given (found by review). --count alone is now a usage error naming the fix (exit 2), and
`--json --watch` is what a script reading a stream wants: a line per refresh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console

from fleet.app.cli.cells import fit, show


def check_watch_flags(ls: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 with `ls`'s usage where --count or --interval is given without --watch; else their defaults (--count 0:
    until Ctrl-C; --interval 1 s). Before, `ls --interval 5` printed once and ignored the interval, silently."""
    if args.count is not None and not args.watch:
        ls.error("argument --count: it counts the refreshes of --watch: add --watch, or leave --count out")
    if args.interval is not None and not args.watch:
        ls.error("argument --interval: it spaces the refreshes of --watch: add --watch, or leave --interval out")
    args.count = args.count or 0
    args.interval = 1.0 if args.interval is None else args.interval


def watch_json(data: Callable[[], Any], interval: float, count: int = 0) -> None:
    """Print `data()` (re-polled each time) as one compact JSON line every `interval` s, flushed at once; `count` > 0
    stops after that many lines. Ctrl-C ends it normally, as it ends the table's --watch (`watch`)."""
    polls = 0
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            print(json.dumps(data()), flush=True)
            polls += 1
            if count and polls >= count:
                return
            time.sleep(max(0.1, interval))


def listing(args: argparse.Namespace, console: Console, data: Callable[[], Any], table: Callable[[], Any]) -> None:
    """What an `ls` prints by its flags: `data()` as JSON lines (--json --watch) or one indented document (--json),
    `table()` redrawn (--watch) or printed once. Each call polls the controller again."""
    if args.json and args.watch:
        watch_json(data, args.interval, args.count)
    elif args.json:
        print(json.dumps(data(), indent=1))
    elif args.watch:
        watch(console, table, args.interval, args.count)
    else:
        show(console, table())


def watch(console: Console, render: Callable[[], Any], interval: float, count: int = 0) -> None:
    """Redraw `render()` in place every `interval` s (it re-polls the controller); `count` > 0 stops
    after that many polls. Shared by `session ls --watch`, `worker ls --watch` and `quarantine ls --watch` (`listing`). Into a
    pipe, each frame is printed as it comes (_frames). Ctrl-C ends it normally.
    """
    from rich.live import Live

    if not console.is_terminal:
        _frames(console, render, interval, count)
        return
    polls = 1
    with contextlib.suppress(KeyboardInterrupt), Live(fit(console, render()), console=console,
                                                      refresh_per_second=4) as live:
        while not count or polls < count:
            time.sleep(max(0.1, interval))
            live.update(fit(console, render()), refresh=True)
            polls += 1


def _frames(console: Console, render: Callable[[], Any], interval: float, count: int) -> None:
    """A watch into a pipe: each frame printed (as wide as it needs, as show() prints) and flushed when it is
    polled, a blank line between frames. NOTE: rich's Live draws nothing where stdout is not a terminal until it
    stops, so `--watch > log` wrote 0 bytes while it ran, then only the last frame, or nothing on SIGTERM."""
    polls = 0
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            if polls:
                console.print()
            show(console, render())
            console.file.flush()
            polls += 1
            if count and polls >= count:
                return
            time.sleep(max(0.1, interval))
