"""References taken before they were named (665e636 and earlier: one bare reference per logged tool result, a fork
one per tool result of its log) are all given back by the close that deletes the log, on both store backends. A
session that logged a blob twice held two. NOTE: the first named release gave back one per distinct blob: the others
stayed for good and GC never collected the blob."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.cas import open_store
from fleet.core.errors import NotFound
from fleet.core.oplog import AppendOp, parse_log, to_dict
from workers.placement import delete_log

LATER = 10 * 365 * 86400  # every lease has long run out


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    url = f"sqlite:///{tmp_path / 'refs.db'}" if request.param == "sqlite" else request.getfixturevalue("redis_url")
    with open_store(url) as s:
        yield s


def _legacy_log(store: object, session_id: str, ops: list[AppendOp]) -> None:
    """What 665e636's code left: the log, and one reference with no name per tool result in it."""
    for op in ops:
        store.add_ref(op.ref, op.tenant)  # type: ignore[attr-defined]
    store.oplog_replace("acme", session_id, [to_dict(op) for op in ops])  # type: ignore[attr-defined]


def _close(store: object, session_id: str) -> None:
    """What a close runs (FleetBase._drop_log): the log as read, then delete_log."""
    delete_log(store, "acme", session_id, parse_log(store.oplog_read("acme", session_id)))  # type: ignore[attr-defined]


def test_a_legacy_session_and_its_fork_give_back_every_reference_they_took(store: object) -> None:
    s = store
    x = s.put(b"a tool result logged twice", "acme")  # type: ignore[attr-defined]
    y = s.put(b"a tool result logged once", "acme")  # type: ignore[attr-defined]
    parent = [AppendOp(0, "tool_result", "acme", ref=x, num_tokens=3), AppendOp(1, "tool_result", "acme", ref=y,
              num_tokens=3), AppendOp(2, "tool_result", "acme", ref=x, num_tokens=3)]
    _legacy_log(s, "a", parent)
    _legacy_log(s, "b", parent)  # its fork: the parent's ops, a reference per tool result again
    assert (s.stat(x, "acme").refs, s.stat(y, "acme").refs) == (4, 2)  # type: ignore[attr-defined]
    _close(s, "b")
    # the parent still logs both: its own references stay (NOTE: before, x kept 3, the fork's second one included)
    assert (s.stat(x, "acme").refs, s.stat(y, "acme").refs) == (2, 1)  # type: ignore[attr-defined]
    assert s.gc(now=time.time() + LATER) == 0  # type: ignore[attr-defined]
    _close(s, "a")
    _close(s, "a")  # run again (a retry, a second controller): the log is gone, nothing more is given back
    assert (s.stat(x, "acme").refs, s.stat(y, "acme").refs) == (0, 0)  # type: ignore[attr-defined]
    assert s.gc(now=time.time() + LATER) == 2  # type: ignore[attr-defined]  # NOTE: before, x stood at 2 for good
    with pytest.raises(NotFound):
        s.stat(x, "acme")  # type: ignore[attr-defined]
