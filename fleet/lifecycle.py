"""The cache-loss witness: every vLLM dormancy action lowered to one closed KV vocabulary.

Pure core (DESIGN §9): no I/O, no ray/grpc/redis/zmq. The controller asks `plan()` what a verb
will do *before* calling vLLM (so it can bump the epoch first), then `witness()` what it did
once vLLM answered, and folds both into a per-(worker, dp_rank) `RankState`.

    action (vLLM)                                   phase     kv         demoted serving
    pause clear_cache=false / mode=keep; sleep L0   paused    preserved  no      no
    pause clear_cache=true (vLLM's default)         paused    forgotten  yes     no
    sleep level 1 or 2                              sleeping  forgotten  yes     no
    sleep, level missing or invalid                 error     unknown    yes     no
    reset_prefix_cache -> success                   serving   forgotten  yes     yes
    reset_prefix_cache -> success:false / no flag   serving   unknown    yes     yes
    wake_up                                         serving   unknown    yes     yes
    wake_up answered {"status": "sleeping"}         sleeping  unknown    yes     no
    restart seen (seq reset, /version, start time)  serving   forgotten  yes     yes
    resume                                          serving   preserved  no      yes
    release_kv_cache_memory                         paused    forgotten  yes     no

`unknown` is first-class and fails closed: it demotes warmth exactly like `forgotten`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fleet.errors import InvalidArgument

KV_STATES = ("preserved", "forgotten", "unknown")
SEQ_LIMIT = (1 << 63) - 2  # the largest event seq a vLLM publisher sends (controller.vllm.events.MAX_SEQ)
PHASES = ("serving", "paused", "sleeping", "error", "unknown")
VERBS = ("sleep", "wake_up", "pause", "resume", "reset_prefix_cache", "release_kv_cache_memory")
PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache", "scheduling")


@dataclass(frozen=True, slots=True)
class Witness:
    """What one lifecycle action did to a worker's KV cache and to its right to serve."""

    action: str
    phase: str
    kv: str
    warm_demoted: bool
    serving: bool
    epoch: int = 0

    def __post_init__(self) -> None:
        assert self.kv in KV_STATES, self.kv
        assert self.phase in PHASES, self.phase
        assert self.warm_demoted or self.kv == "preserved", "only a preserving action may keep warmth"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Call:
    """A validated lifecycle verb: the HTTP call to make and the witness expected before it."""

    verb: str
    method: str
    path: str
    params: tuple[tuple[str, str], ...]
    before: Witness


def _w(action: str, phase: str, kv: str, serving: bool) -> Witness:
    return Witness(action, phase, kv, warm_demoted=kv != "preserved", serving=serving)


def _valid_level(level: Any) -> bool:
    return isinstance(level, int) and not isinstance(level, bool) and 0 <= level <= 2


def lower_sleep(level: Any) -> Witness:
    """Witness of `/sleep` at `level` (None or invalid -> error/unknown)."""
    if not _valid_level(level):
        return _w("sleep", "error", "unknown", False)
    if level == 0:
        return _w("sleep", "paused", "preserved", False)
    return _w("sleep", "sleeping", "forgotten", False)


def lower_pause(mode: str | None, clear_cache: bool | None) -> Witness:
    """Witness of `/pause`: vLLM's default clear_cache is true; mode=keep ignores it."""
    if mode == "keep" or clear_cache is False:
        return _w("pause", "paused", "preserved", False)
    return _w("pause", "paused", "forgotten", False)


def lower_reset(response: Any) -> Witness:
    """Witness of `/reset_prefix_cache` given its JSON body (None before the call)."""
    if isinstance(response, dict) and response.get("success") is True:
        return _w("reset_prefix_cache", "serving", "forgotten", True)
    return _w("reset_prefix_cache", "serving", "unknown", True)


def lower_wake(response: Any) -> Witness:
    """Witness of `/wake_up`: partial wake ({"status": "sleeping"}) is still asleep."""
    if isinstance(response, dict) and response.get("status") == "sleeping":
        return _w("wake_up", "sleeping", "unknown", False)
    return _w("wake_up", "serving", "unknown", True)


def restart_witness() -> Witness:
    """Witness of a restart seen from outside (seq back to 0, /version or start time changed)."""
    return _w("restart", "serving", "forgotten", True)


def plan(verb: str, *, level: Any = None, mode: str | None = None, tags: list[str] | None = None,
         clear_cache: bool | None = None) -> Call:
    """Validate a verb and its parameters; return the call and the witness expected before it.

    Args:
        verb: one of VERBS.
        level: sleep level 0..2 (sleep only; None lets vLLM pick its default -> unknown).
        mode: abort | wait | keep (sleep, pause).
        tags: wake_up tags (weights, kv_cache, scheduling); None wakes everything.
        clear_cache: pause only; None means vLLM's default (true).

    Returns:
        The `Call`; its `before` witness is the worst case the controller must assume.

    Raises:
        InvalidArgument: unknown verb, parameter out of range, or a parameter the verb lacks.
    """
    if verb not in VERBS:
        raise InvalidArgument(f"unknown lifecycle verb {verb!r}; expected one of {', '.join(VERBS)}")
    _check_params(verb, level, mode, tags, clear_cache)
    params: list[tuple[str, str]] = []
    if level is not None:
        params.append(("level", str(level)))
    if mode is not None:
        params.append(("mode", mode))
    for t in tags or []:
        params.append(("tags", t))
    if clear_cache is not None:
        params.append(("clear_cache", "true" if clear_cache else "false"))
    return Call(verb, "POST", "/" + verb, tuple(params), _before(verb, level, mode, clear_cache))


def _check_params(verb: str, level: Any, mode: Any, tags: Any, clear_cache: Any) -> None:
    allowed = {"sleep": {"level", "mode"}, "wake_up": {"tags"}, "pause": {"mode", "clear_cache"}}.get(verb, set())
    given = {k for k, v in (("level", level), ("mode", mode), ("tags", tags), ("clear_cache", clear_cache))
             if v is not None}
    extra = given - allowed
    if extra:
        raise InvalidArgument(f"{verb} takes no {', '.join(sorted(extra))} parameter")
    if level is not None and not _valid_level(level):
        raise InvalidArgument(f"sleep level must be 0, 1 or 2, got {level!r}")
    if mode is not None and mode not in PAUSE_MODES:
        raise InvalidArgument(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    if tags is not None and (not isinstance(tags, list | tuple) or any(t not in WAKE_TAGS for t in tags)):
        raise InvalidArgument(f"wake_up tags must be a list drawn from {', '.join(WAKE_TAGS)}, got {tags!r}")
    if clear_cache is not None and not isinstance(clear_cache, bool):
        raise InvalidArgument(f"clear_cache must be a bool, got {clear_cache!r}")


def _before(verb: str, level: Any, mode: str | None, clear_cache: bool | None) -> Witness:
    if verb == "sleep":
        return lower_sleep(level)
    if verb == "pause":
        return lower_pause(mode, clear_cache)
    if verb == "resume":
        return _w("resume", "serving", "preserved", True)
    if verb == "reset_prefix_cache":
        return lower_reset(None)
    if verb == "wake_up":
        return lower_wake(None)
    return _w("release_kv_cache_memory", "paused", "forgotten", False)


def witness(call: Call, response: Any) -> Witness:
    """The witness of a verb once vLLM answered 2xx with `response` (parsed JSON or None)."""
    if call.verb == "reset_prefix_cache":
        return lower_reset(response)
    if call.verb == "wake_up":
        return lower_wake(response)
    return call.before


def queues_clear(call: Call, response: Any) -> bool:
    """Whether vLLM has *queued* an AllBlocksCleared that it will publish with its next step.

    NOTE: the controller uses this as a stream fence: BlockStored events are ignored until
    that AllBlocksCleared arrives, because batches published before the reset may still be
    in flight on the PUB socket when the verb returns.
    """
    if call.verb == "sleep":
        return dict(call.params).get("level", "1") != "0"
    if call.verb == "pause":
        return call.before.kv != "preserved"
    if call.verb == "reset_prefix_cache":
        return not (isinstance(response, dict) and response.get("success") is False)
    return call.verb == "release_kv_cache_memory"


@dataclass(frozen=True, slots=True)
class RankState:
    """Lifecycle state of one (worker, dp_rank). `epoch` grows on every invalidation.

    `epoch_seq` is the first event seq that may count toward the current epoch's index; `fence`
    is "clear" while an AllBlocksCleared is awaited, "reset" while a publisher restart is
    awaited, or "" when BlockStored events may prove residency.
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

    def verb_failed(self) -> Transition:
        """The verb's HTTP call failed: we cannot know what vLLM did (error, unknown, not serving)."""
        t = self.invalidated("verb_failed", fence=self.fence)
        return t.with_state(phase="error", kv="unknown", serving=False)

    def marked_down(self, reason: str, *, has_blocks: bool) -> Transition:
        """Unhealthy or unreachable: invalidate unless already down, cold and unknown."""
        if not (self.serving or self.phase != "unknown" or has_blocks):
            return Transition(self)
        t = self.invalidated(reason, fence=self.fence)
        return t.with_state(phase="unknown", kv="unknown", serving=False)

    def restarted(self, start_time: float | None, version: str, *, stream_reset_seen: bool,
                  subscribed: bool) -> Transition:
        """One look's start time and /version; a change from what we knew is a restart.

        Args:
            start_time: process_start_time_seconds (None: absent).
            version: the /version answer.
            stream_reset_seen: the event stream already saw this restart (a seq reset) and
                invalidated the rank; the restart is not counted twice.
            subscribed: our SUB socket is open: old batches may still sit in its queue, so stores
                wait for the new publisher's seq (fence "reset"). Not subscribed yet (controller
                start), the stream we will read is the new publisher's: it starts at -1.

        NOTE: the restart witness's `serving` is not adopted here: the same look's sleep state
        decides it (`observed`), as for any other look.
        """
        moved = (self.start_time is not None and start_time is not None and start_time != self.start_time) \
            or (self.version is not None and version != self.version)
        t = Transition(self)
        if moved and not stream_reset_seen:
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

        A rank the controller paused with its KV preserved stays as it is while asleep. A rank
        found asleep while we believed it serving (or slept between looks) is invalidated: level
        1 or 2 queued an AllBlocksCleared (fence "clear"), level 0 kept its KV but we cannot know
        for sure (kv unknown). Awake and not serving: it serves again ("resumed"), warmth as is.
        """
        if not (look.asleep or look.slept_between):
            return Transition(self) if self.serving else self._resumed(Transition(self))
        if look.asleep and self.phase == "paused" and self.kv == "preserved":
            return Transition(self)  # a preserving verb the controller drove: keep the index, do not serve
        t = Transition(self)
        if self.serving or self.phase in ("serving", "unknown") or look.slept_between:
            lvl = look.sleep_level
            t = self.invalidated("is_sleeping" if look.asleep else "sleep_ops", fence="clear" if lvl else "")
            t = t.with_state(phase="sleeping" if lvl else "paused", kv="unknown", serving=False)
        return t if look.asleep or t.state.serving else self._resumed(t)

    @staticmethod
    def _resumed(t: Transition) -> Transition:
        return t.with_state(serving=True, phase="serving")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankState:
        """A persisted state; a seq outside vLLM's int64 range (a corrupt record) reads as -1, a
        fresh stream, and its epoch_seq as 0: nothing is trusted from it (fail closed)."""
        names = {f.name for f in dataclasses.fields(cls)}
        st = cls(**{k: v for k, v in d.items() if k in names})
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
    compare the next look with.
    """

    asleep: bool
    slept_between: bool
    sleep_level: int
    sleep_ops: float = 0.0

    @classmethod
    def of(cls, sleeping: bool, sleep_state: dict[str, float], sleep_ops: float | None,
           prev_sleep_ops: float | None) -> Look:
        """Fold one look's answers; `prev_sleep_ops` None means no earlier look to compare with."""
        ops = sleep_ops or 0.0
        level = 2 if sleep_state.get("discard_all") else 1 if sleep_state.get("weights_offloaded") else 0
        return cls(sleeping or sleep_state.get("awake") == 0.0,
                   prev_sleep_ops is not None and ops != prev_sleep_ops, level, ops)


def confirm_awake(w: Witness, sleeping: bool) -> Witness:
    """A witness that claims serving, checked with one /is_sleeping read (a /resume of a sleeping
    engine does not wake it): still asleep -> sleeping, not serving."""
    return dataclasses.replace(w, serving=False, phase="sleeping") if w.serving and sleeping else w
