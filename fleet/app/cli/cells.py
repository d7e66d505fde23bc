"""Table cells from what a controller answered: shown as text, never read as markup or terminal codes.

rich reads a plain str cell as markup, so a worker named `w[/]` ended the dashboard with a MarkupError, and a
control character went to the terminal as it came (a session id holding `\\x1b]0;...\\x07\\x1b[2J` set the window
title and cleared the screen). A cell is now a `rich.text.Text` (no markup), its C0/C1 control characters shown
escaped, and at most MAX_CELL characters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.text import Text

MAX_CELL = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def cell(value: object) -> Text:
    s = _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(value))
    return Text(s if len(s) <= MAX_CELL else s[: MAX_CELL - 1] + "…")


def cells(*values: object) -> list[Text]:
    return [cell(v) for v in values]


def show(console: Console, renderable: RenderableType) -> None:
    """Print a dashboard: at the terminal's width, or, where stdout is not a terminal, as wide as it needs.

    NOTE: rich takes 80 columns (or $COLUMNS) where stdout is a pipe (`| less`, `kubectl exec` without -t) and
    shrinks a table to fit, cutting urls, models and phases to "htt…"; a cell is at most MAX_CELL characters,
    so the widest table stays bounded.
    """
    console.print(fit(console, renderable))


def fit(console: Console, renderable: RenderableType) -> RenderableType:
    """Where stdout is not a terminal, widen `console` to what `renderable` needs (show(), and each frame of a
    piped --watch); returns `renderable`."""
    if not console.is_terminal:
        need = Measurement.get(console, console.options.update_width(1 << 16), renderable).maximum
        console.width = max(console.width, need)
    return renderable


def table_width(heads: Sequence[str], rows: Sequence[Sequence[Any]]) -> int:
    """The columns a rich table of these headers and rows takes with no cell folded: each column's widest header
    line or cell, padding 1 each side, and the borders."""
    widest = [max([*(len(line) for line in h.split("\n")), *(len(r[i]) for r in rows)]) for i, h in enumerate(heads)]
    return sum(widest) + 3 * len(heads) + 1


def least_width(heads: Sequence[str], rows: Sequence[Sequence[Any]], whole: Sequence[bool], text_min: int = 6) -> int:
    """The columns a rich table of these headers and rows takes with no padding, the columns marked `whole` (numbers:
    never wrapped) at their widest and each other column folded to at most `text_min`: below it a number is cut."""
    widest = [max([*(len(line) for line in h.split("\n")), *(len(r[i]) for r in rows)]) for i, h in enumerate(heads)]
    return sum(w if keep else min(w, text_min) for w, keep in zip(widest, whole, strict=True)) + len(heads) + 1
