"""The SQLite store's tables, and what opening a file written by an older release adds to it.

Tables (every blob row is keyed by (tenant, ref), so tenants never see each other's rows):

    blobs(id, tenant, ref, data, size, created, pins, refs, verdict, reasons, lease_expires, charge)
    tenant_bytes(tenant, num_bytes)   the sum of blobs.charge per tenant, kept by triggers on blobs
    kv(namespace, key, value)
    kv_counts(namespace, num_keys)    the keys of each kv namespace, kept by triggers on kv (BlobStore.kv_len)
    oplog(tenant, session_id, idx, op)

A blob's charge is what it counts against its tenant's quota: size + PER_BLOB_OVERHEAD, recorded in
its row so that deleting it gives back exactly what inserting it counted. A row from before the
column (charge NULL) counted, and gives back, its size alone.

Named references have their own table (fleet/cas/sqlite_holders.py).
"""

from __future__ import annotations

import sqlite3

SCHEMA = """
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

# Keys per kv namespace (kv_len, kv_put_bounded), kept by triggers so every write path counts. The insert is counted
# BEFORE it, only for a key not there yet: INSERT OR REPLACE deletes the old row without firing delete triggers
# (recursive_triggers is off), so counting after every insert counted each replacement once more. A failed insert
# takes its trigger's change back with it (statement atomicity).
_KV_COUNT_DDL = (
    "CREATE TABLE IF NOT EXISTS kv_counts (namespace TEXT PRIMARY KEY, num_keys INTEGER NOT NULL)",
    """CREATE TRIGGER IF NOT EXISTS kv_count_in BEFORE INSERT ON kv
        WHEN NOT EXISTS (SELECT 1 FROM kv WHERE namespace = NEW.namespace AND key = NEW.key) BEGIN
        INSERT INTO kv_counts (namespace, num_keys) VALUES (NEW.namespace, 1)
            ON CONFLICT (namespace) DO UPDATE SET num_keys = num_keys + 1;
    END""",
    """CREATE TRIGGER IF NOT EXISTS kv_count_out AFTER DELETE ON kv BEGIN
        UPDATE kv_counts SET num_keys = num_keys - 1 WHERE namespace = OLD.namespace;
        DELETE FROM kv_counts WHERE namespace = OLD.namespace AND num_keys <= 0;
    END""",
)


def migrate(db: sqlite3.Connection) -> None:
    """Bring a file up to SCHEMA inside the caller's transaction: the charge column, the byte-count and key-count
    triggers, and the counts of what a file from before tenant_bytes or kv_counts already holds (once: the caller
    holds the only writer)."""
    fresh = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'tenant_bytes'").fetchone() is None
    if not any(col[1] == "charge" for col in db.execute("PRAGMA table_info(blobs)")):
        db.execute("ALTER TABLE blobs ADD COLUMN charge INTEGER")  # a file from before charges: rows NULL
    for stmt in _USAGE_DDL:
        db.execute(stmt)
    if fresh:  # a file from before the table: count the blobs it already holds
        db.execute(f"INSERT INTO tenant_bytes SELECT tenant, SUM({_CHARGE.format(row='blobs')}) "
                   "FROM blobs GROUP BY tenant")
    uncounted = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'kv_counts'").fetchone() is None
    for stmt in _KV_COUNT_DDL:
        db.execute(stmt)
    if uncounted:  # a file from before the count: count the keys it already holds (once, as above)
        db.execute("INSERT INTO kv_counts SELECT namespace, COUNT(*) FROM kv GROUP BY namespace")


def tenant_bytes(db: sqlite3.Connection, tenant: str) -> int:
    """The bytes `tenant` has stored, as the triggers count them (BlobStore.stored_bytes)."""
    row = db.execute("SELECT num_bytes FROM tenant_bytes WHERE tenant = ?", (tenant,)).fetchone()
    return int(row[0]) if row is not None else 0
