"""workers.nodeKvBytes reaches the controller as --node-kv-bytes; unset, the flag is not passed
(the controller's default holds); a non-positive value is refused by values.schema.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvfleet"


def _controller_args(values: dict[str, Any]) -> list[str]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="demo", namespace="kvfleet")
    docs = [d for p, t in manifests.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]
    [dep] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("controller")]
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_node_kv_bytes_value_becomes_the_flag() -> None:
    args = _controller_args({"workers": {"nodeKvBytes": 3 << 30}})
    assert args[args.index("--node-kv-bytes") + 1] == str(3 << 30)
    assert "--node-kv-bytes" not in _controller_args({})


def test_a_non_positive_node_kv_bytes_is_refused_by_the_schema() -> None:
    report = helm.lint(CHART, {"workers": {"nodeKvBytes": 0}}, strict=True)
    assert any("nodeKvBytes" in e for e in report["errors"]), report
