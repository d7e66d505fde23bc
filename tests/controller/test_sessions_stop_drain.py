"""A stop lets the session calls running on the lanes' threads end before the fleet and Ray are shut down
under them (controller/sessions.py Sessions.close).

NOTE: before, close() dropped the lanes without waiting: a `kvfleet demo` stopped by SIGINT mid-run shut Ray
down while a lane's thread was inside a Ray call, and died in Ray's core worker (exit 1, its temporary
directory left) or waited ~30 s at exit for the thread (1 run in 3 of each, 0 in 4 after).
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

import controller.sessions as sessions_mod
from controller.sessions import Sessions


async def _cancelled_call(s: Sessions, release: threading.Event, ended: list[float]) -> None:
    """A call of tenant acme running on its lane, whose RPC was cancelled (its thread goes on)."""

    def call() -> None:
        release.wait(30)
        ended.append(time.monotonic())

    task = asyncio.ensure_future(s._run("acme", call))
    while not s._lanes._load:  # admitted: its thread runs it
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    task.cancel()


async def test_close_returns_once_the_running_calls_have_ended() -> None:
    s = Sessions(SimpleNamespace())
    release, ended = threading.Event(), list[float]()
    await _cancelled_call(s, release, ended)
    threading.Timer(0.3, release.set).start()  # the call ends 0.3 s into the stop
    await asyncio.to_thread(s.close)
    closed = time.monotonic()
    assert ended and ended[0] <= closed  # it ran to its end before close() returned


async def test_close_gives_up_waiting_after_drain_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions_mod, "DRAIN_S", 0.2)
    s = Sessions(SimpleNamespace())
    release, ended = threading.Event(), list[float]()
    await _cancelled_call(s, release, ended)
    try:
        await asyncio.to_thread(s.close)
        assert ended == []  # a call that does not end does not hold the stop
    finally:
        release.set()
