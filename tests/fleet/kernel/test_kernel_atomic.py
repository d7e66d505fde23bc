"""An operation that raises part way (an allocation failure, CUDA out of memory) leaves the session as
it was: same digest, length, tokens, last_logits and block count. Found by review: an exact evict
truncated the session first and recomputed the survivors after, so a failure there left 50 of 200
tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from support.kernels import make_kernel, rand_ids

from fleet.core.kernel import Kernel, ModelConfig, max_abs_delta

IDS = rand_ids(3, 200)


def _state(s: Any) -> tuple[object, ...]:
    last = s.last_logits
    return s.digest(), len(s), s.tokens, None if last is None else last.tobytes(), s.memory()


def _flaky(real: Callable[..., Any], nth: int) -> Callable[..., Any]:
    """`real`, except that its nth call raises as an out-of-memory error would."""
    calls = [0]

    def f(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(*a, **kw)

    return f


def _generated(k: Kernel, n: int) -> Any:
    s = k.session()
    s.append(IDS)
    s.generate(1 + n)
    return s


OPS = {
    "evict exact (50, 10)": lambda s: s.evict(50, 10, "exact"),
    "evict tail (last 10)": lambda s: s.evict(len(s) - 10, 10, "exact"),
    "evict reposition (50, 10)": lambda s: s.evict(50, 10, "reposition"),
    "append 20": lambda s: s.append(IDS[:20]),
    "generate 3": lambda s: s.generate(3),
}
# (op method, its nth call raises): a failure in the recompute (mlp, attention), in the
# re-rotation (rope) and in reposition's check (rope_rows)
FAULTS = [("mlp", 2), ("attention", 3), ("rope", 1), ("rope_rows", 1)]


@pytest.mark.parametrize("what", list(OPS))
def test_a_failed_operation_leaves_the_session_unchanged(backend: str, what: str, monkeypatch: Any) -> None:
    k = make_kernel(backend)
    raised = []
    for method, nth in FAULTS:
        s = k.session()
        s.append(IDS)
        s.generate(1)  # 201 tokens, last_logits set
        before = _state(s)
        with monkeypatch.context() as m:
            m.setattr(k.ops, method, _flaky(getattr(k.ops, method), nth))
            try:
                OPS[what](s)
                continue  # the fault is not on this operation's path
            except RuntimeError:
                raised.append(method)
        if what == "generate 3" and len(s) > 201:  # each decoded token is all or nothing: keep those done
            before = _state(_generated(k, len(s) - 201))
        print(f"[atomic {backend}] {what}, {method} call {nth} raised: unchanged={_state(s) == before}")
        assert _state(s) == before
    assert raised  # control: the injected fault did fire
    # the session still works: the same operation afterwards equals a session that never failed
    s, ref = k.session(), k.session()
    for x in (s, ref):
        x.append(IDS)
        x.generate(1)
    with monkeypatch.context() as m:
        m.setattr(k.ops, raised[0], _flaky(getattr(k.ops, raised[0]), 1))
        with pytest.raises(RuntimeError):
            OPS[what](s)
    OPS[what](s)
    OPS[what](ref)
    assert s.digest() == ref.digest() and len(s) == len(ref)
    assert max_abs_delta(s.append(IDS[:5]), ref.append(IDS[:5])) == 0.0


def test_failed_exact_evict_then_evict_equals_never_saw(backend: str, monkeypatch: Any) -> None:
    k = make_kernel(backend)
    s = k.session()
    s.append(IDS)
    before = _state(s)
    with monkeypatch.context() as m:
        m.setattr(k.ops, "mlp", _flaky(k.ops.mlp, 2))
        with pytest.raises(RuntimeError, match="injected"):
            s.evict(50, 10, "exact")
    assert _state(s) == before  # before the fix: 200 -> 50 tokens, stale last_logits
    r = s.evict(50, 10, "exact")
    never = k.session()
    never.append(IDS[:50] + IDS[60:])
    assert r.exact and s.digest() == never.digest()
    assert max_abs_delta(s.last_logits, never.last_logits) == 0.0
    kept = k.session()
    kept.append(IDS[:190])
    assert max_abs_delta(kept.last_logits, never.last_logits) > 0  # control: the span kept differs


def test_a_failed_layer0_memo_fill_is_not_remembered(backend: str) -> None:
    """A token whose layer-0 row failed to compute is computed again next time (it was recorded in
    the memo's index before its row was filled, so later tiles gathered a stale row)."""
    k = Kernel.synthetic(ModelConfig.tiny(), seed=0, backend=backend, tile_size=32)
    real = k.ops._row0
    k.ops._row0 = _flaky(real, 3)
    s = k.session()
    with pytest.raises(RuntimeError):
        s.append(IDS[:40])
    k.ops._row0 = real
    assert len(s) == 0 and s.memory().num_blocks == 0
    got = s.append(IDS[:40])
    ref = make_kernel(backend).session().append(IDS[:40])
    assert max_abs_delta(got, ref) == 0.0
