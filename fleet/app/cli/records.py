"""A dashboard table too wide for the terminal, shown as records: one `field  value` line per cell.

NOTE: below the narrowest layout a table has (`session ls` folded: about 63 columns; `worker ls` without url and
model), rich squeezed columns to nothing: at 40 columns the session ids, tenants and states were gone and the
numbers cut to "1,234,56" (found by review). A record's value folds onto more lines where it is long; nothing is
left out or cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from fleet.app.cli.cells import cell


def records(title: str | Text, heads: Sequence[str], rows: Sequence[Sequence[Text]], empty: str,
            styles: Sequence[str | None] = ()) -> Table:
    """`rows` (cells under `heads`) as records, a blank line between two; `empty` where there is no row; `styles`:
    each row's style (None: none)."""
    t = Table(title=title, title_justify="left", box=None, show_header=False, padding=(0, 1, 0, 0))
    t.add_column(no_wrap=True, style="bold")
    t.add_column(overflow="fold")
    for i, row in enumerate(rows):
        if i:
            t.add_row("", "")
        style = styles[i] if i < len(styles) else None
        for head, value in zip(heads, row, strict=True):
            t.add_row(head.replace("\n", " "), value, style=style)
    if not rows:
        t.add_row("", cell(empty))
    return t
