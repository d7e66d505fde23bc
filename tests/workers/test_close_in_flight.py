"""An op still waiting for a lane thread when its session is closed: `close` stops waiting for it after its
timeout, the fleet deletes the log and drops its blob references, and the op, when it finally runs, must log
nothing, take no reference and not be acknowledged (SessionGone: the fleet answers NotFound, the session being
closed).

Real parts: a SessionKernel (the numpy kernel, the byte tokenizer) over a real SQLite store; no Ray (its lane is
an awaitable the test holds shut, as a host whose threads are all busy with long prefills would).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from support.inline_session import inline_session

from fleet.core.oplog import parse_log
from workers.placement import delete_log
from workers.session_kernel import SessionGone, SessionKernel

IDS = np.random.default_rng(3).integers(0, 256, 20).tolist()


class _HeldLane:
    """The host's lanes, with every thread busy until `free` is set."""

    def __init__(self) -> None:
        self.free = asyncio.Event()
        self.free.set()

    async def __call__(self, tenant: str, fn: Any) -> Any:
        await self.free.wait()
        return fn()


async def _waiting_tool_result(store: Any, ref: str) -> tuple[SessionKernel, _HeldLane, asyncio.Task[Any]]:
    """A created session whose add_tool_result holds the session's lock, waiting for a lane thread."""
    lane = _HeldLane()
    sk = inline_session(store, lane=lane)
    await sk.create(IDS, op_id="c1")
    lane.free.clear()
    call = asyncio.ensure_future(sk.add_tool_result(ref, op_id="tool-1"))
    await asyncio.sleep(0.05)
    assert sk._lock.locked()                                    # in flight: past the lock, waiting for a thread
    return sk, lane, call


async def test_an_op_that_runs_after_close_gave_up_logs_nothing_and_holds_no_ref(store: Any) -> None:
    ref = store.put(b"a tool result the session reads", "acme")
    sk, lane, call = await _waiting_tool_result(store, ref)
    await sk.close(timeout_s=0.1)                               # gives up waiting for the op in flight
    delete_log(store, "acme", "s1", parse_log(store.oplog_read("acme", "s1")))   # then the fleet's _discard
    lane.free.set()                                             # the op finally gets its thread
    with pytest.raises(SessionGone, match="closed"):           # before: acknowledged, op_index 0
        await call
    assert store.oplog_read("acme", "s1") == []                 # before: an orphan log of the closed session
    assert store.stat(ref, "acme").refs == 0                    # before: 1, never dropped (the blob never GC'd)


async def test_control_the_same_op_without_close_is_logged_and_holds_its_ref(store: Any) -> None:
    ref = store.put(b"a tool result the session reads", "acme")
    sk, lane, call = await _waiting_tool_result(store, ref)
    lane.free.set()
    r = await call
    assert (r.replayed, r.op_index, r.result.ref) == (False, 1, ref)
    assert [op["op"] for op in store.oplog_read("acme", "s1")] == ["append", "append"]
    assert store.stat(ref, "acme").refs == 1
