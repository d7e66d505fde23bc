"""The --route-* and --kv-* flags (shared by `kvfleet controller` and `kvfleet up`): the placement cost's weights
(CostConfig, controller/cost.py, docs/routing.md) and the bounds on each vLLM worker's KV-event stream
(StreamLimits, controller/vllm/subscriber.py). Unset ones keep their dataclass's defaults; each is also read from
the environment as KVFLEET_ + the flag in capitals, and a refusal names the flag."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from controller.cost import CostConfig
from fleet.core.errors import InvalidArgument


def on_off(text: str) -> bool:
    """A switch's value: on/true/yes/1 or off/false/no/0."""
    v = text.strip().lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise ValueError(text)


# flag -> (CostConfig field, type, help); defaults are CostConfig's, shown in --help
COST_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--route-queue-weight": ("queue_weight", float, "cost of one prefill token waiting ahead on a worker"),
    "--route-request-weight": (
        "request_weight",
        float,
        "cost, in tokens, of one more active request on a worker",
    ),
    "--route-pressure-weight": ("pressure_weight", float, "cost of one token of another prefix evicted"),
    "--route-shared-prefix-weight": (
        "shared_prefix_weight",
        float,
        "share of a missing shared prefix (a system prompt) that counts, 0..1",
    ),
    "--route-kv-high-water": (
        "kv_high_water",
        float,
        "without a known KV capacity, usage above this share counts as eviction",
    ),
    "--route-untracked-request-tokens": (
        "untracked_request_tokens",
        int,
        "size assumed for a waiting request the router did not track",
    ),
    "--route-inflight-ttl": (
        "inflight_ttl_s",
        float,
        "seconds after which an unreleased route stops counting",
    ),
    "--route-working-set-ttl": (
        "working_set_ttl_s",
        float,
        "seconds after its last turn that a conversation leaves its worker's working set",
    ),
    "--route-reconcile-grace": (
        "reconcile_grace_s",
        float,
        "seconds after which a route must show in the worker's /metrics; a lifecycle verb waits (at most this) "
        "for routes decided just before it to reach the worker",
    ),
    "--route-affinity-margin": (
        "affinity_margin",
        float,
        "how much cheaper, in tokens, another worker must be before a conversation leaves the one holding "
        "its history (0: off)",
    ),
    "--route-mixed-prefix-weight": (
        "mixed_prefix_weight",
        float,
        "share of a missing shared prefix that counts on a worker serving another shared prefix, 0..1",
    ),
    "--route-inflight-prefix": (
        "inflight_prefix",
        on_off,
        "count a prompt prefix that routes still in flight on a worker are computing as cached there (on/off)",
    ),
    "--route-scheduled-by-events": (
        "scheduled_by_events",
        on_off,
        "a route stops counting as queued on its worker when the worker's KV events store its prompt's last block "
        "(on/off; off: only a /metrics look or its release takes it out)",
    ),
}


# flag -> (StreamLimits field, type, help): bounds on each vLLM worker's KV-event stream
STREAM_FLAGS: dict[str, tuple[str, type, str]] = {
    "--kv-replay-deadline": ("replay_deadline_s", float, "seconds one KV-event replay may take in all"),
    "--kv-replay-max-batches": ("replay_max_batches", int, "batches one KV-event replay may return"),
    "--kv-replay-max-bytes": ("replay_max_bytes", int, "payload bytes one KV-event replay may return"),
    "--kv-event-max-message-bytes": ("max_msg_bytes", int, "largest KV-event ZMQ message (ZMQ_MAXMSGSIZE)"),
    "--kv-max-resident-blocks": (
        "max_resident_blocks",
        int,
        "blocks one worker rank may hold: its /metrics num_gpu_blocks where smaller, never more",
    ),
    "--kv-max-events-per-s": (
        "max_events_per_s",
        int,
        "KV events per second one worker rank may send, live or replayed (an AllBlocksCleared counts 1,000); "
        "past its budget the worker is faulty: not routed to",
    ),
    "--kv-max-event-burst": ("max_event_burst", int, "depth of that event budget (events at once)"),
    "--kv-faulty-hold": ("faulty_hold_s", float, "seconds a worker over its event budget stays faulty"),
}


def env_typed(kind: Callable[[str], Any], var: str) -> Any:
    """argparse's `type=` for a flag also read from `var`: a value that does not parse names the variable too (a
    flag's default from the environment is parsed as a command-line value is, and its error named the flag only)."""
    def parse(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r} (from the flag or {var})") from None

    return parse


def add_stream_flags(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """The --kv-* flags: StreamLimits (controller/vllm/subscriber.py); each also read from the
    environment as KVFLEET_ + the flag in capitals (--kv-max-events-per-s: KVFLEET_KV_MAX_EVENTS_PER_S)."""
    from controller.vllm.subscriber import StreamLimits

    defaults = StreamLimits()
    for flag, (field, kind, text) in STREAM_FLAGS.items():
        var = "KVFLEET_" + flag[2:].upper().replace("-", "_")
        p.add_argument(flag, type=env_typed(kind, var), default=(env or {}).get(var), dest=field,
                       help=f"{text} (default {getattr(defaults, field)}; env {var})")


def stream_limits_from(args: argparse.Namespace) -> Any:
    """StreamLimits from the --kv-* flags given; raises InvalidArgument naming the flag."""
    from controller.vllm.subscriber import StreamLimits

    given = {f: getattr(args, f) for f, _, _ in STREAM_FLAGS.values() if getattr(args, f, None) is not None}
    try:
        return StreamLimits(**given)
    except InvalidArgument as e:
        flag = next((f for f, (field, _, _) in STREAM_FLAGS.items() if str(e).startswith(field)), "--kv-*")
        raise InvalidArgument(f"{flag}: {e}") from None


def add_cost_flags(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """The --route-* flags (shared by `kvfleet controller` and `kvfleet up`); with `env`, each also read from the
    environment as KVFLEET_ + the flag in capitals (--route-affinity-margin: KVFLEET_ROUTE_AFFINITY_MARGIN)."""
    defaults = CostConfig()
    for flag, (field, kind, text) in COST_FLAGS.items():
        var = "KVFLEET_" + flag[2:].upper().replace("-", "_")
        p.add_argument(
            flag,
            type=env_typed(kind, var),
            default=(env or {}).get(var),  # NOTE: argparse parses a string default with type=
            dest=field,
            help=f"{text} (default {getattr(defaults, field)}; docs/routing.md" + (f"; env {var})" if env is not None else ")"),
        )


def cost_config_from(args: argparse.Namespace) -> CostConfig:
    """CostConfig from the --route-* flags given; raises InvalidArgument on a bad weight."""
    given = {
        field: getattr(args, field) for field, _, _ in COST_FLAGS.values() if getattr(args, field) is not None
    }
    try:
        return CostConfig(**given)
    except InvalidArgument as e:
        flag = next((f for f, (field, _, _) in COST_FLAGS.items() if str(e).startswith(field)), "--route-*")
        raise InvalidArgument(f"{flag}: {e}") from None
