"""A call in flight when its client is closed (close() from another thread or task) raises the SDK's "the client is
closed" FailedPrecondition, as a call made after close() does, against a real controller over loopback.

Before, grpc's own ending of the call came out: the sync client raised KvfleetError "CANCELLED: Channel closed!",
and the asyncio client raised asyncio.CancelledError into a task nobody cancelled (which `except Exception` does not
catch, and which asyncio treats as the task being cancelled)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from support.controller import start_controller, store_url
from support.lossy_relay import SilentRelay

from fleet.core.errors import FailedPrecondition
from fleet.sdk import AsyncFleetClient, FleetClient


async def _stalled(tmp_path: Path) -> tuple[Any, SilentRelay]:
    """A real controller behind a relay that is about to pass nothing: a call through it stays in flight."""
    ctl = await start_controller(store_url("sqlite", tmp_path), None)
    return ctl, SilentRelay(("127.0.0.1", int(ctl.address.rsplit(":", 1)[1])))


async def _until(cond: Any) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the call never started")


async def test_a_sync_call_in_flight_when_another_thread_closes_the_client(tmp_path: Path) -> None:
    ctl, relay = await _stalled(tmp_path)
    c = FleetClient(relay.address, timeout=30)
    errors: list[BaseException] = []

    def call(fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  # the test reads it
            errors.append(e)

    try:
        assert (await asyncio.to_thread(c.whoami)).tenant  # connected
        relay.silent = True
        calls = [threading.Thread(target=call, args=(lambda: c.append("s1", "hi", op_id="turn-1"),)),
                 threading.Thread(target=call, args=(c.whoami,))]
        for t in calls:
            t.start()
        await asyncio.sleep(0.3)  # both sent, neither answered
        c.close()
        for t in calls:
            await asyncio.to_thread(t.join, 10)
        assert len(errors) == 2 and all(isinstance(e, FailedPrecondition) for e in errors), errors
        assert all("in flight" in str(e) and "the client is closed" in str(e) for e in errors)
        keyed = [e for e in errors if getattr(e, "op_id", "")]
        assert len(keyed) == 1 and keyed[0].op_id == "turn-1" and "op_id='turn-1'" in str(keyed[0])
    finally:
        relay.close()
        await ctl.stop(0)


async def test_an_async_call_in_flight_when_another_task_closes_the_client(tmp_path: Path) -> None:
    ctl, relay = await _stalled(tmp_path)
    ac = AsyncFleetClient(relay.address, timeout=30)
    try:
        await ac.whoami()
        relay.silent = True
        pending = [asyncio.create_task(ac.whoami()), asyncio.create_task(ac.get_blob("ab" * 32)),
                   asyncio.create_task(ac.generate("s1", 4, op_id="gen-1"))]
        await asyncio.sleep(0.3)
        await ac.close()
        errors = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(e, FailedPrecondition) for e in errors), errors  # before: CancelledError
        assert all("in flight" in str(e) for e in errors) and errors[2].op_id == "gen-1"

        # the control: a task its caller cancels is still cancelled, closed client or not
        relay.silent = True
        other = AsyncFleetClient(relay.address, timeout=30)
        task = asyncio.create_task(other.whoami())
        await asyncio.sleep(0.3)
        task.cancel()
        await other.close()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        relay.close()
        await ctl.stop(0)
