"""docs/proxy.md says what the code does: the proxy's own --token needs the reader role only
(issue #31 item 7; the proxy lists the workers with ListWorkers, which a reader may call: see
tests/controller/test_auth.py). NOTE: the page used to ask for an operator token."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "proxy.md"


def test_the_proxy_token_row_asks_for_a_reader_token() -> None:
    text = DOC.read_text()
    [row] = [line for line in text.splitlines() if line.startswith("| `--token`")]
    assert "reader" in row and "operator** role" not in row and "operator role" not in row, row


def test_the_run_example_gives_the_proxy_a_reader_token() -> None:
    text = DOC.read_text()
    [var] = re.findall(r"kvfleet proxy [^\n]*--token \"\$(\w+)\"", text)
    [role] = re.findall(rf"^{var}=\$\(kvfleet controller --mint-token \S+ --role (\w+)", text, re.M)
    assert role == "reader", f"the example's proxy token ${var} is minted with --role {role}"
