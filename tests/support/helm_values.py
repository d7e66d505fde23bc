"""The chart README's values table, generated from values.yaml and its `# --` comments.

    .venv/bin/python tests/support/helm_values.py      # rewrite the table in helm/kvfleet/README.md

A key preceded by a `# -- text` comment (continued by `#    more`) becomes one row whose default is
its whole value; test_chart.py checks the README matches and that every leaf is documented.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvfleet"
BEGIN, END = "<!-- values-table -->", "<!-- /values-table -->"


def documented_keys(text: str) -> list[tuple[str, str]]:
    """(dotted key path, description) for each key with a `# --` comment, in file order.

    List items are written `parent[].key` (the first item documents them all).
    """
    rows: list[tuple[str, str]] = []
    stack: list[tuple[int, str]] = []  # (indent, key)
    pending: str | None = None
    for raw in text.splitlines():
        m = re.match(r"^(\s*)- ", raw)
        line = raw.replace("- ", "  ", 1) if m else raw
        if m:  # a list item: its parent is the last key less indented than the dash
            while stack and stack[-1][0] >= len(m.group(1)):
                stack.pop()
            if stack and not stack[-1][1].endswith("[]"):
                stack[-1] = (stack[-1][0], stack[-1][1] + "[]")
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = stripped[4:].strip()
            continue
        if stripped.startswith("#"):
            if pending is not None:
                pending += " " + stripped[1:].strip()
            continue
        k = re.match(r"^(\s*)([A-Za-z0-9_.-]+):", line)
        if not k:
            pending = None
            continue
        indent = len(k.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, k.group(2)))
        if pending is not None:
            rows.append((".".join(key for _, key in stack), pending))
        pending = None
    return rows


def lookup(values: Any, path: str) -> Any:
    node = values
    for part in re.split(r"\.", path):
        if part.endswith("[]"):
            node = node[part[:-2]][0]
        else:
            node = node[part]
    return node


def table(text: str) -> str:
    values = yaml.safe_load(text)
    lines = ["| key | default | description |", "|---|---|---|"]
    for path, desc in documented_keys(text):
        default = json.dumps(lookup(values, path))
        desc = desc.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
        lines.append(f"| `{path}` | `{default}` | {desc} |")
    return "\n".join(lines)


def main() -> int:
    readme = CHART / "README.md"
    text = readme.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:start] + "\n" + table((CHART / "values.yaml").read_text()) + "\n" + text[stop:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
