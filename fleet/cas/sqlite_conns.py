"""The SQLite store's connections to its file, and why a file cannot be the store.

Writes go through one connection shared by threads behind a lock; reads go through a small pool of
read-only connections of their own (READERS), each read in one transaction, so a read sees a committed
snapshot and never waits behind a write: WAL lets readers and the writer run at once. Other processes may
open the same file (WAL + busy_timeout serialise the writers).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fleet.core.errors import InvalidArgument, KvfleetError, Unavailable

# Read-only connections for reads. NOTE: reads shared the writer's connection and lock, so a read waited for
# a large put's commit: stat() p99 558 ms beside three threads of 32 MiB puts (59 ms with the puts on another
# file). A read past READERS at once waits for a free connection, never for a write.
READERS = 4
# How long close() waits for the reads in flight to give their connections back, so that the writer closes last
# and checkpoints the WAL; past it the writer closes anyway (a slow read then leaves the WAL for the next open).
CLOSE_WAIT_S = 10.0


class SqliteConnections:
    """SqliteBlobStore's base: the writer behind its lock, the readers' pool, and close()."""

    def _open(self, path: str) -> None:
        """Connect the writer to `path` (its directory made first) and start an empty pool of readers."""
        self.path = path
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


def unusable(path: str, e: BaseException) -> KvfleetError:
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
