"""Embedded backend: one real SQLite database file in WAL mode, one transaction per mutation.

Tables (every blob row is keyed by (tenant, ref), so tenants never see each other's rows):

    blobs(id, tenant, ref, data, size, created, pins, refs, verdict, reasons, lease_expires, charge)
    tenant_bytes(tenant, num_bytes)   the sum of blobs.charge per tenant, kept by triggers on blobs
    kv(namespace, key, value)
    oplog(tenant, session_id, idx, op)

A blob's charge is what it counts against its tenant's quota: size + PER_BLOB_OVERHEAD, recorded in
its row so that deleting it gives back exactly what inserting it counted. A row from before the
column (charge NULL) counted, and gives back, its size alone.

Writes go through one connection shared by threads behind a lock; reads go through a small pool of
read-only connections of their own (READERS), each read in one transaction, so a read sees a committed
snapshot and never waits behind a write: WAL lets readers and the writer run at once. Other processes may
open the same file (WAL + busy_timeout serialise the writers).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fleet.cas import sqlite_holders
from fleet.cas.base import BlobMeta, BlobStore, StoreConfig, blob_charge
from fleet.core.errors import InvalidArgument, KvfleetError, Unavailable
from fleet.core.verdict import UNKNOWN

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL, ref TEXT NOT NULL, data BLOB NOT NULL, size INTEGER NOT NULL,
    created REAL NOT NULL, pins INTEGER NOT NULL DEFAULT 0, refs INTEGER NOT NULL DEFAULT 0,
    verdict TEXT NOT NULL, reasons TEXT NOT NULL DEFAULT '[]', lease_expires REAL NOT NULL,
    charge INTEGER,
    UNIQUE (tenant, ref)
);
CREATE TABLE IF NOT EXISTS kv (
    namespace TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, PRIMARY KEY (namespace, key)
);
CREATE TABLE IF NOT EXISTS oplog (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, idx INTEGER NOT NULL, op TEXT NOT NULL,
    PRIMARY KEY (tenant, session_id, idx)
);
"""

# Per-tenant stored bytes, kept by triggers, so every write path (put, GC's bulk DELETE) counts.
# The triggers before per-blob charges (blobs_count_*) counted size; they are replaced on open.
_CHARGE = "COALESCE({row}.charge, {row}.size)"
_USAGE_DDL = (
    "CREATE TABLE IF NOT EXISTS tenant_bytes (tenant TEXT PRIMARY KEY, num_bytes INTEGER NOT NULL)",
    "DROP TRIGGER IF EXISTS blobs_count_in",
    "DROP TRIGGER IF EXISTS blobs_count_out",
    f"""CREATE TRIGGER IF NOT EXISTS blobs_charge_in AFTER INSERT ON blobs BEGIN
        INSERT INTO tenant_bytes (tenant, num_bytes) VALUES (NEW.tenant, {_CHARGE.format(row="NEW")})
            ON CONFLICT (tenant) DO UPDATE SET num_bytes = num_bytes + {_CHARGE.format(row="NEW")};
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS blobs_charge_out AFTER DELETE ON blobs BEGIN
        UPDATE tenant_bytes SET num_bytes = num_bytes - {_CHARGE.format(row="OLD")} WHERE tenant = OLD.tenant;
        DELETE FROM tenant_bytes WHERE tenant = OLD.tenant AND num_bytes <= 0;
    END""",
)

_META_COLS = "ref, size, created, pins, refs, verdict, reasons, lease_expires"

# One GC transaction looks at no more than this many rows, nor (past its first row) this many blob bytes:
# deleting a row costs 4-11 us for a 1-byte blob and about 6 ms per MiB of a large one (its pages are freed
# one by one), so a count alone would not bound the time another call waits.
_GC_BATCH_ROWS = 256
_GC_BATCH_BYTES = 8 << 20
# Read-only connections for reads. NOTE: reads shared the writer's connection and lock, so a read waited for
# a large put's commit: stat() p99 558 ms beside three threads of 32 MiB puts (59 ms with the puts on another
# file). A read past READERS at once waits for a free connection, never for a write.
READERS = 4
# How long close() waits for the reads in flight to give their connections back, so that the writer closes last
# and checkpoints the WAL; past it the writer closes anyway (a slow read then leaves the WAL for the next open).
CLOSE_WAIT_S = 10.0


def sqlite_path(url: str) -> str:
    """SQLAlchemy's convention: `sqlite:///rel/path.db` -> `rel/path.db` (relative to the working
    directory); `sqlite:////abs/path.db` -> `/abs/path.db`. (`sqlite://rel.db` is read as relative too.)"""
    path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else url[len("sqlite://"):]
    if not path or path == "/":
        raise InvalidArgument(f"sqlite URL {url!r} names no file: use sqlite:///path/to/kvfleet.db")
    return path


class SqliteBlobStore(BlobStore):
    """BlobStore on a local SQLite file (the embedded default)."""

    def __init__(self, cfg: StoreConfig) -> None:
        super().__init__(cfg)
        self.path = sqlite_path(cfg.url)
        # NOTE: resolved once, here: resolved at a reader's first use, a relative path after a chdir named another file
        self._ro_uri = f"file:{urllib.parse.quote(os.path.abspath(self.path))}?mode=ro"
        parent = os.path.dirname(self.path)
        if parent:
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                raise Unavailable(f"sqlite database {self.path}: its directory cannot be made: {e}") from e
        try:
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise Unavailable(f"sqlite database {self.path} cannot be opened: {e}") from e
        self._lock = threading.RLock()
        self._closed = False
        self._idle: list[sqlite3.Connection] = []  # read-only connections not in use
        self._num_readers = 0  # read-only connections open
        self._num_out = 0  # of them, in use by a read
        self._readers = threading.Condition(threading.Lock())  # guards the three above and `_closed` for reads
        try:
            self._prepare()
        except (sqlite3.Error, Unavailable) as e:
            self._db.close()
            raise _unusable(self.path, e) from e

    def _prepare(self) -> None:
        """WAL mode, the schema, and the byte count of a file from before it (the first writes to the file)."""
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA + sqlite_holders.SCHEMA)
        with self._tx() as db:  # one writer at a time: the backfill below runs once per file
            fresh = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'tenant_bytes'").fetchone() is None
            if not any(col[1] == "charge" for col in db.execute("PRAGMA table_info(blobs)")):
                db.execute("ALTER TABLE blobs ADD COLUMN charge INTEGER")  # a file from before charges: rows NULL
            for stmt in _USAGE_DDL:
                db.execute(stmt)
            if fresh:  # a file from before the table: count the blobs it already holds
                db.execute(f"INSERT INTO tenant_bytes SELECT tenant, SUM({_CHARGE.format(row='blobs')}) "
                           "FROM blobs GROUP BY tenant")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: everything inside commits together or not at all."""
        with self._lock, self._busy():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction on a read-only connection: every statement inside reads the same committed
        snapshot of the file, whatever a writer does meanwhile."""
        db = self._reader()
        try:
            with self._busy():
                db.execute("BEGIN")
                try:
                    yield db
                finally:
                    db.execute("COMMIT")
        finally:
            self._give_back(db)

    def _reader(self) -> sqlite3.Connection:
        """A free read-only connection: an idle one, a new one while fewer than READERS exist, else the next
        one given back. Raises Unavailable once the store is closed, a read waiting for a connection too.

        NOTE: the wait was a queue's get() with no closed check: a read waiting at close() never returned (the
        connection given back went to close()), and neither did an asyncio.run whose thread it held."""
        with self._readers:
            while True:
                if self._closed:
                    raise Unavailable(f"sqlite database {self.path} is closed")
                if self._idle:
                    self._num_out += 1
                    return self._idle.pop()
                if self._num_readers < READERS:
                    self._num_readers += 1
                    self._num_out += 1
                    break
                self._readers.wait()
        try:
            return sqlite3.connect(self._ro_uri, uri=True, timeout=30.0, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as e:
            with self._readers:
                self._num_readers -= 1
                self._num_out -= 1
                self._readers.notify_all()
            raise Unavailable(f"sqlite database {self.path} cannot be opened for reading: {e}") from e

    def _give_back(self, db: sqlite3.Connection) -> None:
        """A read is done with its connection: idle again, or closed if the store closed meanwhile."""
        with self._readers:
            self._num_out -= 1
            if self._closed:
                self._num_readers -= 1
                db.close()
            else:
                self._idle.append(db)
            self._readers.notify_all()

    @contextmanager
    def _busy(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as e:  # locked past the timeout, disk full, file gone
            raise Unavailable(f"sqlite database {self.path} unavailable: {e}") from e

    def _one(self, sql: str, args: tuple[object, ...]) -> tuple[Any, ...] | None:
        with self._read() as db:
            row = db.execute(sql, args).fetchone()
        return tuple(row) if row is not None else None

    # ---- blobs ----------------------------------------------------------------------------------
    def _put(self, tenant: str, ref: str, data: memoryview, now: float, quota: int) -> int | None:
        lease = self._lease(now)
        with self._tx() as db:
            cur = db.execute(
                "UPDATE blobs SET lease_expires = MAX(lease_expires, ?) WHERE tenant = ? AND ref = ?",
                (lease, tenant, ref),
            )
            if cur.rowcount:  # already stored: costs nothing
                return None
            used, charge = _tenant_bytes(db, tenant), blob_charge(data.nbytes)
            if quota and used + charge > quota:
                return used
            # new blob: data and metadata in the same row, same transaction (the trigger counts its charge)
            db.execute(
                "INSERT INTO blobs (tenant, ref, data, size, created, verdict, lease_expires, charge) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (tenant, ref, data, data.nbytes, now, UNKNOWN, lease, charge),
            )
            return None

    def _stored_bytes(self, tenant: str) -> int:
        with self._read() as db:
            return _tenant_bytes(db, tenant)

    def _get(self, tenant: str, ref: str) -> bytes | None:
        row = self._one("SELECT data FROM blobs WHERE tenant = ? AND ref = ?", (tenant, ref))
        return bytes(row[0]) if row is not None else None

    def _get_range(self, tenant: str, ref: str, start: int, length: int) -> bytes | None:
        # NOTE: the row id was once looked up in one hold of the lock and its blob opened in another. Row ids
        # are reused (no AUTOINCREMENT), so a GC and another tenant's put in between served that tenant's
        # bytes under this tenant's ref, and a GC alone raised "no such rowid". Lookup and read are now one
        # read transaction: one snapshot, which another connection to the file cannot change either. A row
        # gone before the lookup is not found; one deleted after it is still read from the snapshot.
        # blobopen, not SELECT substr(...): substr loads the whole blob (a 1 MiB range of a 64 MiB blob:
        # 63 ms against 1.4 ms).
        with self._read() as db:
            row = db.execute("SELECT id FROM blobs WHERE tenant = ? AND ref = ?", (tenant, ref)).fetchone()
            if row is None:
                return None
            with db.blobopen("blobs", "data", int(row[0]), readonly=True) as blob:
                blob.seek(start)
                return bytes(blob.read(length))

    def _stat(self, tenant: str, ref: str) -> BlobMeta | None:
        row = self._one(f"SELECT {_META_COLS} FROM blobs WHERE tenant = ? AND ref = ?", (tenant, ref))
        return _meta(row) if row is not None else None

    def _incr(self, tenant: str, ref: str, counter: str, delta: int) -> int | None:
        assert counter in ("pins", "refs")
        with self._tx() as db:
            row = db.execute(f"SELECT {counter} FROM blobs WHERE tenant = ? AND ref = ?", (tenant, ref)).fetchone()
            if row is None:
                return None
            value = int(row[0]) + delta
            if value < 0:
                return -1
            db.execute(f"UPDATE blobs SET {counter} = ? WHERE tenant = ? AND ref = ?", (value, tenant, ref))
            return value

    def _hold_one(self, tenant: str, ref: str, holder: str, delta: int) -> int | None:
        with self._tx() as db:
            return sqlite_holders.hold(db, tenant, ref, holder, delta)

    def _held(self, holder: str) -> list[tuple[str, str]]:
        with self._tx() as db:
            return sqlite_holders.held(db, holder)

    def _set_verdict(self, tenant: str, ref: str, verdict: str, reasons_json: str) -> bool:
        with self._tx() as db:
            cur = db.execute(
                "UPDATE blobs SET verdict = ?, reasons = ? WHERE tenant = ? AND ref = ?",
                (verdict, reasons_json, tenant, ref),
            )
            return cur.rowcount == 1

    def _gc(self, now: float) -> int:
        """Walk the blobs in id order, one window of rows a transaction, letting go of the lock between
        windows so that every other call waits for one window at most, never the whole collection.

        NOTE: GC once deleted every expired row in one transaction under the store's one lock: 1M expired
        1-byte blobs (within one tenant's default quota) held every tenant's calls for 11 s.
        """
        deleted, after = 0, 0  # SQLite numbers rows from 1
        # NOTE: a close() between two windows made the next one raise ProgrammingError (closed database)
        while (window := self._gc_window(after, now)) is not None:
            after, num_deleted = window
            deleted += num_deleted
            # NOTE: the lock is not fair: without this yield, GC took it back before a woken waiter ran,
            # which then waited many windows (200,000 expired blobs: quiet stat() p99 97 ms, now 19 ms)
            time.sleep(0)
        return deleted

    def _gc_window(self, after: int, now: float) -> tuple[int, int] | None:
        """Delete the collectable rows among the next window after row id `after`; return (the window's
        last id, rows deleted), or None past the last row. The DELETE itself judges each row, in the same
        transaction, so a blob pinned or referenced before its window is reached is kept."""
        with self._lock:  # the same (reentrant) lock the transaction takes: close() cannot come between
            if self._closed:
                return None
            with self._tx() as db:
                # length() of a blob reads the row's header, not its bytes
                rows = db.execute("SELECT id, length(data) FROM blobs WHERE id > ? ORDER BY id LIMIT ?",
                                  (after, _GC_BATCH_ROWS)).fetchall()
                if not rows:
                    return None
                last = _window_end(rows, _GC_BATCH_BYTES)
                cur = db.execute("DELETE FROM blobs WHERE id > ? AND id <= ? AND pins = 0 AND refs = 0 "
                                 "AND lease_expires <= ?", (after, last, now))
                return last, int(cur.rowcount)

    # ---- controller state -------------------------------------------------------------------------
    def _kv_put(self, namespace: str, key: str, value: bytes) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO kv (namespace, key, value) VALUES (?, ?, ?)", (namespace, key, value))

    def _kv_get(self, namespace: str, key: str) -> bytes | None:
        row = self._one("SELECT value FROM kv WHERE namespace = ? AND key = ?", (namespace, key))
        return bytes(row[0]) if row is not None else None

    def _kv_scan(self, namespace: str) -> dict[str, bytes]:
        with self._read() as db:
            rows = db.execute("SELECT key, value FROM kv WHERE namespace = ?", (namespace,)).fetchall()
        return {str(k): bytes(v) for k, v in rows}

    def _kv_delete(self, namespace: str, key: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM kv WHERE namespace = ? AND key = ?", (namespace, key))

    def _kv_scan_page(self, namespace: str, cursor: str, count: int) -> tuple[str, dict[str, bytes]]:
        with self._read() as db:  # the cursor is the last key returned: the primary key's order, no offset
            rows = db.execute("SELECT key, value FROM kv WHERE namespace = ? AND key > ? ORDER BY key LIMIT ?",
                              (namespace, cursor, count)).fetchall()
        return (str(rows[-1][0]) if len(rows) == count else ""), {str(k): bytes(v) for k, v in rows}

    def _kv_delete_many(self, namespace: str, keys: list[str]) -> None:
        with self._tx() as db:
            db.executemany("DELETE FROM kv WHERE namespace = ? AND key = ?", [(namespace, k) for k in keys])

    def _kv_swap(self, namespace: str, key: str, old: bytes | None, new: bytes | None) -> bool:
        with self._tx() as db:  # IMMEDIATE: no other writer between the read and the write
            row = db.execute("SELECT value FROM kv WHERE namespace = ? AND key = ?", (namespace, key)).fetchone()
            if (None if row is None else bytes(row[0])) != old:
                return False
            if new is None:
                db.execute("DELETE FROM kv WHERE namespace = ? AND key = ?", (namespace, key))
            else:
                db.execute("INSERT OR REPLACE INTO kv (namespace, key, value) VALUES (?, ?, ?)", (namespace, key, new))
        return True

    # ---- op log -------------------------------------------------------------------------------------
    def _oplog_append(self, tenant: str, session_id: str, op_json: str) -> int:
        with self._tx() as db:
            (idx,) = db.execute(
                "SELECT COALESCE(MAX(idx) + 1, 0) FROM oplog WHERE tenant = ? AND session_id = ?",
                (tenant, session_id),
            ).fetchone()
            db.execute("INSERT INTO oplog (tenant, session_id, idx, op) VALUES (?, ?, ?, ?)",
                       (tenant, session_id, idx, op_json))
            return int(idx)

    def _oplog_read(self, tenant: str, session_id: str) -> list[str]:
        with self._read() as db:
            rows = db.execute(
                "SELECT op FROM oplog WHERE tenant = ? AND session_id = ? ORDER BY idx", (tenant, session_id)
            ).fetchall()
        return [str(r[0]) for r in rows]

    def _oplog_delete(self, tenant: str, session_id: str) -> bool:
        with self._tx() as db:
            cur = db.execute("DELETE FROM oplog WHERE tenant = ? AND session_id = ?", (tenant, session_id))
            return cur.rowcount > 0

    def _oplog_replace(self, tenant: str, session_id: str, ops_json: list[str]) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM oplog WHERE tenant = ? AND session_id = ?", (tenant, session_id))
            db.executemany("INSERT INTO oplog (tenant, session_id, idx, op) VALUES (?, ?, ?, ?)",
                           ((tenant, session_id, i, op) for i, op in enumerate(ops_json)))

    def close(self) -> None:
        """Refuse reads and writes from now (a read waiting for a connection too), wait up to CLOSE_WAIT_S for the
        reads in flight, then close the writer."""
        with self._lock, self._readers:
            self._closed = True  # a GC between windows stops at the next one; a read after this is refused
            self._readers.notify_all()
            # NOTE: the readers first (the idle ones now, those in use when given back): the last connection to
            # close checkpoints the WAL into the file and deletes it, which a read-only one cannot do
            for db in self._idle:
                db.close()
            self._num_readers -= len(self._idle)
            self._idle.clear()
            self._readers.wait_for(lambda: self._num_out <= 0, timeout=CLOSE_WAIT_S)
            self._db.close()


def _unusable(path: str, e: BaseException) -> KvfleetError:
    """Why the file at `path` cannot be the store, from the error of its first writes.

    NOTE: these were raw sqlite3 errors ("unable to open database file", naming neither the file nor the fix):
    `kvfleet controller` on a read-only volume (readOnlyRootFilesystem, a ConfigMap mount) died with a traceback.
    """
    cause = e.__cause__ if isinstance(e, Unavailable) and e.__cause__ is not None else e
    code = getattr(cause, "sqlite_errorcode", 0) & 0xFF  # the primary result code
    if code == sqlite3.SQLITE_NOTADB:
        return InvalidArgument(f"sqlite database {path} cannot be used: {cause}; the store URL must name a kvfleet "
                               "SQLite database or a file that does not exist yet")
    if code in (sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM):
        where = os.path.dirname(os.path.abspath(path))
        return Unavailable(f"sqlite database {path} cannot be written: {cause}; the store writes the file and, "
                           f"beside it, its -wal and -shm files: {where} must be a writable directory (not a "
                           "read-only volume)")
    return e if isinstance(e, Unavailable) else Unavailable(f"sqlite database {path} cannot be opened: {cause}")


def _tenant_bytes(db: sqlite3.Connection, tenant: str) -> int:
    row = db.execute("SELECT num_bytes FROM tenant_bytes WHERE tenant = ?", (tenant,)).fetchone()
    return int(row[0]) if row is not None else 0


def _window_end(rows: list[tuple[int, int]], max_bytes: int) -> int:
    """The last id of the longest prefix of `rows` ((id, blob bytes) in id order) holding at most
    `max_bytes` blob bytes, and at least one row."""
    total = 0
    for i, (_, num_bytes) in enumerate(rows):
        total += num_bytes
        if total > max_bytes and i:
            return int(rows[i - 1][0])
    return int(rows[-1][0])


def _meta(row: tuple[Any, ...]) -> BlobMeta:
    import json  # noqa: PLC0415

    ref, size, created, pins, refs, verdict, reasons, lease = row
    return BlobMeta(ref=str(ref), size=int(size), created=float(created), pins=int(pins),
                    refs=int(refs), verdict=str(verdict), reasons=tuple(json.loads(str(reasons))),
                    lease_expires=float(lease))
