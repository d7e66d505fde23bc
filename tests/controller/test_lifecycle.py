"""The witness table of DESIGN §9 and the per-rank epoch state machine (pure)."""

from __future__ import annotations

import pytest

from fleet.core import lifecycle as lc
from fleet.core.errors import InvalidArgument
from fleet.core.rank_state import RankState

P, F, U = "preserved", "forgotten", "unknown"

TABLE = [
    # (verb, params, response) -> (phase, kv, demoted, serving)
    (("pause", {"clear_cache": False}, {"status": "paused"}), ("paused", P, False, False)),
    (("pause", {"mode": "keep", "clear_cache": False}, {"status": "paused"}), ("paused", P, False, False)),
    (("pause", {"mode": "keep"}, {"status": "paused"}), ("paused", F, True, False)),  # vLLM's engine resets then too
    (("sleep", {"level": 0}, {"status": "sleeping", "level": 0}), ("paused", P, False, False)),
    (("pause", {"clear_cache": True}, {"status": "paused"}), ("paused", F, True, False)),
    (("pause", {}, {"status": "paused"}), ("paused", F, True, False)),
    (("sleep", {"level": 1}, {"status": "sleeping", "level": 1}), ("sleeping", F, True, False)),
    (("sleep", {"level": 2}, None), ("sleeping", F, True, False)),
    (("sleep", {}, None), ("error", U, True, False)),
    (("reset_prefix_cache", {}, {"success": True}), ("serving", F, True, True)),
    (("reset_prefix_cache", {}, {"success": False}), ("serving", U, True, True)),
    (("reset_prefix_cache", {}, None), ("serving", U, True, True)),
    (("wake_up", {}, {"status": "awake", "tags": None}), ("serving", U, True, True)),
    (("wake_up", {"tags": ["weights"]}, {"status": "sleeping", "tags": ["weights"]}), ("sleeping", U, True, False)),
    (("resume", {}, {"status": "resumed"}), ("serving", P, False, True)),
    (("release_kv_cache_memory", {}, {"status": "kv_cache_released"}), ("paused", F, True, False)),
]


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r[0][0]}{r[0][1]}->{r[1][1]}")
def test_witness_table(row: tuple) -> None:
    (verb, params, resp), expected = row
    w = lc.witness(lc.plan(verb, **params), resp)
    assert (w.phase, w.kv, w.warm_demoted, w.serving) == expected


def test_invalid_sleep_level_lowers_to_error_unknown() -> None:
    for bad in (None, 3, -1, "1", 1.0, True):
        w = lc.lower_sleep(bad)
        assert (w.phase, w.kv, w.warm_demoted, w.serving) == ("error", U, True, False)
    r = lc.restart_witness()
    assert (r.phase, r.kv, r.warm_demoted, r.serving) == ("serving", F, True, True)


@pytest.mark.parametrize("verb,params", [
    ("nap", {}), ("sleep", {"level": 3}), ("sleep", {"level": "1"}), ("sleep", {"mode": "later"}),
    ("wake_up", {"tags": ["gpu"]}), ("wake_up", {"tags": "weights"}), ("pause", {"clear_cache": "yes"}),
    ("resume", {"level": 1}), ("reset_prefix_cache", {"tags": ["weights"]}),
])
def test_bad_verbs_and_params(verb: str, params: dict) -> None:
    with pytest.raises(InvalidArgument):
        lc.plan(verb, **params)


def test_unknown_never_keeps_warmth() -> None:
    with pytest.raises(AssertionError):
        lc.Witness("x", "serving", U, warm_demoted=False, serving=True)


def test_epoch_machine_forgetting_verb_bumps_before_and_after_and_fences() -> None:
    s = RankState(epoch=3, phase="serving", kv=P, serving=True, seq=9)
    call = lc.plan("sleep", level=1)
    b = s.begin(call.before)
    assert (b.epoch, b.serving, b.epoch_seq) == (4, False, 10)  # demoted before vLLM is called
    f = b.finish(lc.witness(call, {"status": "sleeping"}), clear_queued=lc.queues_clear(call, None))
    assert (f.epoch, f.phase, f.fence, f.serving) == (5, "sleeping", "clear", False)
    wake = lc.plan("wake_up")
    g = f.begin(wake.before).finish(lc.witness(wake, {"status": "awake"}), clear_queued=False)
    assert g.fence == "clear" and g.serving  # the queued AllBlocksCleared is still awaited after wake


def test_epoch_machine_preserving_verb_keeps_epoch() -> None:
    s = RankState(epoch=2, phase="serving", kv=P, serving=True, seq=4)
    call = lc.plan("pause", mode="keep", clear_cache=False)
    b = s.begin(call.before)
    assert (b.epoch, b.serving) == (2, False)
    f = b.finish(lc.witness(call, {"status": "paused"}), clear_queued=lc.queues_clear(call, None))
    assert (f.epoch, f.phase, f.kv, f.fence) == (2, "paused", P, "")
    r = lc.plan("resume")
    g = f.begin(r.before).finish(lc.witness(r, {"status": "resumed"}), clear_queued=False)
    assert (g.epoch, g.serving, g.kv) == (2, True, P)  # warmth intact


def test_queues_clear() -> None:
    assert lc.queues_clear(lc.plan("sleep", level=2), None)
    assert not lc.queues_clear(lc.plan("sleep", level=0), None)
    assert lc.queues_clear(lc.plan("pause"), None) and not lc.queues_clear(lc.plan("pause", clear_cache=False), None)
    assert lc.queues_clear(lc.plan("pause", mode="keep"), None)  # vLLM's engine resets in keep mode too
    assert lc.queues_clear(lc.plan("reset_prefix_cache"), {"success": True})
    assert not lc.queues_clear(lc.plan("reset_prefix_cache"), {"success": False})


def test_state_roundtrip() -> None:
    s = RankState(epoch=7, phase="paused", kv=P, serving=False, seq=12, epoch_seq=5, fence="clear")
    assert RankState.from_json(s.to_json() | {"future_field": 1}) == s
