"""Each benchmark rewrites only its own section of docs/benchmarks.md, between its markers
`<!-- bench:NAME -->` and `<!-- /bench:NAME -->` (appended at the end the first time)."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def replace_section(text: str, name: str, body: str) -> str:
    """`text` with section `name` set to `body` (markers added here; `body` carries none)."""
    start, end = markers(name)
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        return text[: text.index(start)] + block + text[text.index(end) + len(end):]
    return text.rstrip() + "\n\n" + block + "\n"


def write_section(name: str, body: str, path: Path = DOC) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    path.write_text(replace_section(text, name, body))
