"""A live session whose op log went behind its host's back (the store lost its data: a flushed Redis, one restarted
empty) refuses its next write instead of acknowledging it into a new log that begins mid-session, which no rebuild
could replay (workers/session_ops.py SessionOps._log_gone). The host tells by the append's index alone: 0, for a
session whose log held ops.

Real parts: a SessionKernel (the numpy kernel, the byte tokenizer) over a real SQLite store; no Ray (its lanes are
the calling thread). The fleet turns the host's SessionGone into a rebuild, which finds the record gone: NotFound.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.inline_session import inline_session

from fleet.core.errors import NotFound
from workers.session_kernel import SessionGone

IDS = np.random.default_rng(5).integers(0, 256, 40).tolist()


async def test_a_write_into_a_log_that_went_is_refused_and_nothing_stays_logged(store: Any) -> None:
    sk = inline_session(store)
    await sk.create(IDS[:20], op_id="c1")
    first = await sk.append_message(IDS[20:30], "user", op_id="a1")
    assert first.op_index == 1 and len(store.oplog_read("acme", "s1")) == 2  # control: the log as it was
    store.oplog_delete("acme", "s1")                       # the store lost its data
    with pytest.raises(SessionGone, match="its op log is gone"):
        await sk.append_message(IDS[30:40], "user", op_id="a2")   # before: acknowledged at op_index 0
    assert store.oplog_read("acme", "s1") == []            # nothing acknowledged sits in a log that cannot rebuild it
    with pytest.raises(NotFound):                          # SessionGone is a NotFound: never served again
        await sk.append_output(IDS[30:40], op_id="a3")
    assert store.oplog_read("acme", "s1") == []


async def test_control_a_new_session_and_its_rebuild_write_from_index_0_and_on(store: Any) -> None:
    sk = inline_session(store, "s2")
    await sk.create(IDS[:20], op_id="c1")                  # its first op lands at 0: no log went
    assert (await sk.append_message(IDS[20:30], "user", op_id="a1")).op_index == 1
    again = inline_session(store, "s2")                    # its host died: rebuilt from the log, then written on
    await again.restore()
    assert (await again.append_output(IDS[30:40], op_id="a2")).op_index == 2
    assert len(store.oplog_read("acme", "s2")) == 3
