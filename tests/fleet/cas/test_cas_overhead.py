"""A stored blob counts its size plus a per-blob overhead against its tenant's quota, in both backends.

Tiny blobs cost a backend far more than their bytes (keys, metadata, the count: ~479 bytes a blob in
Redis beside 4 payload bytes), so a quota of payload bytes alone let a tenant store ~120x its quota
in Redis memory. These tests run against SQLite and a real redis-server; none measures time.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.cas import BlobStore, open_store
from fleet.core.errors import ResourceExhausted

REDIS_COST_PER_BLOB = 479  # Redis used_memory per 4-byte blob beyond its payload (audit: 4,000 pinned blobs)
LATER = 10_000.0  # a GC time past every lease in these tests


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now



@pytest.fixture
def store(url: str) -> Iterator[BlobStore]:
    s = open_store(url, clock=Clock(), lease_s=10.0)
    yield s
    s.close()


def _tiny(i: int) -> bytes:
    return i.to_bytes(4, "big")


def _fill(store: BlobStore, blob: object, quota: int, cap: int) -> list[str]:
    """Put distinct blobs (blob(i)) under `quota` until one is refused, or `cap` were stored."""
    refs: list[str] = []
    for i in range(cap):
        try:
            refs.append(store.put(blob(i), "acme", quota=quota))  # type: ignore[operator]
        except ResourceExhausted as e:
            assert "--max-blob-bytes-per-tenant" in str(e)
            break
    return refs


def test_a_tiny_blob_counts_at_least_what_it_costs_redis(store: BlobStore) -> None:
    store.put(_tiny(0), "acme")
    charge = store.stored_bytes("acme")
    print(f"a 4-byte blob counts {charge} bytes against the quota")
    assert charge >= 4 + REDIS_COST_PER_BLOB, f"a 4-byte blob counts {charge} bytes; Redis spends ~{4 + REDIS_COST_PER_BLOB}"
    from fleet.cas import PER_BLOB_OVERHEAD, blob_charge  # noqa: PLC0415 - the rest of the module runs on older code

    assert charge == blob_charge(4) == 4 + PER_BLOB_OVERHEAD


def test_quota_of_q_bytes_holds_q_over_size_plus_overhead_tiny_blobs(store: BlobStore) -> None:
    quota = 64 << 10
    refs = _fill(store, _tiny, quota, cap=1000)  # payload alone would let 16,384 in
    charge = store.stored_bytes("acme") // max(len(refs), 1)
    print(f"quota {quota}: {len(refs)} 4-byte blobs stored, {store.stored_bytes('acme')} bytes counted")
    assert len(refs) <= quota // (4 + REDIS_COST_PER_BLOB), f"{len(refs)} tiny blobs under a {quota}-byte quota"
    assert len(refs) == quota // charge and store.stored_bytes("acme") == len(refs) * charge <= quota
    for ref in refs:
        store.pin(ref, "acme")
    assert store.gc(now=LATER) == 0 and store.stored_bytes("acme") == len(refs) * charge  # pinned: kept
    for ref in refs:
        store.unpin(ref, "acme")
    assert store.gc(now=LATER) == len(refs)
    assert store.stored_bytes("acme") == 0
    assert len(_fill(store, _tiny, quota, cap=1000)) == len(refs)  # all the room is back


def test_control_normal_size_blobs_barely_notice_the_overhead(store: BlobStore) -> None:
    size, quota = 64 << 10, 4 << 20
    refs = _fill(store, lambda i: bytes([i]) * size, quota, cap=100)
    print(f"quota {quota}: {len(refs)} blobs of {size} bytes (payload alone: {quota // size})")
    assert quota // size - 1 <= len(refs) <= quota // size  # 63 of 64 (payload alone: 64): under 2% here
    assert len(refs) * size <= store.stored_bytes("acme") <= quota
    assert store.gc(now=LATER) == len(refs) and store.stored_bytes("acme") == 0


def test_every_put_path_then_gc_returns_usage_exactly(store: BlobStore) -> None:
    """put, put_stream, put_many, a dedup re-put (free) and a large blob (Redis' pre-check path) each
    count on the way in; GC gives back exactly that, leaving another pinned blob's count as it was."""
    kept = store.put(b"kept", "acme")
    store.pin(kept, "acme")
    base = store.stored_bytes("acme")
    refs = [store.put(b"", "acme")]
    overhead = store.stored_bytes("acme") - base  # what a blob counts beside its bytes
    big = bytes(range(256)) * 1200  # 300 KiB: past the Redis dedup pre-check size
    refs += [store.put(b"x", "acme", quota=1 << 30), store.put(big, "acme"),
             store.put_stream([b"ab", b"cd"], "acme", quota=1 << 30), *store.put_many([b"m1", b"m22", big], "acme")]
    assert store.put(b"x", "acme") == refs[1]  # re-put: costs nothing
    sizes = {ref: store.stat(ref, "acme").size for ref in refs}  # 6 distinct blobs (big twice)
    assert len(sizes) == 6 and overhead >= REDIS_COST_PER_BLOB
    assert store.stored_bytes("acme") - base == sum(sizes.values()) + len(sizes) * overhead
    assert store.gc(now=LATER) == len(sizes)
    assert store.stored_bytes("acme") == base
    store.unpin(kept, "acme")
    assert store.gc(now=LATER) == 1 and store.stored_bytes("acme") == 0


def test_redis_blob_stored_before_charges_gives_back_its_size_alone(redis_url: str) -> None:
    """A blob put by the code before per-blob charges (metadata without `charge`, counted by size)
    gives back its size alone when collected; the count of the blobs stored since stays exact."""
    store = open_store(redis_url, clock=Clock(), lease_s=10.0)
    r = redis.Redis.from_url(redis_url)
    old = store.put(b"from before", "acme")
    charge = store.stored_bytes("acme")
    r.hdel(f"kvf:t:acme:m:{old}", "charge")  # as the old put script left it ...
    r.set("kvf:t:acme:bytes", len(b"from before"))  # ... and counted it
    new = store.put(b"since", "acme")
    store.pin(new, "acme")
    assert store.gc(now=LATER) == 1
    assert store.stored_bytes("acme") == charge - len(b"from before") + len(b"since")
    store.unpin(new, "acme")
    assert store.gc(now=LATER) == 1 and store.stored_bytes("acme") == 0 and r.dbsize() == 0
    store.close()


def test_redis_gc_takes_blobs_in_batches_and_skips_damaged_ones(redis_url: str) -> None:
    """Several hundred blobs, some pinned, one with damaged metadata: one script call per batch, each
    blob judged on its own as before."""
    store = open_store(redis_url, clock=Clock(), lease_s=10.0)
    r = redis.Redis.from_url(redis_url)
    refs = store.put_many([_tiny(i) for i in range(700)], "acme") + store.put_many([b"b"], "beta")
    for ref in refs[:100]:
        store.pin(ref, "acme")
    r.hdel(f"kvf:t:acme:m:{refs[400]}", "lease_expires")  # damaged: kept, never deleted blind
    charge = store.stored_bytes("acme") // 700
    r.config_resetstat()
    assert store.gc(now=LATER) == 600
    calls = int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    print(f"GC of 701 blobs: {calls} EVALSHA calls")
    assert calls <= 8  # batches of blobs (one a blob before: 701)
    assert all(r.exists(f"kvf:t:acme:b:{ref}") for ref in (*refs[:100], refs[400]))
    assert not any(r.exists(f"kvf:t:acme:b:{ref}") for ref in refs[100:400] + refs[401:])
    assert store.stored_bytes("acme") == 101 * charge and store.stored_bytes("beta") == 0
    store.close()


_OLD_SQLITE_DDL = """
CREATE TABLE blobs (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL, ref TEXT NOT NULL, data BLOB NOT NULL, size INTEGER NOT NULL,
    created REAL NOT NULL, pins INTEGER NOT NULL DEFAULT 0, refs INTEGER NOT NULL DEFAULT 0,
    verdict TEXT NOT NULL, reasons TEXT NOT NULL DEFAULT '[]', lease_expires REAL NOT NULL,
    UNIQUE (tenant, ref)
);
CREATE TABLE tenant_bytes (tenant TEXT PRIMARY KEY, num_bytes INTEGER NOT NULL);
CREATE TRIGGER blobs_count_in AFTER INSERT ON blobs BEGIN
    INSERT INTO tenant_bytes (tenant, num_bytes) VALUES (NEW.tenant, NEW.size)
        ON CONFLICT (tenant) DO UPDATE SET num_bytes = num_bytes + NEW.size;
END;
CREATE TRIGGER blobs_count_out AFTER DELETE ON blobs BEGIN
    UPDATE tenant_bytes SET num_bytes = num_bytes - OLD.size WHERE tenant = OLD.tenant;
    DELETE FROM tenant_bytes WHERE tenant = OLD.tenant AND num_bytes <= 0;
END;
"""


def test_sqlite_file_from_before_charges_keeps_an_exact_count(tmp_path: Path) -> None:
    """A file written by the code before per-blob charges (no charge column, size-counting triggers):
    its rows keep counting their size, blobs stored since count their charge, and collecting both
    brings the count to exactly 0."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(_OLD_SQLITE_DDL)
        db.execute("INSERT INTO blobs (tenant, ref, data, size, created, verdict, lease_expires) "
                   "VALUES ('acme', ?, ?, 700, 0, 'UNKNOWN', 0)", ("a" * 64, b"a" * 700))
    for _ in range(2):  # opening again changes nothing
        store = open_store(f"sqlite:///{path}", clock=Clock(), lease_s=10.0)
        assert store.stored_bytes("acme") == 700
        store.close()
    store = open_store(f"sqlite:///{path}", clock=Clock(), lease_s=10.0)
    store.put(b"since", "acme")
    charge = store.stored_bytes("acme") - 700
    assert charge >= len(b"since") + REDIS_COST_PER_BLOB
    assert store.gc(now=LATER) == 2 and store.stored_bytes("acme") == 0
    store.close()
