"""SQLite GC: the blobs walked in row-id order, one bounded window of rows a transaction, so that every other
call waits for one window at most, never the whole collection."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

# One GC transaction looks at no more than this many rows, nor (past its first row) this many blob bytes:
# deleting a row costs 4-11 us for a 1-byte blob and about 6 ms per MiB of a large one (its pages are freed
# one by one), so a count alone would not bound the time another call waits.
_GC_BATCH_ROWS = 256
_GC_BATCH_BYTES = 8 << 20


def collect(window: Callable[[int], tuple[int, int] | None]) -> int:
    """Run `window(after)` (SqliteBlobStore._gc_window) from the first row until it returns None; return the rows
    deleted.

    NOTE: GC once deleted every expired row in one transaction under the store's one lock: 1M expired
    1-byte blobs (within one tenant's default quota) held every tenant's calls for 11 s.
    """
    deleted, after = 0, 0  # SQLite numbers rows from 1
    # NOTE: a close() between two windows made the next one raise ProgrammingError (closed database)
    while (window_out := window(after)) is not None:
        after, num_deleted = window_out
        deleted += num_deleted
        # NOTE: the lock is not fair: without this yield, GC took it back before a woken waiter ran,
        # which then waited many windows (200,000 expired blobs: quiet stat() p99 97 ms, now 19 ms)
        time.sleep(0)
    return deleted


def delete_window(db: sqlite3.Connection, after: int, now: float) -> tuple[int, int] | None:
    """Delete the collectable rows among the next window after row id `after`, inside the caller's transaction;
    return (the window's last id, rows deleted), or None past the last row. The DELETE itself judges each row, in
    the same transaction, so a blob pinned or referenced before its window is reached is kept."""
    # length() of a blob reads the row's header, not its bytes
    rows = db.execute("SELECT id, length(data) FROM blobs WHERE id > ? ORDER BY id LIMIT ?",
                      (after, _GC_BATCH_ROWS)).fetchall()
    if not rows:
        return None
    last = _window_end(rows, _GC_BATCH_BYTES)
    cur = db.execute("DELETE FROM blobs WHERE id > ? AND id <= ? AND pins = 0 AND refs = 0 "
                     "AND lease_expires <= ?", (after, last, now))
    return last, int(cur.rowcount)


def _window_end(rows: list[tuple[int, int]], max_bytes: int) -> int:
    """The last id of the longest prefix of `rows` ((id, blob bytes) in id order) holding at most
    `max_bytes` blob bytes, and at least one row."""
    total = 0
    for i, (_, num_bytes) in enumerate(rows):
        total += num_bytes
        if total > max_bytes and i:
            return int(rows[i - 1][0])
    return int(rows[-1][0])
