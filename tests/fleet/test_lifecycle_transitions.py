"""The fence and epoch rules of `fleet.core.rank_state` transitions, pure: no ZMQ, no HTTP, no store.

Each test pins exact values and pairs the rule with a control: the neighbouring input the rule
must treat differently, so that a rule dropped or inverted fails here.
"""

from __future__ import annotations

from fleet.core import lifecycle as lc
from fleet.core.rank_state import Look, RankState, Transition

P, F, U = "preserved", "forgotten", "unknown"
SERVING = RankState(epoch=3, phase="serving", kv=P, serving=True, seq=9, epoch_seq=4, start_time=100.0,
                    version="0.33.0")


def look(asleep: bool = False, slept_between: bool = False, level: int = 0) -> Look:
    return Look(asleep, slept_between, level)


# the event stream

def test_all_blocks_cleared_restarts_the_epoch_at_its_seq_and_lifts_only_a_clear_fence() -> None:
    t = RankState(epoch=5, seq=20, fence="clear").cleared(21)
    assert (t.state.epoch, t.state.epoch_seq, t.state.fence) == (6, 21, "")
    assert (t.drop_index, t.reason, t.persist) == (False, "all_blocks_cleared", True)  # the event clears the index
    control = RankState(epoch=5, seq=20, fence="reset").cleared(21)  # a restart is awaited, not a clear
    assert (control.state.epoch, control.state.fence) == (6, "reset")


def test_only_an_unfenced_rank_accepts_stores() -> None:
    assert RankState().accepts_stores
    assert not RankState(fence="clear").accepts_stores and not RankState(fence="reset").accepts_stores


def test_a_seq_reset_is_a_new_publisher_so_it_drops_any_fence() -> None:
    t = RankState(epoch=2, seq=50, fence="clear").stream_invalidated("seq_reset", None)
    assert (t.state.epoch, t.state.seq, t.state.epoch_seq, t.state.fence) == (3, -1, 0, "")
    assert (t.drop_index, t.reason, t.persist) == (True, "seq_reset", True)
    gap = RankState(epoch=2, seq=50, fence="clear").stream_invalidated("gap", 60)  # control: same publisher
    assert (gap.state.epoch, gap.state.seq, gap.state.epoch_seq, gap.state.fence) == (3, 60, 61, "clear")


def test_a_stream_failure_never_moves_the_seq_backwards() -> None:
    t = RankState(seq=50).stream_invalidated("unknown_event_type", 40)
    assert (t.state.seq, t.state.epoch_seq) == (50, 51)
    control = RankState(seq=50).stream_invalidated("unknown_event_type", 70)
    assert (control.state.seq, control.state.epoch_seq) == (70, 71)
    none = RankState(seq=50).stream_invalidated("decode_error", None)
    assert (none.state.seq, none.state.epoch_seq) == (50, 51)


# lifecycle verbs

def test_a_forgetting_verb_drops_and_counts_before_and_fences_after() -> None:
    call = lc.plan("sleep", level=1)
    b = SERVING.verb_started(call)
    assert (b.state.epoch, b.state.epoch_seq, b.state.serving, b.state.phase) == (4, 10, False, "unknown")
    assert (b.drop_index, b.reason, b.persist) == (True, "sleep", True)
    a = b.state.verb_answered(lc.witness(call, {}), clear_queued=True)
    assert (a.state.epoch, a.state.fence, a.state.phase, a.state.kv) == (5, "clear", "sleeping", F)
    assert (a.drop_index, a.reason, a.persist) == (True, "", True)  # the second bump is not counted again
    nofence = b.state.verb_answered(lc.witness(call, {}), clear_queued=False)  # control: nothing queued
    assert (nofence.state.epoch, nofence.state.fence) == (5, "")


def test_a_preserving_verb_keeps_epoch_and_index() -> None:
    call = lc.plan("pause", mode="keep", clear_cache=False)
    b = SERVING.verb_started(call)
    assert (b.state.epoch, b.state.serving, b.state.phase, b.drop_index, b.reason) == (3, False, "serving", False, "")
    a = b.state.verb_answered(lc.witness(call, {}), clear_queued=False)
    assert (a.state.epoch, a.state.phase, a.state.kv, a.drop_index) == (3, "paused", P, False)
    r = a.state.verb_answered(lc.witness(lc.plan("resume"), {}), clear_queued=False)
    assert (r.state.epoch, r.state.serving, r.state.kv, r.drop_index) == (3, True, P, False)


def test_a_failed_verb_leaves_the_rank_in_error_and_keeps_its_fence() -> None:
    t = RankState(epoch=1, phase="serving", serving=True, seq=3, fence="clear").verb_failed()
    assert (t.state.epoch, t.state.phase, t.state.kv, t.state.serving, t.state.fence) == (2, "error", U, False,
                                                                                         "clear")
    assert (t.drop_index, t.reason) == (True, "verb_failed")


def test_a_failed_verb_that_may_have_queued_a_clear_awaits_it() -> None:
    st = RankState(epoch=1, phase="serving", serving=True, seq=3)
    t = st.verb_failed(clear_maybe_queued=lc.queues_clear(lc.plan("pause", mode="wait"), None))
    assert (t.state.epoch, t.state.phase, t.state.serving, t.state.fence, t.drop_index) == (2, "error", False, "clear",
                                                                                           True)
    w = st.verb_failed(clear_maybe_queued=lc.queues_clear(lc.plan("wake_up"), None))  # control: a wake queues none
    assert w.state.fence == ""


def test_a_serving_witness_is_checked_against_is_sleeping() -> None:
    resumed = lc.witness(lc.plan("resume"), {})
    assert lc.confirm_awake(resumed, sleeping=True) == lc.Witness("resume", "sleeping", P, False, False)
    assert lc.confirm_awake(resumed, sleeping=False) == resumed  # control
    slept = lc.witness(lc.plan("sleep", level=1), {})
    assert lc.confirm_awake(slept, sleeping=True) == slept  # claims no serving: nothing to check


# reconcile looks

def test_marked_down_invalidates_unless_already_down_cold_and_unknown() -> None:
    down = RankState(epoch=4, phase="unknown", kv=U, serving=False)
    assert down.marked_down("health", has_blocks=False) == Transition(down)
    t = down.marked_down("health", has_blocks=True)  # control: blocks left in the index
    assert (t.state.epoch, t.drop_index, t.reason, t.state.serving) == (5, True, "health", False)
    s = SERVING.marked_down("health", has_blocks=False)
    assert (s.state.epoch, s.state.phase, s.state.kv, s.state.serving) == (4, "unknown", U, False)


def test_a_restart_seen_while_subscribed_fences_until_the_new_publisher() -> None:
    t = SERVING.restarted(200.0, "0.33.0", stream_reset_seen=False, subscribed=True)
    assert (t.state.epoch, t.state.fence, t.state.phase, t.state.kv, t.state.seq) == (4, "reset", "serving", F, 9)
    assert (t.state.start_time, t.state.serving, t.drop_index, t.reason) == (200.0, True, True, "restart")
    fresh = RankState(seq=-1, start_time=100.0).restarted(200.0, "v", stream_reset_seen=False, subscribed=True)
    assert fresh.state.fence == ""  # control: no seq seen yet, nothing old can follow


def test_a_batch_stamped_after_the_process_start_lifts_the_restart_fence() -> None:
    """Only a seq reset lifted fence "reset": a new publisher whose first batches were lost (first seq seen past
    the old last) left it up for good. A batch stamped at or after the process start is the new publisher's."""
    fenced = RankState(epoch=3, fence="reset", seq=9, start_time=100.0)
    assert fenced.stamped(99.9) == Transition(fenced)  # the old process's straggler: still fenced
    t = fenced.stamped(100.2)
    assert (t.state.fence, t.state.epoch, t.persist, t.drop_index) == ("", 3, True, False)
    clear = RankState(epoch=3, fence="clear", seq=9, start_time=100.0)  # control: another fence is not this one's
    assert clear.stamped(100.2) == Transition(clear)
    assert RankState(epoch=3, fence="reset", seq=9).stamped(1e12).state.fence == "reset"  # no start time known


def test_a_restart_seen_before_subscribing_starts_the_stream_over() -> None:
    t = SERVING.restarted(SERVING.start_time, "0.34.0", stream_reset_seen=False, subscribed=False)
    assert (t.state.epoch, t.state.seq, t.state.epoch_seq, t.state.fence, t.state.version) == (4, -1, 0, "", "0.34.0")


def test_a_restart_the_stream_already_reported_is_not_counted_twice() -> None:
    t = SERVING.restarted(200.0, "0.33.0", stream_reset_seen=True, subscribed=True, reset_stamp=200.5)
    assert (t.state.epoch, t.drop_index, t.reason, t.state.start_time, t.persist) == (3, False, "", 200.0, True)
    v = SERVING.restarted(None, "0.34.0", stream_reset_seen=True, subscribed=True)  # no start time: the reset is it
    assert (v.state.epoch, v.drop_index, v.state.version) == (3, False, "0.34.0")


def test_a_seq_reset_of_an_earlier_process_does_not_hide_a_later_restart() -> None:
    """The seq reset's first batch, stamped before the start time the look found, is an earlier process's publisher:
    its reset says nothing of this restart. NOTE: any seq reset since the last look hid it, and the earlier process's
    blocks stayed indexed (the chaos test's stale WARM route behind the probe)."""
    for stamp in (150.0, None):  # an earlier process's batch; no batch read since the reset
        t = SERVING.restarted(200.0, "0.33.0", stream_reset_seen=True, subscribed=True, reset_stamp=stamp)
        assert (t.state.epoch, t.drop_index, t.reason, t.state.fence, t.state.start_time) == (4, True, "restart",
                                                                                             "reset", 200.0)


def test_a_first_look_records_start_time_and_version_without_a_restart() -> None:
    t = RankState().restarted(100.0, "0.33.0", stream_reset_seen=False, subscribed=True)
    assert (t.state.epoch, t.state.start_time, t.state.version, t.reason, t.persist) == (0, 100.0, "0.33.0", "", True)
    same = SERVING.restarted(100.0, "0.33.0", stream_reset_seen=False, subscribed=True)  # control: no change
    assert same == Transition(SERVING)
    absent = SERVING.restarted(None, "0.33.0", stream_reset_seen=False, subscribed=True)  # series absent
    assert (absent.state.epoch, absent.state.start_time) == (3, None)


def test_found_asleep_at_level_1_or_2_fences_for_the_queued_clear() -> None:
    t = SERVING.observed(look(asleep=True, level=1))
    assert (t.state.epoch, t.state.phase, t.state.kv, t.state.serving, t.state.fence) == (4, "sleeping", U, False,
                                                                                         "clear")
    assert (t.drop_index, t.reason) == (True, "is_sleeping")
    l0 = SERVING.observed(look(asleep=True, level=0))  # control: level 0 queues no clear
    assert (l0.state.epoch, l0.state.phase, l0.state.fence) == (4, "paused", "")


def test_asleep_after_a_preserving_verb_the_controller_drove_keeps_everything() -> None:
    paused = RankState(epoch=3, phase="paused", kv=P, serving=False, seq=9)
    assert paused.observed(look(asleep=True)) == Transition(paused)
    forgot = RankState(epoch=3, phase="paused", kv=F, serving=False, seq=9)
    assert forgot.observed(look(asleep=True)) == Transition(forgot)  # down and not serving: nothing new
    unknown = RankState(epoch=3, phase="unknown", kv=U, serving=False, seq=9)  # control: we did not drive it
    assert unknown.observed(look(asleep=True, level=2)).state.epoch == 4


def test_a_rank_the_controller_paused_found_asleep_at_level_1_or_slept_again_is_invalidated() -> None:
    """A sleep behind the controller's back after its preserving pause: level 1 or 2 wiped the cache
    (fence "clear" for the queued AllBlocksCleared); level 0 with the op count moved is unknown."""
    paused = RankState(epoch=3, phase="paused", kv=P, serving=False, seq=9)
    t = paused.observed(look(asleep=True, level=1))
    assert (t.state.epoch, t.state.phase, t.state.kv, t.state.serving, t.state.fence) == (4, "sleeping", U, False,
                                                                                         "clear")
    assert (t.drop_index, t.reason) == (True, "is_sleeping")
    t = paused.observed(look(asleep=True, level=0, slept_between=True))
    assert (t.state.epoch, t.state.phase, t.state.kv, t.state.fence, t.drop_index) == (4, "paused", U, "", True)
    assert paused.observed(look(asleep=True, level=0)) == Transition(paused)  # control: its own level-0 pause


def test_slept_between_two_looks_invalidates_even_when_awake_now_and_then_serves() -> None:
    t = SERVING.observed(look(slept_between=True, level=0))
    assert (t.state.epoch, t.state.serving, t.state.phase, t.state.kv, t.reason) == (4, True, "serving", U,
                                                                                     "sleep_ops")
    steady = SERVING.observed(look())  # control: same count
    assert steady == Transition(SERVING)
    paused = RankState(epoch=3, phase="paused", kv=P, seq=9)  # even a rank we paused: the count moved
    assert paused.observed(look(slept_between=True)).state.epoch == 4


def test_awake_and_not_serving_resumes_with_warmth_intact() -> None:
    down = RankState(epoch=3, phase="unknown", kv=U, serving=False, seq=9)
    t = down.observed(look())
    assert (t.state.epoch, t.state.serving, t.state.phase, t.drop_index, t.reason, t.persist) == (
        3, True, "serving", False, "", True)


def test_look_folds_is_sleeping_the_sleep_state_and_the_op_count() -> None:
    assert Look.of(False, {"awake": 1.0}, 2.0, 2.0) == Look(False, False, 0, 2.0)
    assert Look.of(False, {"awake": 0.0, "weights_offloaded": 1.0}, 2.0, 2.0) == Look(True, False, 1, 2.0)
    assert Look.of(True, {"discard_all": 1.0}, 3.0, 2.0) == Look(True, True, 2, 3.0)
    assert Look.of(False, {}, None, None) == Look(False, False, 0, 0.0)  # first look: nothing to compare
    assert Look.of(False, {}, None, 1.0) == Look(False, True, 0, 0.0)  # the histogram vanished: moved


# a restarted controller: the persisted /sleep count and its catch-up replay

def test_slept_between_before_the_stream_is_read_fences_until_the_catch_up_is_read() -> None:
    t = SERVING.observed(Look(False, True, 0, 2.0, unread=True))
    assert (t.state.epoch, t.state.fence, t.drop_index) == (4, "clear", True)  # the replay may predate the sleep
    assert SERVING.observed(look(slept_between=True)).state.fence == ""  # control: a stream read all along
    lifted = t.state.caught_up()
    assert (lifted.state.fence, lifted.state.epoch, lifted.drop_index, lifted.persist) == ("", 4, False, True)
    reset = RankState(epoch=2, seq=5, fence="reset")  # control: a restart's fence waits for its publisher
    assert reset.caught_up() == Transition(reset)


def test_the_sleep_count_is_remembered_when_it_moves_and_a_junk_one_reads_as_none() -> None:
    t = SERVING.counted(2.0)
    assert (t.state.sleep_ops, t.persist) == (2.0, True)
    assert t.state.counted(2.0) == Transition(t.state)  # control: unchanged, nothing written
    assert RankState.from_json(t.state.to_json()) == t.state
    for junk in ("2", True, -1.0, float("nan"), [1]):
        assert RankState.from_json(t.state.to_json() | {"sleep_ops": junk}).sleep_ops is None


def test_every_reset_and_the_wait_mode_pause_and_sleep_are_listed_draining_and_nothing_else() -> None:
    """lists_draining: the verbs whose requests in flight are answered where they run (finished first, or preempted
    and computed again), so the proxy waits for them (docs/lifecycle.md)."""
    from fleet.core.lifecycle import lists_draining, plan

    listed = [plan("reset_prefix_cache"), plan("reset_prefix_cache", reset_running_requests=True),
              plan("reset_prefix_cache", reset_running_requests=False), plan("pause", mode="wait"),
              plan("sleep", level=1, mode="wait")]
    not_listed = [plan("sleep", level=1), plan("sleep", level=1, mode="abort"), plan("pause", mode="abort"),
                  plan("pause", mode="keep"), plan("wake_up"), plan("resume"), plan("release_kv_cache_memory")]
    assert all(lists_draining(c) for c in listed)
    assert not any(lists_draining(c) for c in not_listed)
