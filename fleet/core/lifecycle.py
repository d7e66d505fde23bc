"""The cache-loss witness: every vLLM dormancy action lowered to one closed KV vocabulary.

Pure core (DESIGN §9): no I/O, no ray/grpc/redis/zmq. The controller asks `plan()` what a verb
will do *before* calling vLLM (so it can bump the epoch first), then `witness()` what it did
once vLLM answered, and folds both into a per-(worker, dp_rank) `RankState`.

    action (vLLM)                                   phase     kv         demoted serving
    pause clear_cache=false (any mode); sleep L0    paused    preserved  no      no
    pause clear_cache=true (default; any mode)      paused    forgotten  yes     no
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

from fleet.core.errors import InvalidArgument

KV_STATES = ("preserved", "forgotten", "unknown")
SEQ_LIMIT = (1 << 63) - 2  # the largest event seq a vLLM publisher sends (controller.vllm.events.MAX_SEQ)
PHASES = ("serving", "paused", "sleeping", "error", "unknown")
# the worker listing (controller/worker_status.py) also says "faulty" (over its KV-event budget) and "draining" (a verb
# of the controller that lets the requests in flight finish is running: `drains`); no rank state holds either
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
    """Witness of `/pause`: vLLM's default clear_cache is true, and its engine honours it in every mode.

    NOTE: vLLM's /pause docstring says mode=keep ignores clear_cache, but EngineCoreProc.pause_scheduler resets the
    caches (reset_running_requests=True, AllBlocksCleared queued) once the pause completes, keep included. A pause
    keep was taken as preserving: the index was kept and, once resumed, the worker was routed WARM to a cache vLLM
    had just reset. Only clear_cache=false preserves. `mode` does not change the witness."""
    if clear_cache is False:
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
         clear_cache: bool | None = None, reset_running_requests: bool | None = None) -> Call:
    """Validate a verb and its parameters; return the call and the witness expected before it.

    Args:
        verb: one of VERBS.
        level: sleep level 0..2 (sleep only; None lets vLLM pick its default -> unknown).
        mode: abort | wait | keep (sleep, pause).
        tags: wake_up tags (weights, kv_cache, scheduling); None wakes everything.
        clear_cache: pause only; None means vLLM's default (true).
        reset_running_requests: reset_prefix_cache only; true preempts the requests running there (vLLM computes
            them again), None or false leaves them (vLLM refuses the reset while they hold blocks; the controller
            then drains the worker first, controller/vllm/verbs.py).

    Returns:
        The `Call`; its `before` witness is the worst case the controller must assume.

    Raises:
        InvalidArgument: unknown verb, parameter out of range, or a parameter the verb lacks.
    """
    if verb not in VERBS:
        raise InvalidArgument(f"unknown lifecycle verb {verb!r}; expected one of {', '.join(VERBS)}")
    _check_params(verb, level, mode, tags, clear_cache, reset_running_requests)
    params: list[tuple[str, str]] = []
    if level is not None:
        params.append(("level", str(level)))
    if mode is not None:
        params.append(("mode", mode))
    for t in tags or []:
        params.append(("tags", t))
    for key, flag in (("clear_cache", clear_cache), ("reset_running_requests", reset_running_requests)):
        if flag is not None:
            params.append((key, "true" if flag else "false"))
    return Call(verb, "POST", "/" + verb, tuple(params), _before(verb, level, mode, clear_cache))


def _check_params(verb: str, level: Any, mode: Any, tags: Any, clear_cache: Any, running: Any) -> None:
    allowed = {"sleep": {"level", "mode"}, "wake_up": {"tags"}, "pause": {"mode", "clear_cache"},
               "reset_prefix_cache": {"reset_running_requests"}}.get(verb, set())
    given = {k for k, v in (("level", level), ("mode", mode), ("tags", tags), ("clear_cache", clear_cache),
                            ("reset_running_requests", running)) if v is not None}
    extra = given - allowed
    if extra:
        raise InvalidArgument(f"{verb} takes no {', '.join(sorted(extra))} parameter")
    if level is not None and not _valid_level(level):
        raise InvalidArgument(f"sleep level must be 0, 1 or 2, got {level!r}")
    if mode is not None and mode not in PAUSE_MODES:
        raise InvalidArgument(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    if tags is not None and (not isinstance(tags, list | tuple) or any(t not in WAKE_TAGS for t in tags)):
        raise InvalidArgument(f"wake_up tags must be a list drawn from {', '.join(WAKE_TAGS)}, got {tags!r}")
    for key, flag in (("clear_cache", clear_cache), ("reset_running_requests", running)):
        if flag is not None and not isinstance(flag, bool):
            raise InvalidArgument(f"{key} must be a bool, got {flag!r}")


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


def drains(call: Call) -> bool:
    """Whether vLLM finishes the requests in flight before the verb takes effect, and answers it only then:
    `/pause?mode=wait`, and `/sleep?mode=wait`, whose first step is the same pause (no new request starts; meanwhile
    /is_sleeping already answers true; a sleep's cache reset and its memory's sleep follow the drain): its call to
    vLLM lasts the drain. NOTE: the sleep was left out at first: its requests in flight were pulled as the pause's
    had been."""
    return call.verb in ("pause", "sleep") and dict(call.params).get("mode") == "wait"


def lists_draining(call: Call) -> bool:
    """Whether the worker is listed "draining" while this verb of the controller runs: the requests in flight there
    are answered there, so the proxy keeps waiting for them. A `drains` verb, and a prefix-cache reset: one that does
    not preempt is refused by vLLM while requests hold blocks, and the controller asks again while they finish
    (controller/vllm/verbs.py, `_drained_reset`); one that preempts (reset_running_requests) has vLLM compute them
    again there. NOTE: a reset was listed "unknown" (not serving) while it ran, and a probe too busy to answer gave
    up the requests it waited for: sent again elsewhere from scratch, or a 503 on a model's only worker, and a
    draining reset then drained nothing (found by review). The preempting reset's window is short (its settle and one
    call), and listed "unknown" a probe that got no answer in time could give up its request the same way."""
    return drains(call) or call.verb == "reset_prefix_cache"


def confirm_awake(w: Witness, sleeping: bool) -> Witness:
    """A witness that claims serving, checked with one /is_sleeping read (a /resume of a sleeping
    engine does not wake it): still asleep -> sleeping, not serving."""
    return dataclasses.replace(w, serving=False, phase="sleeping") if w.serving and sleeping else w
