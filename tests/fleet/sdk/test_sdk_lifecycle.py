"""A client's life: used after close(). Each case that could crash runs in a child process, so a crash fails the
test instead of killing pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the child imports this checkout's fleet (its sys.path[0] is the cwd)


def child(code: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


AFTER_CLOSE = """
    import asyncio
    from fleet.core.errors import Unavailable
    from fleet.sdk import NO_RETRY, AsyncFleetClient, FleetClient

    def sync_calls(c):
        return [lambda: c.whoami(), lambda: c.put_blob(b"x"), lambda: c.create_session("s1", "hi")]

    used = FleetClient("127.0.0.1:1", retry=NO_RETRY)
    try:
        used.whoami()                      # its stub is built (no controller there: Unavailable)
    except Unavailable:
        pass
    for c in (used, FleetClient("127.0.0.1:1")):
        c.close()
        c.close()                          # idempotent
        for call in sync_calls(c):         # before: a ValueError, then SIGSEGV (a stub built on the closed channel)
            try:
                call()
            except Exception as e:
                print("sync:", type(e).__name__, e, flush=True)

    async def main():
        async with AsyncFleetClient("127.0.0.1:1") as ac:
            pass
        await ac.close()
        for call in (ac.whoami, lambda: ac.stat_blob("ab" * 32), lambda: ac.append("s1", "hi")):
            try:
                await call()               # before: UsageError, or heap corruption (abort)
            except Exception as e:
                print("async:", type(e).__name__, e, flush=True)
    asyncio.run(main())
    print("alive", flush=True)
"""


def test_every_call_after_close_raises_failed_precondition_and_nothing_crashes() -> None:
    # Found by review: FleetClient.close() did not mark the client closed, and a call whose stub was not built yet
    # built it on the closed channel: SIGSEGV (sync), malloc abort (asyncio). Before the fix the child died with
    # -11 (SIGSEGV) at the first put_blob, after
    # a raw ValueError from the whoami.
    r = child(AFTER_CLOSE)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert lines[-1] == "alive" and len(lines) == 10, r.stdout
    assert [x.split(":")[0] for x in lines[:-1]] == ["sync"] * 6 + ["async"] * 3
    assert all("FailedPrecondition the client is closed (FleetClient of 127.0.0.1:1" in x for x in lines[:6])
    assert all("FailedPrecondition the client is closed (AsyncFleetClient of 127.0.0.1:1" in x for x in lines[6:9])
