"""What a host's event loop does for one session's call does not grow with the session's op log: the log is
packed, unpacked and searched on the tenant's lane (workers/lanes.py), and Ray moves bytes.

A host answers every tenant's calls on one event loop. NOTE: a fork point returned its log as a list, which Ray
pickled on that loop (1.2 s for 200,000 ops), a working set or the pieces (an item per piece, evicted ones too) the
same, and a retried op searched the log there (50 ms); beside one tenant's
fork points of such a session, another tenant's `info` on the host took 2.7 s at the median (1 ms alone). Here the
loop's work is counted in lines run on the loop's thread (sys.settrace traces only its own thread; the lanes run
on threads of their own), not by a clock: twice the log, the same work.

Real parts: a SessionKernel (the numpy kernel, the byte tokenizer) over a real SQLite store, on real TenantLanes;
no Ray (what Ray does with a result on the loop, pickling it, is done here on the loop too).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

from support.inline_session import inline_session

from fleet.core.oplog import AppendOp, EvictOp, call_fingerprint, to_dict
from workers.lanes import TenantLanes
from workers.packed import unpack_ops
from workers.session_kernel import SessionKernel

SYSTEM = tuple(range(32, 96))


def _log(num_pairs: int) -> list[Any]:
    """A system prompt, then `num_pairs` times: append a one-token message, evict it."""
    ops: list[Any] = [AppendOp(0, "system", "acme", SYSTEM, role="system", op_id="c0")]
    for i in range(1, num_pairs + 1):
        ops.append(AppendOp(i, "message", "acme", (65,), role="user", op_id=f"a{i}",
                            op_fp=call_fingerprint("append_message", [65], "user")))
        ops.append(EvictOp(i, 64, 1, "exact", "evict", f"e{i}", call_fingerprint("evict", i, "exact")))
    return ops


async def _rebuilt(store: Any, num_pairs: int) -> SessionKernel:
    lanes = TenantLanes(2)
    sk = inline_session(store, f"s{num_pairs}", lanes.run)
    store.oplog_replace("acme", sk.session_id, [to_dict(op) for op in _log(num_pairs)])
    await sk.restore()
    return sk


async def _loop_lines(call: Callable[[], Awaitable[Any]]) -> tuple[Any, int]:
    """The call's answer, pickled as Ray would on the loop, and the lines run on this (the loop's) thread meanwhile."""
    count = [0]

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        out = await call()
        pickle.dumps(out)
    finally:
        sys.settrace(None)
    return out, count[0]


async def test_a_fork_point_and_a_retry_cost_the_loop_the_same_whatever_the_log(store: Any) -> None:
    work: dict[str, dict[int, int]] = {"fork_point": {}, "retry": {}, "working_set": {}, "pieces": {}}
    for n in (1000, 2000):
        sk = await _rebuilt(store, n)
        point, work["fork_point"][n] = await _loop_lines(sk.fork_point)
        assert unpack_ops(point["ops"]) == sk.context.ops and point["tokens"] == list(SYSTEM)
        r, work["retry"][n] = await _loop_lines(lambda sk=sk, n=n: sk.evict(n, "exact", f"e{n}"))  # type: ignore[misc]
        assert r.replayed and r.result.start == 64 and r.num_tokens == 64
        assert len(store.oplog_read("acme", sk.session_id)) == 2 * n + 1   # answered from the log, nothing logged
        ws, work["working_set"][n] = await _loop_lines(lambda sk=sk: sk.working_set(10_000))  # type: ignore[misc]
        pieces, work["pieces"][n] = await _loop_lines(sk.pieces)
        assert len(ws.unpack().items) == len(pieces.unpack()) == n + 1   # one per piece, evicted too
    print(work)
    # the loop's work is the same for twice the log (it grew with it: the log pickled and searched on the loop)
    for verb, lines in work.items():
        assert lines[2000] < lines[1000] + 200, (verb, lines)
