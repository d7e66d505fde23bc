"""A look that finds a sleep-mode operation in flight (vllm:sleep_mode_operations_in_flight > 0), pure.

vLLM records a sleep's state and counts the operation only once it has completed (reference §4), so while a /sleep
is held (a mode=wait drain, or a call its engine has not applied yet) the look reads awake with an unmoved count,
and the gauge alone tells. Reference §6 rule 1: a warm hit needs it at 0.
"""

from __future__ import annotations

from fleet.core.rank_state import Look, RankState

SERVING = RankState(epoch=3, phase="serving", kv="preserved", serving=True, seq=9, epoch_seq=4)
KEPT = RankState(epoch=3, phase="paused", kv="preserved", serving=False, seq=9, epoch_seq=4)  # pause, cache kept


def test_the_gauge_is_folded_into_the_look() -> None:
    assert Look.of(False, {"awake": 1.0}, 2.0, 2.0, in_flight=1.0) == Look(False, False, 0, 2.0, in_flight=True)
    assert Look.of(False, {"awake": 1.0}, 2.0, 2.0).in_flight is False  # absent (never created) or 0


def test_a_serving_rank_with_an_operation_in_flight_stops_serving_and_drops_its_index() -> None:
    t = SERVING.observed(Look.of(False, {"awake": 1.0}, 2.0, 2.0, in_flight=1.0))
    assert (t.state.serving, t.state.epoch, t.state.phase, t.state.kv, t.drop_index, t.reason) == (
        False, 4, "paused", "unknown", True, "sleep_op_in_flight")
    control = SERVING.observed(Look.of(False, {"awake": 1.0}, 2.0, 2.0))  # nothing in flight: serving, as it was
    assert (control.state, control.drop_index) == (SERVING, False)
    # the operation done, awake (a wake, say): the rank serves again, its index rebuilt from the new epoch's stores
    back = t.state.observed(Look.of(False, {"awake": 1.0}, 2.0, 2.0))
    assert (back.state.serving, back.state.epoch, back.drop_index) == (True, 4, False)


def test_a_rank_paused_keeping_its_cache_drops_it_for_a_sleep_in_flight() -> None:
    """docs/lifecycle.md: a rank paused keeping its KV keeps its index at level 0 with no new /sleep; a sleep in
    flight is a new one, which vLLM counts only once it has completed (and perhaps reset the cache)."""
    t = KEPT.observed(Look.of(True, {"awake": 1.0}, 2.0, 2.0, in_flight=1.0))
    assert (t.state.epoch, t.state.kv, t.state.serving, t.drop_index) == (4, "unknown", False, True)
    control = KEPT.observed(Look.of(True, {"awake": 1.0}, 2.0, 2.0))
    assert (control.state, control.drop_index) == (KEPT, False)
