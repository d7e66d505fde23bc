"""Which memo row holds each token's layer-0 projection (pure bookkeeping; the ops own the arrays).

The layer-0 q/k/v projection of a token depends on its id alone (its hidden state is its
embedding), so each backend computes it once per id, alone in a fixed [1, dim] shape, and keeps it
in a row table that a tile gathers from in one indexing op. This class maps ids to rows, first in
first out once `capacity` rows are used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

L0_MEMO_BYTES = 64 << 20  # layer-0 projections kept per kernel (oldest dropped first) ...
L0_MIN_ROWS = 4096  # ... but never fewer rows than this (4 tiles of the largest tile size)


def memo_rows(row_bytes: int) -> int:
    """Capacity in rows of a memo whose rows take `row_bytes` each."""
    return max(L0_MIN_ROWS, L0_MEMO_BYTES // row_bytes)


@dataclass(slots=True)
class L0Slots:
    """Token id -> row of the memo table.

    Invariant: a call to `lookup` (at most `capacity // 2` ids) never reuses a row it returns; rows
    are otherwise reused first in first out.
    """

    capacity: int
    rows: dict[int, int] = field(default_factory=dict)
    owner: list[int] = field(default_factory=list)  # row -> token id
    cursor: int = 0  # next row to reuse once full

    def __post_init__(self) -> None:
        assert self.capacity >= 2, "the memo needs at least two rows"

    def lookup(self, ids: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Rows for `ids` (in order), and the (id, row) pairs the caller must compute and fill.

        A row returned by this call (hit or miss) is never reused by a later miss of the same call.
        """
        assert len(ids) <= self.capacity // 2, "look up at most capacity // 2 ids per call"
        out: list[int] = []
        misses: list[tuple[int, int]] = []
        held: set[int] = set()
        for tok in ids:
            row = self.rows.get(tok)
            if row is None:
                row = self._claim(tok, held)
                misses.append((tok, row))
            held.add(row)
            out.append(row)
        return out, misses

    def _claim(self, tok: int, held: set[int]) -> int:
        if len(self.owner) < self.capacity:
            row = len(self.owner)
            self.owner.append(tok)
        else:
            while self.cursor in held:  # at most capacity // 2 rows are held: this ends
                self.cursor = (self.cursor + 1) % self.capacity
            row = self.cursor
            self.rows.pop(self.owner[row], None)  # -1: a forgotten row
            self.owner[row] = tok
            self.cursor = (row + 1) % self.capacity
        self.rows[tok] = row
        return row

    def fill(self, misses: list[tuple[int, int]], compute: Callable[[int, int], None]) -> None:
        """`compute(tok, row)` for each (token id, row) `lookup` missed; one that raises leaves its row and the
        rows after it unmapped (`forget`), so no later lookup gathers a row that was never filled."""
        for i, (tok, row) in enumerate(misses):
            try:
                compute(tok, row)
            except BaseException:  # NOTE: a row claimed but never filled was gathered later, stale
                self.forget([t for t, _ in misses[i:]])
                raise

    def forget(self, ids: list[int]) -> None:
        """Unmap `ids` (rows claimed by `lookup` whose computation failed): their rows hold nothing
        valid, so a later lookup computes them again. The rows are reused in their turn."""
        for tok in ids:
            row = self.rows.pop(tok, None)
            if row is not None:
                self.owner[row] = -1  # owned by no token id

    def clear(self) -> None:
        self.rows.clear()
        self.owner.clear()
        self.cursor = 0

    @property
    def num_used(self) -> int:
        return len(self.owner)
