"""`--watch` into a pipe (`| tee dash.log`, `> file`, `kubectl exec` without -t) prints each refresh as it comes.

Before, it ran rich's Live display there too, which draws nothing where stdout is not a terminal until it stops:
`kvfleet quarantine ls --watch > q.log` wrote 0 bytes over ten refreshes, `--count 4` printed one frame (the
last), and a watch ended by SIGTERM wrote nothing at all (found by review)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from support.controller import make_tokens, start_controller, store_url

TITLE = "quarantined tool results"


async def _watch(addr: str, token: str, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.app.cli.main", "quarantine", "ls", "--watch", "--controller", addr,
        "--token", token, *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"})


async def test_a_piped_watch_prints_each_refresh_as_it_comes(tmp_path: Path) -> None:
    tokens = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tokens)
    try:
        # A refresh a minute: the first frame must come out at once, not when the watch ends.
        proc = await _watch(ctl.address, tokens.op, "--interval", "60")
        assert proc.stdout is not None
        try:
            first = await asyncio.wait_for(proc.stdout.readline(), 60)  # before: nothing until it stopped
        finally:
            proc.send_signal(signal.SIGTERM)
            rest, err = await proc.communicate()
        print(f"first line {first!r}; then {rest.decode()!r}; stderr {err.decode()!r}")
        assert TITLE in first.decode()
        # Every refresh of a bounded watch, one after another, as plain text (no cursor movement or colour).
        proc = await _watch(ctl.address, tokens.op, "--interval", "0.1", "--count", "3")
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        text = out.decode()
        print(text, err.decode())
        assert proc.returncode == 0 and text.count(TITLE) == 3 and "\x1b" not in text  # before: 1 frame
    finally:
        await ctl.stop(grace=0)
