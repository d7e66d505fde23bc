"""Op ids at the kernel host: a retry of a logged call is answered (replayed), a different call under a
logged op id is refused, whichever verb it is, before and after a regeneration from the log; logs written
before fingerprints regenerate and answer as before.

Real parts: a SessionKernel (the numpy kernel, the byte tokenizer) over a real SQLite store; no Ray (its
lanes are the calling thread).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.faults import mlp_fails_once
from support.inline_session import inline_session

from fleet.core.errors import AlreadyExists, InvalidArgument, Unavailable
from workers.session_kernel import SessionGone, SessionKernel, SessionTorn

IDS = np.random.default_rng(3).integers(0, 256, 40).tolist()


async def _started(store: Any) -> SessionKernel:
    sk = inline_session(store)
    await sk.create(IDS[:20], op_id="c1")
    await sk.append_message(IDS[20:30], "user", op_id="X")       # "transfer $10 to alice"
    return sk


async def _refused_unchanged(sk: SessionKernel, store: Any, call: Any) -> None:
    before = (len(store.oplog_read("acme", "s1")), list(sk._s.tokens), sk._s.digest())
    with pytest.raises(AlreadyExists, match="op_id '.+' was already used for a different call"):
        await call
    assert (len(store.oplog_read("acme", "s1")), list(sk._s.tokens), sk._s.digest()) == before


async def test_an_op_id_reused_for_a_different_call_is_refused_and_nothing_applied(store: Any) -> None:
    sk = await _started(store)
    await _refused_unchanged(sk, store, sk.append_message(IDS[30:40], "user", op_id="X"))   # other tokens
    await _refused_unchanged(sk, store, sk.append_message(IDS[20:30], "assistant", op_id="X"))  # other role
    await _refused_unchanged(sk, store, sk.append_output(IDS[20:30], op_id="X"))   # same ids, another verb
    await _refused_unchanged(sk, store, sk.generate(4, op_id="X"))   # before: the message's ids came back as output
    await _refused_unchanged(sk, store, sk.evict(1, "exact", op_id="X"))
    again = await sk.append_message(IDS[20:30], "user", op_id="X")   # control: the same call is its retry
    assert (again.replayed, again.result.piece_id, again.num_tokens) == (True, 1, 30)
    g = await sk.generate(4, op_id="g1")
    assert (await sk.generate(4, op_id="g1")).result == g.result    # a generate's retry: the same tokens
    await _refused_unchanged(sk, store, sk.generate(5, op_id="g1"))  # another count is another call
    await sk.evict(1, "exact", op_id="e1")
    assert (await sk.evict(1, "exact", op_id="e1")).replayed
    await _refused_unchanged(sk, store, sk.evict(1, "reposition", op_id="e1"))
    assert [op.get("op_fp") is not None for op in store.oplog_read("acme", "s1")] == [True] * 4  # every op: its call's


async def test_the_check_survives_a_regeneration_from_the_log(store: Any) -> None:
    live = await _started(store)
    await live.evict(1, "exact", op_id="e1")
    sk = inline_session(store)                                      # the host died: rebuilt from the log
    await sk.restore()
    assert sk._s.digest() == live._s.digest()
    await _refused_unchanged(sk, store, sk.append_message(IDS[30:40], "user", op_id="X"))
    await _refused_unchanged(sk, store, sk.evict(0, "exact", op_id="e1"))
    assert (await sk.append_message(IDS[20:30], "user", op_id="X")).replayed   # control: its retry
    assert (await sk.evict(1, "exact", op_id="e1")).replayed


async def test_a_log_written_before_fingerprints_regenerates_and_is_not_checked(store: Any) -> None:
    live = await _started(store)
    await live.evict(1, "exact", op_id="e1")
    old = [{k: v for k, v in op.items() if k != "op_fp"} for op in store.oplog_read("acme", "s1")]
    store.oplog_replace("acme", "s1", old)                         # the format before this change
    sk = inline_session(store)
    await sk.restore()
    assert (sk._s.digest(), len(sk._s)) == (live._s.digest(), 20)   # bit-identical, as before
    r = await sk.append_message(IDS[30:40], "user", op_id="X")       # unchecked: answered as before (docs/api.md)
    assert (r.replayed, r.num_tokens) == (True, 20)
    fresh = await sk.append_message(IDS[30:40], "user", op_id="X2")  # new calls on an old log are fingerprinted
    await _refused_unchanged(sk, store, sk.generate(2, op_id="X2"))
    assert fresh.num_tokens == 30


# ---- a call that fails after its op was logged: the torn state is never served ---------------------------

async def _three_pieces(store: Any, session_id: str = "s1") -> SessionKernel:
    sk = inline_session(store)
    sk.session_id = session_id
    await sk.create(IDS[:20], op_id="c1")
    await sk.append_message(IDS[20:30], "user", op_id="a1")       # piece 1: evicted
    await sk.append_message(IDS[30:40], "user", op_id="a2")       # piece 2: its survivor, recomputed
    return sk


async def test_an_evict_that_fails_after_logging_is_rebuilt_and_its_retry_matches_a_clean_one(
        store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = await _three_pieces(store, "clean")                   # control: a session that never failed
    await clean.evict(1, "exact", op_id="e1")
    sk = await _three_pieces(store)
    monkeypatch.setattr(sk.kernel.ops, "mlp", sk.kernel.ops.mlp)  # put back at the end
    mlp_fails_once(sk.kernel)
    with pytest.raises(SessionTorn, match=r"evict \(op_id 'e1'\) failed after its op was logged .*out of memory"
                                          r".*retry with the same op_id") as e:
        await sk.evict(1, "exact", op_id="e1")
    assert isinstance(e.value, Unavailable)                       # retryable (the SDK retries UNAVAILABLE)
    for call in (sk.evict(1, "exact", op_id="e1"), sk.digest(), sk.tokens(), sk.info()):
        with pytest.raises(SessionGone, match="rebuilt from its op log"):   # before: replayed=True at length 20
            await call
    rebuilt = inline_session(store)                             # what the fleet does on SessionGone
    await rebuilt.restore()
    r = await rebuilt.evict(1, "exact", op_id="e1")               # the fleet's retry, same op id
    assert (r.replayed, r.num_tokens, await rebuilt.digest()) == (True, 30, await clean.digest())


async def test_a_call_that_fails_before_logging_changes_nothing(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sk = await _three_pieces(store)
    with pytest.raises(InvalidArgument):
        await sk.append_message([1 << 20], "user", op_id="bad")   # refused before the log
    assert not sk.torn and len(store.oplog_read("acme", "s1")) == 3
    r = await sk.evict(1, "exact", op_id="e1")                    # served as before, no rebuild
    assert (r.replayed, r.num_tokens, sk.torn) == (False, 30, "")


# ---- op_index: the op's index in the log, None when the call logged nothing ---------------------------------

async def test_a_call_that_logs_nothing_answers_no_op_index_before_and_after_a_rebuild(store: Any) -> None:
    """A clean verdict logs nothing: its answer names no op of the log. Before, it named the previous call's (1, the
    append's) on the live session and None after a rebuild: the same call answered two ways."""
    from fleet.core.quarantine.detector import Verdict

    ref, clean = store.put(b"a harmless tool output", "acme"), Verdict(False, [])
    sk = await _started(store)
    r = await sk.admit_tool_result(ref, clean, op_id="adm-1")
    assert (r.op_index, r.replayed, len(store.oplog_read("acme", "s1"))) == (None, False, 2)   # before: 1
    rebuilt = inline_session(store)
    await rebuilt.restore()
    again = await rebuilt.admit_tool_result(ref, clean, op_id="adm-1")
    assert (again.op_index, again.result) == (r.op_index, r.result)
    logged = await rebuilt.append_output(IDS[30:35], op_id="a9")       # control: a call that logs answers its index
    assert (logged.op_index, (await rebuilt.append_output(IDS[30:35], op_id="a9")).op_index) == (2, 2)
