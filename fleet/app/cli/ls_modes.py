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
    stops after that many lines. Ctrl-C ends it normally, as it ends the table's --watch (session.watch)."""
    polls = 0
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            print(json.dumps(data()), flush=True)
            polls += 1
            if count and polls >= count:
                return
            time.sleep(max(0.1, interval))
