"""Embedded backend: one real SQLite database file in WAL mode, one transaction per mutation.

Its parts: the tables, and what opening an older file adds (fleet/cas/sqlite_schema.py); the connections, a writer
behind a lock and a pool of read-only readers (sqlite_conns.py); GC in bounded windows (sqlite_gc.py); named
references (sqlite_holders.py). This module holds the store's calls, each one transaction.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from typing import Any

from fleet.cas import sqlite_gc, sqlite_holders, sqlite_schema
from fleet.cas.base import BlobMeta, BlobStore, StoreConfig, blob_charge
from fleet.cas.sqlite_conns import SqliteConnections, unusable
from fleet.cas.types import at_zero
from fleet.core.errors import InvalidArgument, Unavailable
from fleet.core.verdict import UNKNOWN

_META_COLS = "ref, size, created, pins, refs, verdict, reasons, lease_expires"


def sqlite_path(url: str) -> str:
    """SQLAlchemy's convention: `sqlite:///rel/path.db` -> `rel/path.db` (relative to the working
    directory); `sqlite:////abs/path.db` -> `/abs/path.db`. (`sqlite://rel.db` is read as relative too.)"""
    path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else url[len("sqlite://"):]
    if not path or path == "/":
        raise InvalidArgument(f"sqlite URL {url!r} names no file: use sqlite:///path/to/kvfleet.db")
    return path


class SqliteBlobStore(SqliteConnections, BlobStore):
    """BlobStore on a local SQLite file (the embedded default)."""

    def __init__(self, cfg: StoreConfig) -> None:
        super().__init__(cfg)
        self._open(sqlite_path(cfg.url))
        try:
            self._prepare()
        except (sqlite3.Error, Unavailable) as e:
            self._db.close()
            raise unusable(self.path, e) from e

    def _prepare(self) -> None:
        """WAL mode, the schema, and the byte count of a file from before it (the first writes to the file)."""
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(sqlite_schema.SCHEMA + sqlite_holders.SCHEMA)
        with self._tx() as db:  # one writer at a time: the backfill runs once per file
            sqlite_schema.migrate(db)

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
            used, charge = sqlite_schema.tenant_bytes(db, tenant), blob_charge(data.nbytes)
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
            return sqlite_schema.tenant_bytes(db, tenant)

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

    def _incr(self, tenant: str, ref: str, counter: str, delta: int) -> BlobMeta | None:
        assert counter in ("pins", "refs")
        with self._tx() as db:
            row = db.execute(f"SELECT {_META_COLS} FROM blobs WHERE tenant = ? AND ref = ?", (tenant, ref)).fetchone()
            if row is None:
                return None
            meta = _meta(tuple(row))
            value = getattr(meta, counter) + delta
            if value < 0:
                raise at_zero(ref, tenant, counter)
            db.execute(f"UPDATE blobs SET {counter} = ? WHERE tenant = ? AND ref = ?", (value, tenant, ref))
            return dataclasses.replace(meta, **{counter: value})

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
        windows (fleet/cas/sqlite_gc.py)."""
        return sqlite_gc.collect(lambda after: self._gc_window(after, now))

    def _gc_window(self, after: int, now: float) -> tuple[int, int] | None:
        """One window's transaction (sqlite_gc.delete_window), or None once the store is closed."""
        with self._lock:  # the same (reentrant) lock the transaction takes: close() cannot come between
            if self._closed:
                return None
            with self._tx() as db:
                return sqlite_gc.delete_window(db, after, now)

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

    def _kv_len(self, namespace: str) -> int:
        row = self._one("SELECT num_keys FROM kv_counts WHERE namespace = ?", (namespace,))
        return int(row[0]) if row is not None else 0

    def _kv_put_bounded(self, namespace: str, key: str, value: bytes, max_keys: int) -> bool:
        with self._tx() as db:  # IMMEDIATE: no other writer between the count and the insert
            if db.execute("SELECT 1 FROM kv WHERE namespace = ? AND key = ?", (namespace, key)).fetchone() is None:
                row = db.execute("SELECT num_keys FROM kv_counts WHERE namespace = ?", (namespace,)).fetchone()
                if (int(row[0]) if row is not None else 0) >= max_keys:
                    return False
            db.execute("INSERT OR REPLACE INTO kv (namespace, key, value) VALUES (?, ?, ?)", (namespace, key, value))
        return True

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


def _meta(row: tuple[Any, ...]) -> BlobMeta:
    import json  # noqa: PLC0415

    ref, size, created, pins, refs, verdict, reasons, lease = row
    return BlobMeta(ref=str(ref), size=int(size), created=float(created), pins=int(pins),
                    refs=int(refs), verdict=str(verdict), reasons=tuple(json.loads(str(reasons))),
                    lease_expires=float(lease))
