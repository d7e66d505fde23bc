"""Named blob references on SQLite (BlobStore.add_ref / drop_ref with a holder, held_refs): one row per (blob, holder)
in `blob_holders`, and the blob's `refs` moves only when a row was added or removed, in the same transaction, so a
call run twice (a reply lost, the call retried; a close cut off half-way and run again) counts once. `refs` also
counts references taken without a holder; GC reads `refs` alone."""

from __future__ import annotations

import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS blob_holders (
    tenant TEXT NOT NULL, ref TEXT NOT NULL, holder TEXT NOT NULL, PRIMARY KEY (tenant, ref, holder)
);
CREATE INDEX IF NOT EXISTS blob_holders_by_holder ON blob_holders (holder);
"""


def hold(db: sqlite3.Connection, tenant: str, ref: str, holder: str, delta: int) -> int | None:
    """`_hold_one` inside the caller's transaction (BlobStore._hold_one)."""
    row = db.execute("SELECT refs FROM blobs WHERE tenant = ? AND ref = ?", (tenant, ref)).fetchone()
    if row is None:
        if delta < 0:
            db.execute("DELETE FROM blob_holders WHERE tenant = ? AND ref = ? AND holder = ?", (tenant, ref, holder))
        return None
    if delta > 0:
        cur = db.execute("INSERT OR IGNORE INTO blob_holders VALUES (?, ?, ?)", (tenant, ref, holder))
    else:
        cur = db.execute("DELETE FROM blob_holders WHERE tenant = ? AND ref = ? AND holder = ?", (tenant, ref, holder))
    if cur.rowcount != 1:
        return int(row[0])
    db.execute("UPDATE blobs SET refs = refs + ? WHERE tenant = ? AND ref = ?", (delta, tenant, ref))
    return int(row[0]) + delta


def held(db: sqlite3.Connection, holder: str) -> list[tuple[str, str]]:
    return [(str(ref), str(tenant)) for tenant, ref in
            db.execute("SELECT tenant, ref FROM blob_holders WHERE holder = ?", (holder,)).fetchall()]
