"""Runs the BlobStore contract (tests/support/blob_store_contract.py) against SQLite and a real redis-server."""

from __future__ import annotations

import hashlib
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # tests/ (appended: tests/fleet must not shadow fleet)
pytest.register_assert_rewrite("support.blob_store_contract")

from support.blob_store_contract import *  # noqa: E402,F401,F403 - the contract's test functions
from support.blob_store_contract import StoreEnv  # noqa: E402


def _sqlite_footprint(path: str) -> object:
    with sqlite3.connect(path) as db:
        dump = {t: sorted(map(repr, db.execute(f"SELECT * FROM {t}").fetchall())) for t in ("blobs", "kv", "oplog", "tenant_bytes")}
    return dump


def _redis_footprint(url: str) -> object:
    import redis

    r = redis.Redis.from_url(url)
    out: dict[bytes, object] = {}
    for key in r.scan_iter(count=1000):
        kind = r.type(key)
        if kind == b"string":
            out[key] = hashlib.sha256(r.get(key)).hexdigest()
        elif kind == b"hash":
            out[key] = sorted(r.hgetall(key).items())
        elif kind == b"list":
            out[key] = r.lrange(key, 0, -1)
        else:
            out[key] = kind
    r.close()
    return out


@pytest.fixture(params=["sqlite", "redis"])
def store_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreEnv]:
    if request.param == "sqlite":
        path = str(tmp_path / "kvfleet.db")
        env = StoreEnv("sqlite", f"sqlite:///{path}", lambda: _sqlite_footprint(path),
                       crash=lambda: None, restart=lambda: None, has_server=False)
    else:
        url = request.getfixturevalue("redis_url")
        srv = request.getfixturevalue("redis_server")
        env = StoreEnv("redis", url, lambda: _redis_footprint(url), crash=srv.kill, restart=srv.start, has_server=True)
    yield env
    for s in env.opened:
        s.close()


def test_sqlite_file_from_before_the_byte_count_is_counted_once(tmp_path: Path) -> None:
    """A database written before tenant_bytes existed gets its blobs counted when first opened, once."""
    from fleet.cas import open_store
    from fleet.cas.sqlite_schema import SCHEMA

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA)
        for tenant, data in (("acme", b"a" * 700), ("acme", b"b" * 300), ("beta", b"c" * 50)):
            db.execute("INSERT INTO blobs (tenant, ref, data, size, created, verdict, lease_expires) "
                       "VALUES (?, ?, ?, ?, 0, 'UNKNOWN', 0)",
                       (tenant, hashlib.sha256(data).hexdigest(), data, len(data)))
    for _ in range(2):  # the second open must not count them again
        store = open_store(f"sqlite:///{path}")
        assert (store.stored_bytes("acme"), store.stored_bytes("beta"), store.stored_bytes("none")) == (1000, 50, 0)
        store.close()
