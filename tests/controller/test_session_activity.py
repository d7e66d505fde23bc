"""SessionActivity (controller/session_reaper.py): what it remembers of calls that failed."""

from __future__ import annotations

import contextlib

import pytest

from controller.session_reaper import SessionActivity
from fleet.core.errors import NotFound, ResourceExhausted


async def _call(act: SessionActivity, key: tuple[str, str], err: Exception | None) -> None:
    with pytest.raises(type(err)) if err is not None else contextlib.nullcontext():
        async with act.calling(key):
            if err is not None:
                raise err


async def test_a_failed_call_on_a_session_never_seen_leaves_nothing() -> None:
    """A create refused (the fleet has no room) for ever-new ids leaves no entry behind; a session that exists
    stays touched when one of its calls fails, and is forgotten when it is gone. NOTE: before, every refused
    create left an entry for good (review finding)."""
    act = SessionActivity()
    for i in range(100):
        await _call(act, ("acme", f"new-{i}"), ResourceExhausted("no node has room"))
    assert act.touched == {} and act.in_flight == {}
    await _call(act, ("acme", "s"), None)                        # created
    await _call(act, ("acme", "s"), ResourceExhausted("quota"))  # exists: still touched
    assert set(act.touched) == {("acme", "s")}
    await _call(act, ("acme", "s"), NotFound("closed"))           # gone
    assert act.touched == {}
