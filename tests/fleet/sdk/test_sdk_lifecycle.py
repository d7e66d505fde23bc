"""A client's life: used after close(), in a forked child, from another event loop. Each case that could crash runs in a child process, so a crash fails the
test instead of killing pytest."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.controller import start_controller, store_url

from fleet.core.errors import FailedPrecondition, Unavailable
from fleet.sdk import NO_RETRY, AsyncFleetClient

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


FORKED = """
    import os, signal, sys
    from fleet.sdk import NO_RETRY, FleetClient

    c = FleetClient(sys.argv[1], retry=NO_RETRY, timeout=5)
    print("parent:", c.whoami().tenant, flush=True)    # the channel is connected
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)                               # before the fix the call hung here, past its 5 s deadline
        try:
            c.whoami()
        except Exception as e:
            print("child:", type(e).__name__, e, flush=True)
        c.close()                                      # marks it closed, leaves the parent's channel alone
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child status:", status, flush=True)
    print("parent again:", c.whoami().tenant, flush=True)
"""


async def test_a_client_called_in_a_forked_child_raises_instead_of_hanging(tmp_path: Path) -> None:
    # Found by review: grpc channels do not survive a fork; a FleetClient used before os.fork() hung forever in the
    # child. Before the fix the child was killed by its SIGALRM after 10 s and printed nothing ("child status: 14").
    ctl = await start_controller(store_url("sqlite", tmp_path), None)
    try:
        r = await asyncio.to_thread(child, FORKED, ctl.address)
    finally:
        await ctl.stop(0)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 4, (r.stdout, r.stderr[-2000:])
    assert lines[0] == "parent: local" and lines[2] == "child status: 0" and lines[3] == "parent again: local"
    assert lines[1].startswith("child: FailedPrecondition FleetClient of 127.0.0.1:") and "forked from it" in lines[1]
    assert "one client per process" in lines[1]


def test_an_async_client_serves_the_event_loop_of_its_first_call() -> None:
    # Found by review: an AsyncFleetClient made outside a running loop (a module-level client) raised a raw
    # RuntimeError ("... attached to a different loop") at every call, and so did one reused by a second
    # asyncio.run. Before the fix the first asyncio.run raised that RuntimeError.
    c = AsyncFleetClient("127.0.0.1:1", retry=NO_RETRY)  # made outside any loop; no controller there
    with pytest.raises(Unavailable, match="controller at 127.0.0.1:1 unavailable after 1 attempt"):
        asyncio.run(c.whoami())
    with pytest.raises(FailedPrecondition, match="serves the event loop of its first call.*one client per event loop"):
        asyncio.run(c.whoami())
    asyncio.run(c.close())  # from another loop: marked closed, nothing raised
    with pytest.raises(FailedPrecondition, match="the client is closed"):
        asyncio.run(c.whoami())


def test_a_client_reconnects_at_most_two_seconds_apart_unless_its_options_say_otherwise() -> None:
    from fleet.sdk import FleetClient

    c = FleetClient("127.0.0.1:1")
    mine = FleetClient("127.0.0.1:1", options=[("grpc.max_reconnect_backoff_ms", 30_000)])
    try:
        assert dict(c._options)["grpc.max_reconnect_backoff_ms"] == 2000   # gRPC's own default grows to 120 s
        assert dict(mine._options)["grpc.max_reconnect_backoff_ms"] == 30_000
        assert [k for k, _ in mine._options].count("grpc.max_reconnect_backoff_ms") == 1
        assert dict(mine._options)["grpc.initial_reconnect_backoff_ms"] == 500
    finally:
        c.close()
        mine.close()
