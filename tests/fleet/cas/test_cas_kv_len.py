"""kv_len and kv_put_bounded, on SQLite and a real redis-server (`url`: once per backend): the count a tenant's
cached verdicts are bounded by (fleet/core/quarantine/cache.py)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from fleet.cas import open_store
from fleet.core.errors import InvalidArgument


def test_kv_len_counts_every_write_path(url: str) -> None:
    """Inserts count once, a replacement (kv_put, kv_swap) not again, every delete path (kv_delete, kv_delete_many,
    kv_swap to None) gives one back, and each namespace counts its own keys."""
    store = open_store(url)
    try:
        assert store.kv_len("ns") == 0
        for i in range(5):
            store.kv_put("ns", f"k{i}", b"v")
        store.kv_put("ns", "k0", b"again")  # a replacement
        assert store.kv_swap("ns", "k1", b"v", b"swapped") and store.kv_swap("ns", "k9", None, b"new")
        store.kv_put("other", "k0", b"v")
        assert (store.kv_len("ns"), store.kv_len("other")) == (6, 1)
        store.kv_delete("ns", "k0")
        store.kv_delete("ns", "absent")
        store.kv_delete_many("ns", ["k2", "k3", "absent"])
        assert store.kv_swap("ns", "k9", b"new", None)
        assert (store.kv_len("ns"), store.kv_len("other")) == (2, 1)
        assert store.kv_len("ns") == len(store.kv_scan("ns"))
        store.kv_delete_many("ns", ["k1", "k4"])
        assert store.kv_len("ns") == 0 and store.kv_len("never") == 0
    finally:
        store.close()


def test_kv_put_bounded_adds_no_key_past_the_bound_and_replaces_any(url: str) -> None:
    store = open_store(url)
    try:
        assert [store.kv_put_bounded("ns", f"k{i}", b"v", 3) for i in range(5)] == [True, True, True, False, False]
        assert sorted(store.kv_scan("ns")) == ["k0", "k1", "k2"] and store.kv_len("ns") == 3
        assert store.kv_put_bounded("ns", "k1", b"replaced", 3)  # a key it holds: written at the bound
        assert store.kv_get("ns", "k1") == b"replaced" and store.kv_len("ns") == 3
        assert store.kv_put_bounded("other", "k3", b"v", 3)  # the bound is the namespace's own
        store.kv_delete("ns", "k0")
        assert store.kv_put_bounded("ns", "k3", b"v", 3) and not store.kv_put_bounded("ns", "k4", b"v", 3)
        assert not store.kv_put_bounded("ns", "k5", b"v", 0)
        for bad in (-1, True, 1.5, "3"):
            with pytest.raises(InvalidArgument, match="invalid max_keys"):
                store.kv_put_bounded("ns", "k9", b"v", bad)  # type: ignore[arg-type]
        assert store.kv_len("ns") == 3
    finally:
        store.close()


def test_concurrent_bounded_puts_from_other_connections_never_overshoot(url: str) -> None:
    """Eight writers on their own connections each put 25 new keys against a bound of 50: exactly 50 are written."""
    stores = [open_store(url) for _ in range(8)]
    start = threading.Barrier(len(stores))
    wrote: list[bool] = []

    def work(k: int) -> None:
        start.wait()
        wrote.extend(stores[k].kv_put_bounded("race", f"w{k}/{i}", b"v", 50) for i in range(25))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(stores))]
    [t.start() for t in threads], [t.join() for t in threads]
    try:
        assert (sum(wrote), stores[0].kv_len("race"), len(stores[0].kv_scan("race"))) == (50, 50, 50)
    finally:
        for s in stores:
            s.close()


def test_sqlite_file_from_before_the_key_count_is_counted_once(tmp_path: Path) -> None:
    """A file whose kv rows were written before kv_counts existed gets them counted when first opened, once; and an
    older release's INSERT OR REPLACE into a file that has the triggers counts a replacement not again."""
    from fleet.cas.sqlite_schema import SCHEMA

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA)
        db.executemany("INSERT INTO kv VALUES (?, ?, ?)", [("a", "k1", b""), ("a", "k2", b""), ("b", "k1", b"")])
    for _ in range(2):  # the second open must not count them again
        store = open_store(f"sqlite:///{path}")
        assert (store.kv_len("a"), store.kv_len("b"), store.kv_len("c")) == (2, 1, 0)
        store.close()
    with sqlite3.connect(path) as db:  # what an older release writes
        db.execute("INSERT OR REPLACE INTO kv VALUES ('a', 'k1', x'01')")
        db.execute("INSERT OR REPLACE INTO kv VALUES ('a', 'k3', x'01')")
        db.execute("DELETE FROM kv WHERE namespace = 'b'")
    store = open_store(f"sqlite:///{path}")
    assert (store.kv_len("a"), store.kv_len("b")) == (3, 0)
    store.close()
