"""SQLite-specific: what happens between the statements of one store call, and how long one call holds the
store's lock. The interleavings are driven by hooks on the store's connection and lock, not by racing threads."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.cas import open_store
from fleet.core.errors import NotFound

MALLORY = b"mallory's blob " * 2400  # 36,000 bytes: 9 chunks of 4,096
VICTIM = b"VICTIM-SECRET-" * 3000


class _BeforeBlobOpen:
    """The store's connection, running `hook` once just before the first blob is opened by row id."""

    def __init__(self, db: sqlite3.Connection, hook: Callable[[], None]) -> None:
        self._db, self._hook = db, hook

    def blobopen(self, *args: Any, **kw: Any) -> sqlite3.Blob:
        hook, self._hook = self._hook, lambda: None
        hook()
        return self._db.blobopen(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


@pytest.mark.parametrize("victim_puts", [True, False], ids=["row-id-reused", "row-deleted"])
def test_a_streamed_read_never_sees_rows_changed_after_its_lookup(tmp_path: Path, victim_puts: bool) -> None:
    """GC (on another connection to the file, as another process would) deletes the reader's row between
    its lookup and its read, and another tenant's put reuses the row id. Before, the reader was served the
    other tenant's bytes under its own ref (row-id-reused) or got sqlite3.OperationalError 'no such rowid'
    (row-deleted); now that chunk is read as the row was at its lookup, and the next one is not found."""
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    store, other = open_store(url, lease_s=0.0), open_store(url, lease_s=0.0)
    ref = store.put(MALLORY, "mallory")

    def gc_and_put() -> None:
        assert other.gc() == 1
        if victim_puts:
            other.put(VICTIM, "victim")

    store._db = _BeforeBlobOpen(store._db, gc_and_put)  # type: ignore[attr-defined]
    chunks = store.get_stream(ref, "mallory", chunk_size=4096)
    assert next(chunks) == MALLORY[:4096]  # read from the snapshot of its lookup
    with pytest.raises(NotFound):  # the next chunk's lookup comes after the GC: the blob is gone
        next(chunks)
    store.close()
    other.close()
