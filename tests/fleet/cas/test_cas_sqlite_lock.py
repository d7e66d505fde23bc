"""SQLite-specific: what happens between the statements of one store call, and how long one call holds
the store's lock. Hooks on the store's connection and lock drive the interleavings, not racing threads."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fleet.cas.sqlite_conns as sqlite_conns
import fleet.cas.sqlite_gc as sqlite_gc
from fleet.cas import blob_charge, open_store
from fleet.core.errors import NotFound, Unavailable

MALLORY = b"mallory's blob " * 2400  # 36,000 bytes: 9 chunks of 4,096
VICTIM = b"VICTIM-SECRET-" * 3000


class _BeforeBlobOpen:
    """A store's read connection, running `hook` once just before the first blob is opened by row id."""

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

    reader = store._reader  # type: ignore[attr-defined]  # reads run on the store's read-only connections
    hooked = _BeforeBlobOpen(reader(), gc_and_put)
    store._reader = lambda: hooked  # type: ignore[attr-defined]
    chunks = store.get_stream(ref, "mallory", chunk_size=4096)
    assert next(chunks) == MALLORY[:4096]  # read from the snapshot of its lookup
    with pytest.raises(NotFound):  # the next chunk's lookup comes after the GC: the blob is gone
        next(chunks)
    store.close()
    other.close()


class _CountingLock:
    """The store's RLock, counting its outermost holds; `between(holds so far)` runs before each hold after
    the first, where another thread's call could get the lock."""

    def __init__(self) -> None:
        self._lock, self._depth, self.holds = threading.RLock(), 0, 0
        self.between: Callable[[int], None] = lambda hold: None

    def __enter__(self) -> None:
        if self._depth == 0 and self.holds:
            between, self.between = self.between, lambda hold: None  # its own calls take the lock too
            between(self.holds)
            self.between = between
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1:
            self.holds += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        self._lock.release()


class _DeletesPerHold:
    """The store's connection, counting the blob rows each hold of the store's lock deletes."""

    def __init__(self, db: sqlite3.Connection, lock: _CountingLock) -> None:
        self._db, self._lock, self.deleted = db, lock, {}

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        cur = self._db.execute(sql, *args)
        if sql.startswith("DELETE FROM blobs"):
            self.deleted[self._lock.holds] = self.deleted.get(self._lock.holds, 0) + cur.rowcount
        return cur

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _expired_store(tmp_path: Path, blobs: list[bytes]) -> tuple[Any, _CountingLock, _DeletesPerHold]:
    """A store holding `blobs` for tenant 'flood' (lease 10 s from t=1000) and one live blob of 'quiet',
    with the lock and the connection counted from here on."""
    store = open_store(f"sqlite:///{tmp_path / 'kv.db'}", lease_s=10.0, clock=lambda: 1000.0)
    for data in blobs:
        store.put(data, "flood")
    store.pin(store.put(b"quiet's blob", "quiet"), "quiet")
    lock = _CountingLock()
    spy = _DeletesPerHold(store._db, lock)  # type: ignore[attr-defined]
    store._lock, store._db = lock, spy  # type: ignore[attr-defined]
    return store, lock, spy


@pytest.mark.parametrize(("batch_rows", "batch_bytes", "sizes", "per_hold"), [
    (4, 1 << 20, [1] * 10, [4, 4, 2]),         # rows: windows of 4 rows (the last holds quiet's too)
    (256, 100, [60, 60, 30, 30, 200], [1, 2, 1, 1]),  # bytes: 60 | 60+30 | 30 | 200 (over, but one row)
])
def test_gc_deletes_in_bounded_transactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_rows: int,
                                            batch_bytes: int, sizes: list[int], per_hold: list[int]) -> None:
    """Each hold of the lock deletes one window of rows, bounded by count and by blob bytes, so another
    tenant's call waits one window at most. Before, one transaction deleted them all (1M expired 1-byte
    blobs held every call for 11 s)."""
    monkeypatch.setattr(sqlite_gc, "_GC_BATCH_ROWS", batch_rows, raising=False)
    monkeypatch.setattr(sqlite_gc, "_GC_BATCH_BYTES", batch_bytes, raising=False)
    blobs = [i.to_bytes(1, "big") * size for i, size in enumerate(sizes)]
    store, lock, spy = _expired_store(tmp_path, blobs)
    first = lock.holds + 1
    assert store.gc(now=2000.0) == len(blobs)
    assert [spy.deleted[h] for h in sorted(spy.deleted) if h >= first and spy.deleted[h]] == per_hold
    assert store.stored_bytes("flood") == 0
    store.close()


def test_gc_keeps_a_blob_pinned_or_referenced_between_its_windows(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls that land while GC lets go of the lock are judged by the next window's DELETE: a blob pinned
    and one referenced after GC started, before their window, are kept; the other expired blobs go."""
    monkeypatch.setattr(sqlite_gc, "_GC_BATCH_ROWS", 4, raising=False)
    blobs = [bytes([i]) for i in range(10)]
    store, lock, _ = _expired_store(tmp_path, blobs)
    pinned, referenced = (hashlib.sha256(b).hexdigest() for b in blobs[8:10])  # the third window's

    def save(hold: int) -> None:
        if hold == gc_first:  # after GC's first window, before its second
            store.pin(pinned, "flood")
            store.add_ref(referenced, "flood")

    gc_first = lock.holds + 1
    lock.between = save
    assert store.gc(now=2000.0) == 8
    assert [store.exists(r, "flood") for r in (pinned, referenced)] == [True, True]
    assert store.stored_bytes("flood") == 2 * blob_charge(1)
    store.close()


def test_a_store_closed_between_gc_windows_ends_the_gc_without_an_error(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller closes the store at stop while a GC thread may be between windows: the next window
    raised sqlite3.ProgrammingError (closed database). Now GC stops there and returns what it deleted."""
    monkeypatch.setattr(sqlite_gc, "_GC_BATCH_ROWS", 4, raising=False)
    store = open_store(f"sqlite:///{tmp_path / 'kv.db'}", lease_s=10.0, clock=lambda: 1000.0)
    for i in range(10):
        store.put(bytes([i]), "flood")
    window = store._gc_window  # type: ignore[attr-defined]

    def then_close(after: int, now: float) -> Any:
        out = window(after, now)
        store.close()  # as the controller's stop does, from another thread, between two windows
        return out

    store._gc_window = then_close  # type: ignore[attr-defined]
    assert store.gc(now=2000.0) == 4  # the first window's, then it stopped


def test_reads_do_not_wait_behind_a_write_and_see_only_what_it_committed(tmp_path: Path) -> None:
    """A write holds the writer's transaction open (as a large put does while it writes and commits); reads in
    other threads still answer, from the last committed snapshot. Before, every read took the writer's lock and
    waited for the whole write (stat() p99 558 ms beside three threads of 32 MiB puts)."""
    store = open_store(f"sqlite:///{tmp_path / 'kv.db'}")
    ref = store.put(b"a tool result", "acme")
    store.kv_put("ns", "k", b"v1")
    store.oplog_append("acme", "s", {"op": 1})
    answers: dict[str, Any] = {}

    def read_all() -> None:
        answers["stat"] = store.stat(ref, "acme").verdict
        answers["get"] = store.get(ref, "acme")
        answers["kv"] = store.kv_get("ns", "k")
        answers["scan"] = store.kv_scan("ns")
        answers["oplog"] = store.oplog_read("acme", "s")
        answers["bytes"] = store.stored_bytes("acme")

    with store._tx() as db:  # type: ignore[attr-defined]  # a write in progress, not yet committed
        db.execute("UPDATE blobs SET verdict = 'QUARANTINED'")
        db.execute("UPDATE kv SET value = x'7632'")
        reader = threading.Thread(target=read_all)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the reads waited for the write"  # before: blocked until the commit
    assert answers == {"stat": "UNKNOWN", "get": b"a tool result", "kv": b"v1", "scan": {"k": b"v1"},
                       "oplog": [{"op": 1}], "bytes": blob_charge(13)}
    # control: once committed, the same reads see the write
    assert store.stat(ref, "acme").verdict == "QUARANTINED" and store.kv_get("ns", "k") == b"v2"
    store.close()
    with pytest.raises(Exception, match="closed"):
        store.stat(ref, "acme")


def test_close_leaves_no_wal_after_reads(tmp_path: Path) -> None:
    """The writer closes last, so it checkpoints the WAL and removes it: closed after the read-only connections'
    last use, the WAL (4 MB after a few puts) and its -shm stayed beside the file."""
    store = open_store(f"sqlite:///{tmp_path / 'kv.db'}")
    ref = store.put(b"x" * 100_000, "acme")
    assert store.get(ref, "acme") and (tmp_path / "kv.db-wal").exists()  # a read; the WAL is there
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.db"]
    assert open_store(f"sqlite:///{tmp_path / 'kv.db'}").get(ref, "acme") == b"x" * 100_000  # the data is in the file


def test_close_refuses_a_read_waiting_for_a_connection_and_waits_for_the_reads_in_flight(tmp_path: Path) -> None:
    """READERS reads in flight and one more waiting for a connection when close() comes: the waiting one is refused
    (Unavailable "closed") at once, close() returns once the reads in flight give their connections back, and the
    writer, closing last, removes the WAL. Before, the waiting read never returned (nor would an asyncio.run
    whose thread it held), close() returned at once and the WAL stayed. Control: the reads in flight finish."""
    store = open_store(f"sqlite:///{tmp_path / 'kv.db'}")
    store.kv_put("ns", "k", b"v")
    reads = [store._read() for _ in range(sqlite_conns.READERS)]  # type: ignore[attr-defined]
    for r in reads:
        assert r.__enter__().execute("SELECT value FROM kv").fetchone() == (b"v",)  # every connection in use
    got: list[object] = []

    def kv_get() -> None:
        try:
            got.append(store.kv_get("ns", "k"))
        except Exception as e:  # noqa: BLE001  # what the waiting read ends with is the assertion
            got.append(e)

    waiting, closing = threading.Thread(target=kv_get, daemon=True), threading.Thread(target=store.close, daemon=True)
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive() and not got  # waiting for a connection
    closing.start()
    waiting.join(5.0)
    assert not waiting.is_alive() and isinstance(got[0], Unavailable) and "closed" in str(got[0])
    closing.join(0.2)
    assert closing.is_alive()  # waiting for the reads in flight
    for r in reads:
        r.__exit__(None, None, None)
    closing.join(5.0)
    assert not closing.is_alive()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.db"]


def test_a_relative_path_names_the_same_file_after_a_chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative sqlite URL is resolved once, at open: a chdir before the first read no longer sends the reads to
    another file of the same name (they read b"from-b", the other store's value, on the code before) while the
    writer kept the first. Control: the other store, opened after the chdir, reads its own file."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    store = open_store("sqlite:///kv.db")
    store.kv_put("ns", "k", b"from-a")
    monkeypatch.chdir(tmp_path / "b")
    other = open_store("sqlite:///kv.db")
    other.kv_put("ns", "k", b"from-b")
    assert store.kv_get("ns", "k") == b"from-a" and other.kv_get("ns", "k") == b"from-b"
    store.close()
    other.close()
