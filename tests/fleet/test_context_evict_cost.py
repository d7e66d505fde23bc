"""An eviction moves the pieces in the KV cache after it, and visits no other piece: a session's log of many
appends and evictions is replayed (a rebuild after its host died, every fork) in work linear in its length.

NOTE: both evictions (`evict_piece`, and the ledger's in `replay_over`) visited every piece the session ever
appended, evicted ones included, so a sliding-window agent's log of n append/evict pairs cost O(n^2) to replay:
5,000 pairs 2.4 s, 100,000 pairs 408 s for one rebuild on a kernel host (in one process on the shared 2-core
machine), far past the 60 s call timeout, on a lane thread of its tenant that holds the interpreter lock with no
yield point for the host's CPU share. The cost is counted in lines executed (sys.settrace), not by a clock.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from fleet.core import context as context_module
from fleet.core import ledger as ledger_module
from fleet.core import pieces as pieces_module
from fleet.core.context import SessionContext
from fleet.core.kernel import ByteTokenizer, Kernel, ModelConfig
from fleet.core.kernel.pacing import paced
from fleet.core.oplog import AppendOp, EvictOp, Op

SYSTEM = tuple(range(32, 64))


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    return Kernel.synthetic(ModelConfig.tiny(), seed=0)


def sliding_window(num_pairs: int) -> list[Op]:
    """A system prompt, then `num_pairs` times: append a one-token message, evict the one before it."""
    ops: list[Op] = [AppendOp(0, "system", "acme", SYSTEM, role="system")]
    for i in range(1, num_pairs + 1):
        ops.append(AppendOp(i, "message", "acme", (65 + i % 26,), role="user"))
        if i > 1:
            ops.append(EvictOp(i - 1, len(SYSTEM), 1, "exact"))
    return ops


def lines_run(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn()'s result, and the lines of the ledger's modules (fleet/core/context.py, ledger.py, pieces.py) it executed."""
    count, files = [0], {m.__file__ for m in (context_module, ledger_module, pieces_module)}

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename not in files:
            return None
        if event == "line":
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        return fn(), count[0]
    finally:
        sys.settrace(None)


def test_replaying_a_sliding_window_log_is_linear_and_exact(kernel: Kernel) -> None:
    tok = ByteTokenizer(512)
    ledger = {n: lines_run(lambda n=n: SessionContext.replay_over(sliding_window(n), kernel.session(), tok,
                                                                    lambda r: b"")) for n in (400, 800)}
    by_op = {n: lines_run(lambda n=n: SessionContext.replay(sliding_window(n), kernel, tok, lambda r: b""))
             for n in (100, 200)}
    print({n: c for n, (_, c) in ledger.items()}, {n: c for n, (_, c) in by_op.items()})
    # twice the log, about twice the work (it was about four times: every eviction visited every piece)
    assert ledger[800][1] < 2.3 * ledger[400][1], ledger
    assert by_op[200][1] < 2.3 * by_op[100][1], by_op
    # and the same ledger and cache either way, the session holding its system prompt and its last message
    short, over = by_op[200][0], SessionContext.replay_over(sliding_window(200), kernel.session(), tok, lambda r: b"")
    assert short.pieces == over.pieces and short.digest() == over.digest()
    assert [(p.piece_id, p.start, p.state) for p in short.pieces if p.state != "evicted"] == [
        (0, 0, "resident"), (200, 32, "resident")]
    assert list(short.session.tokens) == [*SYSTEM, 65 + 200 % 26]


def test_the_ledger_stops_at_yield_points_as_the_kernel_does(kernel: Kernel) -> None:
    """A host shares its CPU between tenants at the kernel's yield points (workers/lanes.py `CpuShare`): the ledger of
    a long log stops at them too. NOTE: it had none, so a tenant's rebuild or fork of a long log held the CPU from
    the share; only the final prefill stopped (control: the same prefill alone)."""
    ops, calls = sliding_window(2000), [0]

    def hook() -> None:
        calls[0] += 1

    with paced(hook):
        ctx = SessionContext.replay_over(ops, kernel.session(), ByteTokenizer(512), lambda r: b"")
        replayed, calls[0] = calls[0], 0
        kernel.session().append(list(ctx.session.tokens))   # the final prefill alone
    assert len(ops) == 4000 and list(ctx.session.tokens) == [*SYSTEM, 65 + 2000 % 26]
    print(f"yield points: {replayed} in the replay, {calls[0]} in its final prefill")
    assert calls[0] > 0 and replayed >= calls[0] + len(ops) // 128, (replayed, calls[0])
