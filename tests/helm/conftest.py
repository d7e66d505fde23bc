"""The chart as the tests render it (helm's own engine, from the helm-python package), one load per module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvfleet"


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as ch:
        yield ch


@pytest.fixture(scope="module")
def chart_without_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The chart with values.schema.json removed, as `--skip-schema-validation` would run it."""
    d = tmp_path_factory.mktemp("chart") / "kvfleet"
    shutil.copytree(CHART, d)
    (d / "values.schema.json").unlink()
    with helm.Chart.load(d) as ch:
        yield ch
