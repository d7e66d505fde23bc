"""Table cells from what a controller answered: shown as text, never read as markup or terminal codes.

rich reads a plain str cell as markup, so a worker named `w[/]` ended the dashboard with a MarkupError, and a
control character went to the terminal as it came (a session id holding `\\x1b]0;...\\x07\\x1b[2J` set the window
title and cleared the screen). A cell is now a `rich.text.Text` (no markup), its C0/C1 control characters shown
escaped, and at most MAX_CELL characters.
"""

from __future__ import annotations

import re

from rich.text import Text

MAX_CELL = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def cell(value: object) -> Text:
    s = _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(value))
    return Text(s if len(s) <= MAX_CELL else s[: MAX_CELL - 1] + "…")


def cells(*values: object) -> list[Text]:
    return [cell(v) for v in values]
