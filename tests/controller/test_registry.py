"""The controller's persisted worker state keeps the bytes it has always written (a controller
restarted on an old store must read them), and the index's capacity read is exact."""

from __future__ import annotations

import json

import pytest

from controller.index import PrefixIndex
from controller.registry import EpochTable, WorkerRegistry, WorkerSpec
from controller.vllm.events import BlockStored
from fleet.core.rank_state import RankState

# what the controller wrote before the registry existed (json.dumps of the dataclass fields)
OLD_SPEC = (b'{"name": "w0", "url": "http://127.0.0.1:8000", "kv_events": "tcp://127.0.0.1:5557", '
            b'"replay": null, "model": "m", "dp_ranks": 2, "block_size": 16, "hash_algo": "sha256", '
            b'"hash_seed": null}')
OLD_EPOCH = (b'{"epoch": 7, "phase": "paused", "kv": "preserved", "serving": false, "seq": 41, '
             b'"epoch_seq": 30, "fence": "clear", "start_time": 1700000000.5, "version": "0.33.0"}')


class DictStore:
    def __init__(self) -> None:
        self.kv: dict[tuple[str, str], bytes] = {}

    def kv_put(self, namespace: str, key: str, value: bytes) -> None:
        self.kv[(namespace, key)] = value

    def kv_get(self, namespace: str, key: str) -> bytes | None:
        return self.kv.get((namespace, key))

    def kv_scan(self, namespace: str) -> dict[str, bytes]:
        return {k: v for (ns, k), v in self.kv.items() if ns == namespace}

    def kv_delete(self, namespace: str, key: str) -> None:
        self.kv.pop((namespace, key), None)


SPEC = WorkerSpec("w0", "http://127.0.0.1:8000", "tcp://127.0.0.1:5557", None, "m", dp_ranks=2, block_size=16,
                  hash_algo="sha256")
STATE = RankState(epoch=7, phase="paused", kv="preserved", serving=False, seq=41, epoch_seq=30, fence="clear",
                  start_time=1700000000.5, version="0.33.0")


def test_registry_writes_and_reads_the_old_bytes() -> None:
    store = DictStore()
    reg = WorkerRegistry(store)
    reg.put(SPEC)
    assert store.kv == {("workers", "w0"): OLD_SPEC}
    store.kv[("workers", "w1")] = OLD_SPEC.replace(b'"w0"', b'"w1"')
    assert [(n, reg.decode(raw)) for n, raw in reg.entries()] == [
        ("w0", SPEC), ("w1", WorkerSpec(**{**json.loads(OLD_SPEC), "name": "w1"}))]
    reg.delete("w0")
    assert list(store.kv) == [("workers", "w1")]


def test_epoch_table_writes_and_reads_the_old_bytes() -> None:
    store = DictStore()
    table = EpochTable(store)
    table.put("w0", 1, STATE)
    assert store.kv == {("epochs", "w0/1"): OLD_EPOCH}
    store.kv[("epochs", "w0/0")] = OLD_EPOCH
    assert table.get("w0", 0) == STATE
    assert table.get("w0", 5) is None and table.get("w9", 0) is None
    store.kv[("epochs", "w0/0")] = b""  # an empty record reads as none, as before
    assert table.get("w0", 0) is None
    store.kv[("epochs", "w0/0")] = b"{not json"
    with pytest.raises(ValueError):
        table.get("w0", 0)


def test_a_registration_continues_the_persisted_epochs() -> None:
    store = DictStore()
    table = EpochTable(store)
    table.put("w0", 0, STATE)  # rank 1 was never written
    ranks = table.next_epochs(SPEC)
    assert ranks == {0: RankState(epoch=8), 1: RankState(epoch=0)}
    assert [table.get("w0", r) for r in (0, 1)] == [RankState(epoch=8), RankState(epoch=0)]


def _stored(hashes: tuple[int, ...], medium: str | None = "GPU", group: int | None = 0) -> BlockStored:
    return BlockStored(hashes, None, (1,) * 16 * len(hashes), 16, medium=medium, group_idx=group)


def test_held_and_new_counts_every_gpu_group_and_only_new_hashes() -> None:
    idx = PrefixIndex()
    key = ("w0", 0)
    assert idx.held_and_new(key, _stored((1, 2, 2))) == (0, 2)
    idx.apply(key, _stored((1, 2)))
    idx.apply(key, _stored((9,), group=1))  # another GPU group: occupies the same pool
    idx.apply(key, _stored((5, 6, 7), medium="CPU"))
    assert idx.held_and_new(key, _stored((2, 3))) == (3, 1)
    assert idx.held_and_new(key, _stored((7, 8), medium="cpu")) == (3, 1)  # a CPU store: its own tier
    assert list(idx.keys()) == [key]  # a read creates no rank
    assert idx.held_and_new(("w1", 0), _stored((1,))) == (0, 1) and list(idx.keys()) == [key]
