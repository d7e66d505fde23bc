"""The chart's controller.kvEvents values reach the controller's --kv-* flags (StreamLimits)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from test_chart import CHART, NAMESPACE, RELEASE, _docs, container, one

from controller.main import STREAM_FLAGS, parse_args, stream_limits_from
from controller.vllm.subscriber import StreamLimits

KV = {"replayDeadlineSeconds": 2.5, "replayMaxBatches": 5000, "replayMaxBytes": 1 << 26, "maxMessageBytes": 1 << 24,
      "maxResidentBlocks": 100000}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as ch:
        yield ch


def _args(chart: Any, values: dict[str, Any]) -> list[str]:
    objs = _docs(chart.render(values, name=RELEASE, namespace=NAMESPACE))
    return list(container(one(objs, "Deployment", "-controller"))["args"])


def test_kv_event_values_reach_stream_limits(chart: Any) -> None:
    args = _args(chart, {"controller": {"kvEvents": KV}})
    assert set(STREAM_FLAGS) <= set(args)
    got = stream_limits_from(parse_args(args[1:], {}))
    assert got == StreamLimits(replay_deadline_s=2.5, replay_max_batches=5000, replay_max_bytes=1 << 26,
                               max_msg_bytes=1 << 24, max_resident_blocks=100000)
    assert not set(STREAM_FLAGS) & set(_args(chart, {}))  # control: the defaults pass none of them
    assert stream_limits_from(parse_args(_args(chart, {})[1:], {})) == StreamLimits()


def test_schema_refuses_a_bad_kv_event_bound(chart: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema({"controller": {"kvEvents": {"replayMaxBatches": 0}}})
    assert "/controller/kvEvents/replayMaxBatches" in str(e.value)
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"controller": {"kvEvents": {"replayDeadlineSeconds": 0}}})
