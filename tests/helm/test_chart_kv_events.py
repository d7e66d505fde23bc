"""The chart's controller.kvEvents values reach the controller's --kv-* flags (StreamLimits)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from test_chart import NAMESPACE, RELEASE, _docs, container, one

from controller.main import STREAM_FLAGS, parse_args, stream_limits_from
from controller.vllm.subscriber import StreamLimits

KV = {"replayDeadlineSeconds": 2.5, "replayMaxBatches": 5000, "replayMaxBytes": 1 << 26, "maxMessageBytes": 1 << 24,
      "maxResidentBlocks": 100000, "maxEventsPerSecond": 5000, "maxEventBurst": 50000, "faultyHoldSeconds": 7.5}


def _args(chart: Any, values: dict[str, Any]) -> list[str]:
    objs = _docs(chart.render(values, name=RELEASE, namespace=NAMESPACE))
    return list(container(one(objs, "Deployment", "-controller"))["args"])


def test_kv_event_values_reach_stream_limits(chart: Any) -> None:
    args = _args(chart, {"controller": {"kvEvents": KV}})
    assert set(STREAM_FLAGS) <= set(args)
    got = stream_limits_from(parse_args(args[1:], {}))
    assert got == StreamLimits(replay_deadline_s=2.5, replay_max_batches=5000, replay_max_bytes=1 << 26,
                               max_msg_bytes=1 << 24, max_resident_blocks=100000, max_events_per_s=5000,
                               max_event_burst=50000, faulty_hold_s=7.5)
    assert not set(STREAM_FLAGS) & set(_args(chart, {}))  # control: the defaults pass none of them
    assert stream_limits_from(parse_args(_args(chart, {})[1:], {})) == StreamLimits()


def test_schema_refuses_a_bad_kv_event_bound(chart: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema({"controller": {"kvEvents": {"replayMaxBatches": 0}}})
    assert "/controller/kvEvents/replayMaxBatches" in str(e.value)
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"controller": {"kvEvents": {"replayDeadlineSeconds": 0}}})
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"controller": {"kvEvents": {"maxEventsPerSecond": 0}}})


def test_event_budget_flags_are_read_from_the_environment_too() -> None:
    env = {"KVFLEET_KV_MAX_EVENTS_PER_S": "900", "KVFLEET_KV_FAULTY_HOLD": "2.5"}
    got = stream_limits_from(parse_args([], env))
    assert (got.max_events_per_s, got.faulty_hold_s, got.max_event_burst) == (900, 2.5, StreamLimits().max_event_burst)
    assert stream_limits_from(parse_args(["--kv-max-events-per-s", "7"], env)).max_events_per_s == 7  # flags win
