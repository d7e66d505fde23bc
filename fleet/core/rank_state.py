"""The lifecycle state of one (worker, dp_rank) and its transitions (DESIGN §9), pure like
fleet/core/lifecycle.py, whose witnesses it folds: every rule that bumps an epoch, sets a fence or stops
serving returns a `Transition`, and the shell (controller/vllm/watcher.py) only does its I/O.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from fleet.core.lifecycle import KV_STATES, PHASES, SEQ_LIMIT, Call, Witness, restart_witness


@dataclass(frozen=True, slots=True)
class RankState:
    """Lifecycle state of one (worker, dp_rank). `epoch` grows on every invalidation.

    `epoch_seq` is the first event seq that may count toward the current epoch's index; `fence`
    is "clear" while an AllBlocksCleared is awaited, "reset" while a publisher restart is
    awaited, or "" when BlockStored events may prove residency. `sleep_ops` is the worker's /sleep
    operation count at the controller's last look (None: not looked at yet), persisted so that a
    restarted controller's first look has a count to compare with (`Look.slept_between`).
    """

    epoch: int = 0
    phase: str = "unknown"
    kv: str = "unknown"
    serving: bool = False
    seq: int = -1
    epoch_seq: int = 0
    fence: str = ""
    start_time: float | None = None
    version: str | None = None
    sleep_ops: float | None = None

    def __post_init__(self) -> None:
        assert self.phase in PHASES and self.kv in KV_STATES and self.fence in ("", "clear", "reset")

    def invalidate(self, *, fence: str = "") -> RankState:
        """Bump the epoch: nothing is warm until BlockStored events after `epoch_seq` re-prove it."""
        return dataclasses.replace(self, epoch=self.epoch + 1, epoch_seq=self.seq + 1, fence=fence)

    def begin(self, w: Witness) -> RankState:
        """Before a verb: stop serving; a verb that may forget demotes warmth first."""
        s = self.invalidate(fence=self.fence) if w.warm_demoted else self
        return dataclasses.replace(s, serving=False, phase=s.phase if not w.warm_demoted else "unknown")

    def finish(self, w: Witness, *, clear_queued: bool) -> RankState:
        """After a verb answered: adopt its witness; a forgetting verb fences again."""
        s = self
        if w.warm_demoted:
            s = self.invalidate(fence="clear" if clear_queued else self.fence)
        return dataclasses.replace(s, phase=w.phase, kv=w.kv, serving=w.serving)

    # transitions: each returns the new state and what the shell must do for it (see Transition)

    @property
    def accepts_stores(self) -> bool:
        """BlockStored may prove residency only while no fence is up."""
        return not self.fence

    def at_seq(self, seq: int) -> RankState:
        return dataclasses.replace(self, seq=seq)

    def invalidated(self, reason: str, *, fence: str = "") -> Transition:
        """An external invalidation: epoch bump, index dropped, `fence` set (default: none)."""
        return Transition(self.invalidate(fence=fence), drop_index=True, reason=reason, persist=True)

    def cleared(self, seq: int) -> Transition:
        """AllBlocksCleared at `seq`: the epoch restarts at `seq` and an awaited clear lifts the fence.

        NOTE: the index is not dropped here: the event itself clears it in stream order, so
        BlockStored events after it in the same batch still count.
        """
        st = dataclasses.replace(self, epoch=self.epoch + 1, epoch_seq=seq,
                                 fence="" if self.fence == "clear" else self.fence)
        return Transition(st, reason="all_blocks_cleared", persist=True)

    def stamped(self, ts: float) -> Transition:
        """A batch stamped `ts` (the worker's wall clock): one stamped at or after the process start we last
        saw can only come from that process's publisher, so a restart's fence "reset" lifts, as a seq reset
        lifts it. NOTE: only a seq reset lifted it: where the new publisher's first batch seen had a seq past
        the old one's last (its first batches lost), the gap was repaired from its replay and the fence stayed
        up for good: the worker served, always COLD, until its next restart."""
        if self.fence == "reset" and self.start_time is not None and ts >= self.start_time:
            return Transition(dataclasses.replace(self, fence=""), persist=True)
        return Transition(self)

    def stream_invalidated(self, reason: str, seq: int | None) -> Transition:
        """The event stream failed (gap, decode error, unknown type...) at `seq`, or restarted.

        A seq reset ("seq_reset") is a new publisher: no batch of the old one can follow, so the
        stream restarts at -1 with no fence. Otherwise the fence in force stays up.
        """
        if reason == "seq_reset":
            return self.at_seq(-1).invalidated(reason)
        st = self if seq is None else self.at_seq(max(seq, self.seq))
        return st.invalidated(reason, fence=st.fence)

    def verb_started(self, call: Call) -> Transition:
        """Before a verb: `begin`; a verb that may forget drops the index and counts under its name."""
        demoted = call.before.warm_demoted
        return Transition(self.begin(call.before), drop_index=demoted, reason=call.verb if demoted else "",
                          persist=True)

    def verb_answered(self, w: Witness, *, clear_queued: bool) -> Transition:
        """After a verb answered: `finish`. Its second epoch bump is not counted again."""
        return Transition(self.finish(w, clear_queued=clear_queued), drop_index=w.warm_demoted, persist=True)

    def verb_failed(self, *, clear_maybe_queued: bool = False) -> Transition:
        """The verb's HTTP call failed: we cannot know what vLLM did (error, unknown, not serving). A verb that queues
        an AllBlocksCleared when it acts (`clear_maybe_queued`: lifecycle.queues_clear) may have acted: fence "clear".

        NOTE: the fence was kept as it was: a pause with mode=wait that outlasted its call went on in vLLM, the blocks
        its drained requests stored were indexed, then vLLM reset its cache, and a resume routed WARM to them."""
        t = self.invalidated("verb_failed", fence="clear" if clear_maybe_queued else self.fence)
        return t.with_state(phase="error", kv="unknown", serving=False)

    def marked_down(self, reason: str, *, has_blocks: bool) -> Transition:
        """Unhealthy or unreachable: invalidate unless already down, cold and unknown."""
        if not (self.serving or self.phase != "unknown" or has_blocks):
            return Transition(self)
        t = self.invalidated(reason, fence=self.fence)
        return t.with_state(phase="unknown", kv="unknown", serving=False)

    def restarted(self, start_time: float | None, version: str, *, stream_reset_seen: bool,
                  subscribed: bool, reset_stamp: float | None = None) -> Transition:
        """One look's start time and /version; a change from what we knew is a restart.

        Args:
            start_time: process_start_time_seconds (None: absent).
            version: the /version answer.
            stream_reset_seen: the event stream saw a restart (a seq reset) since the last look and
                invalidated the rank; where it is this restart, the restart is not counted twice.
            reset_stamp: the stamp (`ts`, the worker's clock) of the first batch read after that seq reset
                (None: none read yet). With a start time, the reset was this restart only where that batch is
                stamped at or after it (as `stamped`): one stamped before is an earlier process's publisher.
            subscribed: our SUB socket is open: old batches may still sit in its queue, so stores
                wait for the new publisher's seq (fence "reset"). Not subscribed yet (controller
                start), the stream we will read is the new publisher's: it starts at -1.

        NOTE: the restart witness's `serving` is not adopted here: the same look's sleep state
        decides it (`observed`), as for any other look.
        NOTE: any seq reset since the last look stood for the restart the look found: one the look before had counted
        already (its seq reset read after it), or the first of two restarts between two looks, hid the second, and
        the first restarted process's blocks stayed indexed: WARM routes to an empty cache (the chaos test's probe).
        """
        moved = (self.start_time is not None and start_time is not None and start_time != self.start_time) \
            or (self.version is not None and version != self.version)
        seen = stream_reset_seen and (start_time is None or (reset_stamp is not None and reset_stamp >= start_time))
        t = Transition(self)
        if moved and not seen:
            w = restart_witness()
            if subscribed:
                t = self.invalidated("restart", fence="reset" if self.seq >= 0 else "")
                t = t.with_state(phase=w.phase, kv=w.kv)
            else:
                t = self.invalidated("restart").with_state(phase=w.phase, kv=w.kv, seq=-1, epoch_seq=0)
        if (start_time, version) != (t.state.start_time, t.state.version):
            t = t.with_state(start_time=start_time, version=version)
        return t

    def observed(self, look: Look) -> Transition:
        """One look's sleep state: asleep (or slept between two looks) invalidates; awake serves.

        A rank the controller paused with its KV preserved stays as it is while asleep at level 0
        with no /sleep since the last look. A rank found asleep while we believed it serving or
        its KV preserved (or slept between looks) is invalidated: level 1 or 2 queued an
        AllBlocksCleared (fence "clear"), level 0 kept its KV but we cannot know for sure (kv
        unknown). Awake and not serving: it serves again ("resumed"), warmth as is. Slept between the last
        look and a stream not read since (`look.unread`: a restarted controller's catch-up replay is still to
        come), the replay may bring stores from before the sleep, and the clear it queued may not be published
        yet: fence "clear" until the replay is read (`caught_up`).

        A sleep-mode operation in flight (`look.in_flight`: a /sleep, /wake_up or /release_kv_cache_memory vLLM has
        not finished) is a transition in progress, as reference §6 rule 1 has it: never serving, never warm, and a
        new /sleep for a rank paused keeping its KV (vLLM counts it, and records its sleep state, only once done).
        NOTE: read as awake, a rank went on serving WARM while vLLM held a /sleep it had not applied yet.
        """
        down = look.asleep or look.in_flight  # NOTE: an operation in flight read as awake (below)
        if not (down or look.slept_between):
            return Transition(self) if self.serving else self._resumed(Transition(self))
        preserved = self.phase == "paused" and self.kv == "preserved"
        if preserved and not (look.slept_between or look.sleep_level or look.in_flight):
            return Transition(self)  # a preserving verb the controller drove: keep the index, do not serve
        # NOTE: a rank the controller paused kept its index through any sleep it was then found in: a /sleep
        # level 1 behind the controller's back wiped the cache, and the wake that followed routed WARM to it
        t = Transition(self)
        if self.serving or self.phase in ("serving", "unknown") or preserved or look.slept_between:
            lvl = look.sleep_level
            fence = "clear" if lvl or (look.slept_between and look.unread) else ""
            reason = "is_sleeping" if look.asleep else "sleep_op_in_flight" if look.in_flight else "sleep_ops"
            t = self.invalidated(reason, fence=fence)
            t = t.with_state(phase="sleeping" if lvl else "paused", kv="unknown", serving=False)
        return t if down or t.state.serving else self._resumed(t)

    def counted(self, sleep_ops: float) -> Transition:
        """Remember one look's /sleep count (persisted only when it moved)."""
        if self.sleep_ops == sleep_ops:
            return Transition(self)
        return Transition(dataclasses.replace(self, sleep_ops=sleep_ops), persist=True)

    def caught_up(self) -> Transition:
        """A restarted controller's catch-up replay (from `epoch_seq`) was answered and read: a fence "clear" lifts.

        The reset it awaits ran in vLLM before the fence went up (a verb's answer, or a look that found the sleep),
        so before the replay was asked: its AllBlocksCleared was in the replay (and lifted the fence), or is older
        than `epoch_seq`, or is not published yet, and then it comes first in the worker's next batch. Every batch
        read from now on was published after the reset. NOTE: kept up, a clear read by the old controller just
        before its fence went up (docs/lifecycle.md) was awaited for good: the worker served, always COLD.
        """
        if self.fence != "clear":
            return Transition(self)
        return Transition(dataclasses.replace(self, fence=""), persist=True)

    @staticmethod
    def _resumed(t: Transition) -> Transition:
        return t.with_state(serving=True, phase="serving")

    def to_json(self) -> dict[str, Any]:
        """NOTE: `sleep_ops` None is not written: a rank never looked at keeps the bytes it had before the field."""
        d = dataclasses.asdict(self)
        if d["sleep_ops"] is None:
            del d["sleep_ops"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankState:
        """A persisted state; a seq outside vLLM's int64 range (a corrupt record) reads as -1, a
        fresh stream, and its epoch_seq as 0: nothing is trusted from it (fail closed). A `sleep_ops` that is
        not a count reads as None (no count to compare the first look with), as in a record written before it."""
        names = {f.name for f in dataclasses.fields(cls)}
        st = cls(**{k: v for k, v in d.items() if k in names})
        ops = st.sleep_ops
        if ops is not None and (isinstance(ops, bool) or not isinstance(ops, int | float) or not 0 <= ops < math.inf):
            st = dataclasses.replace(st, sleep_ops=None)
        if not (isinstance(st.seq, int) and -1 <= st.seq <= SEQ_LIMIT) or not (
            isinstance(st.epoch_seq, int) and 0 <= st.epoch_seq <= SEQ_LIMIT + 1
        ):
            st = dataclasses.replace(st, seq=-1, epoch_seq=0, serving=False)
        return st


@dataclass(frozen=True, slots=True)
class Transition:
    """A rank's new state and what the shell must do for it, in order: drop the rank's index
    (`drop_index`), count an epoch bump under `reason` (kvfleet_epoch_bumps_total; "" counts
    nothing), write the state to the store (`persist`). `Transition(st)` changes nothing."""

    state: RankState
    drop_index: bool = False
    reason: str = ""
    persist: bool = False

    def with_state(self, **changes: Any) -> Transition:
        """The same actions on a further-changed state; any change is persisted."""
        return dataclasses.replace(self, state=dataclasses.replace(self.state, **changes), persist=True)


@dataclass(frozen=True, slots=True)
class Look:
    """What one reconcile look says about a worker's sleep (the same for each of its ranks).

    `asleep`: /is_sleeping true, or engine_sleep_state{awake} = 0. `slept_between`: the /sleep
    operation count changed since the previous look. `sleep_level`: 2 if weights discarded, 1 if
    offloaded, else 0 (from engine_sleep_state). `sleep_ops`: this look's count (absent: 0), to
    compare the next look with. `unread`: the worker's event stream is not read yet (a controller's first look,
    before it subscribes and catches up by replay). `in_flight`: vllm:sleep_mode_operations_in_flight > 0, a
    sleep, wake or release vLLM has started and not finished (the count and the sleep state move only then).
    """

    asleep: bool
    slept_between: bool
    sleep_level: int
    sleep_ops: float = 0.0
    unread: bool = False
    in_flight: bool = False

    @classmethod
    def of(cls, sleeping: bool, sleep_state: dict[str, float], sleep_ops: float | None,
           prev_sleep_ops: float | None, *, unread: bool = False, in_flight: float = 0.0) -> Look:
        """Fold one look's answers; `prev_sleep_ops` None means no earlier look to compare with (a restarted
        controller compares its first look with the count its predecessor persisted, RankState.sleep_ops)."""
        ops = sleep_ops or 0.0
        level = 2 if sleep_state.get("discard_all") else 1 if sleep_state.get("weights_offloaded") else 0
        return cls(sleeping or sleep_state.get("awake") == 0.0,
                   prev_sleep_ops is not None and ops != prev_sleep_ops, level, ops, unread, in_flight > 0)
