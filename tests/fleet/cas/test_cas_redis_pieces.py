"""Large puts reach Redis in pieces (fleet/cas/redis_pieces.py), on a real redis-server.

Redis runs one command at a time and, with `appendfsync always`, writes and fsyncs each command's effects before
it serves another client: a put in one command made every other tenant wait for the whole blob's write. These
tests watch the commands Redis receives (MONITOR) and stop puts between two pieces; the store contract suite
(test_cas_contract.py) runs the rest of the contract against pieced blobs (its large blobs are several pieces).
"""

from __future__ import annotations

import hashlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from fleet.cas import blob_charge, open_store
from fleet.cas.base import BlobStore
from fleet.cas.quota import OverQuota
from fleet.cas.redis_pieces import PIECE_BYTES
from fleet.core.errors import NotFound, Unavailable

_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
SIZE = 3 * PIECE_BYTES + 5  # four pieces, the last one short


def _printable_blob(seed: int, size: int = SIZE) -> bytes:
    """Bytes MONITOR shows unescaped, so an argument's length in its output is its length in the command."""
    head = b"%016d" % seed
    return head + b"a" * (size - len(head))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _keys(r: redis.Redis) -> set[bytes]:
    return set(r.scan_iter(count=1000))


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def store(redis_url: str) -> Iterator[BlobStore]:
    with open_store(redis_url) as s:
        yield s


def _monitor(url: str, during: Callable[[], None]) -> list[list[bytes]]:
    """The commands (each a list of its arguments) Redis ran while `during()` ran, from a MONITOR connection."""
    mon_client, marker = redis.Redis.from_url(url), b"kvf-monitor-end"
    seen: list[list[bytes]] = []
    with mon_client.monitor() as m:
        during()
        redis.Redis.from_url(url).echo(marker)
        while True:
            line: bytes = m.connection.read_response()  # type: ignore[assignment]
            args = _ARG.findall(line)  # the blobs here are printable: nothing in them is escaped
            if args[0].lower() == b"echo" and args[1:] == [marker]:
                break
            seen.append(args)
    mon_client.close()
    return seen


def test_large_put_sends_no_command_larger_than_a_piece(store: BlobStore, redis_url: str) -> None:
    data = _printable_blob(1)
    commands = _monitor(redis_url, lambda: store.put(data, "acme"))
    sizes = [sum(map(len, c)) for c in commands]
    print(f"{len(commands)} commands for a {len(data)}-byte put; the largest carried {max(sizes)} bytes")
    assert max(sizes) <= PIECE_BYTES + 1024  # one piece and its command's key and arguments
    # control: the blob's bytes did go through those commands, piece after piece
    pieces = [c[2] for c in commands if c[0].lower() in (b"set", b"append")]  # the commands the scripts ran
    assert b"".join(pieces) == data and len(pieces) == 4
    assert store.get(store.put(data, "acme"), "acme") == data


def test_put_many_sends_large_blobs_in_pieces(store: BlobStore, redis_url: str) -> None:
    blobs = [_printable_blob(2), b"small", _printable_blob(3, PIECE_BYTES)]  # the last fits one command
    refs: list[str] = []
    commands = _monitor(redis_url, lambda: refs.extend(store.put_many(blobs, "acme")))
    assert max(sum(map(len, c)) for c in commands) <= PIECE_BYTES + 1024
    assert store.get_many(refs, "acme") == blobs
    assert store.stored_bytes("acme") == sum(blob_charge(len(b)) for b in blobs)


def _stop_at_piece(store: BlobStore, monkeypatch: pytest.MonkeyPatch, n: int,
                   action: Callable[[str], None]) -> None:
    """Run `action(stage key)` before piece number `n` (0-based) of every pieced put on `store`."""
    pieces = store._pieces  # type: ignore[attr-defined]
    original, count = pieces.append_piece, [0]

    def hooked(put: Any, ref: str, piece: memoryview, *, first: bool) -> None:
        count[0] = 0 if first else count[0] + 1
        if count[0] == n:
            action(put.stage)
        original(put, ref, piece, first=first)

    monkeypatch.setattr(pieces, "append_piece", hooked)


class Crash(Exception):
    pass


def _crash(stage: str) -> None:
    raise Crash(stage)


def test_put_that_fails_between_pieces_leaves_nothing(store: BlobStore, r: redis.Redis,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store.put(b"pre-existing", "acme")
    before, used = _keys(r), store.stored_bytes("acme")
    data = _printable_blob(4)
    _stop_at_piece(store, monkeypatch, 2, _crash)
    with pytest.raises(Crash):
        store.put(data, "acme")
    with pytest.raises(NotFound):
        store.stat(_sha(data), "acme")
    assert store.stored_bytes("acme") == used and _keys(r) == before  # nothing visible, charged or left
    monkeypatch.undo()
    assert store.get(store.put(data, "acme"), "acme") == data  # control: the same put, not stopped, stores it
    assert store.stored_bytes("acme") == used + blob_charge(len(data))


_DYING_CLIENT = """
import os, signal, sys
import fleet.cas.redis_pieces as rp
from fleet.cas import open_store
rp.STAGE_TTL_MS = 1000
store = open_store(sys.argv[1])
sent = [0]
original = store._pieces.append_piece
def dying(put, ref, piece, *, first):
    if sent[0] == 2:
        print(put.stage, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the process dies between two pieces
    sent[0] += 1
    original(put, ref, piece, first=first)
store._pieces.append_piece = dying
store.put(os.urandom(int(sys.argv[2])), "acme")
"""


def test_put_whose_process_dies_between_pieces_is_collected_by_ttl(redis_url: str, r: redis.Redis) -> None:
    with open_store(redis_url) as s:
        s.put(b"pre-existing", "acme")
    before, count = _keys(r), r.get("kvf:t:acme:bytes")
    proc = subprocess.run([sys.executable, "-c", _DYING_CLIENT, redis_url, str(SIZE)], capture_output=True,
                          timeout=60, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    stage = proc.stdout.decode().strip().encode()
    assert _keys(r) == before | {stage, b"kvf:t:acme:inflight"} and stage.startswith(b"kvf:t:acme:p:")  # no blob
    assert r.strlen(stage) == 2 * PIECE_BYTES and 0 < int(r.pttl(stage)) <= 1000  # type: ignore[arg-type]
    assert r.get("kvf:t:acme:bytes") == count  # nothing charged
    other, room = _printable_blob(11), int(count) + blob_charge(SIZE) + 100  # type: ignore[arg-type]
    with open_store(redis_url) as s, pytest.raises(OverQuota, match=f"and {blob_charge(SIZE)} more in puts in prog"):
        s.put(other, "acme", quota=room)   # the dead put's bytes still count while its pieces are held
    deadline = time.monotonic() + 10
    while r.exists(stage):  # Redis expires the dead put's pieces
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _keys(r) == before and r.get("kvf:t:acme:bytes") == count   # and its reservation with them
    with open_store(redis_url) as s:
        s.put(other, "acme", quota=room)   # control: the same put fits once they lapsed


def test_same_blob_committed_meanwhile_is_stored_once(store: BlobStore, r: redis.Redis,
                                                      monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    data, other = _printable_blob(5), open_store(redis_url)
    _stop_at_piece(store, monkeypatch, 1, lambda stage: other.put(data, "acme") and None)
    ref = store.put(data, "acme")  # another put of the same bytes commits between our pieces
    other.close()
    assert store.get(ref, "acme") == data and store.stored_bytes("acme") == blob_charge(len(data))
    assert _keys(r) == {f"kvf:t:acme:b:{ref}".encode(), f"kvf:t:acme:m:{ref}".encode(), b"kvf:t:acme:bytes"}


def test_quota_is_checked_again_at_commit(store: BlobStore, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
                                          redis_url: str) -> None:
    """A put no quota bounds (the store's own batch path) that takes the room between our pieces is caught at the
    commit. (A quota-bound put is refused at its begin beside ours: test_bytes_in_flight_count_against_the_quota.)"""
    a, b, other = _printable_blob(6), _printable_blob(7), open_store(redis_url)
    quota = blob_charge(len(a)) + 100  # room for one of the two
    _stop_at_piece(store, monkeypatch, 1, lambda stage: other.put_many([b], "acme") and None)
    with pytest.raises(OverQuota):  # the begin check passed; the other put took the room before our commit
        store.put(a, "acme", quota=quota)
    other.close()
    assert store.stored_bytes("acme") == blob_charge(len(b)) and not store.exists(_sha(a), "acme")
    assert not [k for k in _keys(r) if b":p:" in k]  # the refused put's pieces are gone


def test_bytes_in_flight_count_against_the_quota(store: BlobStore, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
                                                 redis_url: str) -> None:
    """While one large put is between its pieces, the tenant's other puts are admitted only beside its bytes.
    NOTE: before, each large put was checked against the stored bytes alone, so a tenant at its quota could stage
    any number of large blobs at once in the Redis every tenant shares, each refused only at its commit."""
    a, b, small, other = _printable_blob(12), _printable_blob(13), b"s" * 1000, open_store(redis_url)
    quota = blob_charge(len(a)) + blob_charge(len(small)) + 100    # room for a and the small blob, not for b
    outcomes: list[str] = []

    def meanwhile(stage: str) -> None:
        for blob in (b, small):
            try:
                other.put(blob, "acme", quota=quota)
                outcomes.append("stored")
            except OverQuota as e:
                outcomes.append(str(e))

    _stop_at_piece(store, monkeypatch, 2, meanwhile)
    assert store.put(a, "acme", quota=quota) == _sha(a)
    other.close()
    assert f"and {blob_charge(len(a))} more in puts in progress" in outcomes[0]   # b: refused at its begin
    assert outcomes[1] == "stored"                                              # control: the small one fits
    assert store.stored_bytes("acme") == blob_charge(len(a)) + blob_charge(len(small))
    assert not [k for k in _keys(r) if b":p:" in k or b"inflight" in k]       # no stage, no reservation left


def test_a_failed_put_gives_its_reservation_back_at_once(store: BlobStore, r: redis.Redis,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _printable_blob(14), _printable_blob(15)
    _stop_at_piece(store, monkeypatch, 1, _crash)
    with pytest.raises(Crash):
        store.put(a, "acme", quota=blob_charge(len(a)) + 100)
    monkeypatch.undo()
    assert store.put(b, "acme", quota=blob_charge(len(b)) + 100) == _sha(b)  # a's room is free again
    assert not [k for k in _keys(r) if b"inflight" in k]


@pytest.mark.parametrize("when", [1, 3])  # before a middle piece; before the last piece (caught at the commit)
def test_pieces_dropped_by_redis_mid_put_is_unavailable(store: BlobStore, r: redis.Redis,
                                                        monkeypatch: pytest.MonkeyPatch, when: int) -> None:
    _stop_at_piece(store, monkeypatch, when, lambda stage: r.delete(stage) and None)  # as if expired or evicted
    with pytest.raises(Unavailable, match="dropped the pieces of blob .* nothing was stored: put it again"):
        store.put(_printable_blob(8), "acme")
    assert _keys(r) == set() and store.stored_bytes("acme") == 0


def test_concurrent_puts_of_one_large_blob_store_it_once(store: BlobStore, r: redis.Redis) -> None:
    data = _printable_blob(9)
    refs: list[str] = []
    threads = [threading.Thread(target=lambda: refs.append(store.put(data, "acme", quota=blob_charge(len(data)))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(refs) == 4 and len(set(refs)) == 1
    assert store.stored_bytes("acme") == blob_charge(len(data)) and len(_keys(r)) == 3


def test_blob_stored_in_one_command_stays_readable_and_collectable(store: BlobStore, r: redis.Redis) -> None:
    """A large blob stored the old way (one script call with the whole blob) needs no migration."""
    data = _printable_blob(10)
    ref = _sha(data)
    keys = [f"kvf:t:acme:b:{ref}", f"kvf:t:acme:m:{ref}", "kvf:t:acme:bytes", "kvf:t:acme:inflight"]
    store._s_put(keys=keys, args=[data, len(data), "0", "1", "UNKNOWN", 0, blob_charge(len(data)), ref])  # type: ignore[attr-defined]
    assert store.get(ref, "acme") == data and b"".join(store.get_stream(ref, "acme", PIECE_BYTES)) == data
    store.pin(ref, "acme")
    store.set_verdict(ref, "acme", "CLEAN", [])
    assert store.gc(now=10.0) == 0 and store.stat(ref, "acme").verdict == "CLEAN"
    store.unpin(ref, "acme")
    assert store.put(data, "acme") == ref and store.stored_bytes("acme") == blob_charge(len(data))  # a re-put: free
    assert store.gc(now=time.time() + 10_000) == 1 and _keys(r) == set() and store.stored_bytes("acme") == 0


def _rewrite_aof(r: redis.Redis) -> None:
    """Rewrite the AOF now and wait for it. NOTE: the earlier tests' large writes can start an automatic rewrite,
    and BGREWRITEAOF beside a running one is an error (one run of the suite failed on it): wait for it first."""
    def rewriting() -> bool:
        p = r.info("persistence")
        return bool(int(p["aof_rewrite_in_progress"]) or int(p["aof_rewrite_scheduled"]))

    def wait() -> None:
        while rewriting():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    deadline = time.monotonic() + 10
    while True:
        wait()
        try:
            r.bgrewriteaof()
            break
        except redis.exceptions.ResponseError as e:   # one started between the look and the call
            assert "in progress" in str(e), e
    wait()


def test_pieced_blobs_survive_a_crash_and_an_aof_rewrite(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    """The AOF replays pieces, RENAME and PERSIST: after a SIGKILL the blobs are there, with no TTL left on them."""
    a, b = _printable_blob(11), _printable_blob(12)
    with open_store(redis_url) as s:
        ref_a = s.put(a, "acme")
    r = redis.Redis.from_url(redis_url)
    _rewrite_aof(r)  # a is in the rewritten AOF, b only in its tail
    with open_store(redis_url) as s:
        ref_b = s.put(b, "acme")
    r.close()
    redis_server.kill()
    redis_server.start()
    r = redis.Redis.from_url(redis_url)
    with open_store(redis_url) as s:
        assert s.get(ref_a, "acme") == a and s.get(ref_b, "acme") == b
        assert s.stored_bytes("acme") == blob_charge(len(a)) + blob_charge(len(b))
    assert [r.pttl(f"kvf:t:acme:b:{ref}") for ref in (ref_a, ref_b)] == [-1, -1]  # PERSIST replayed: no expiry
    assert len(_keys(r)) == 5  # two blobs' data and metadata, the byte count: no staging key
    r.close()
