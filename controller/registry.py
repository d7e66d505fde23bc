"""The controller's persisted worker state: one owner per store namespace.

    namespace  key              value (JSON, as written since the first release)   owner
    workers    <worker>         WorkerSpec fields                                  WorkerRegistry
    epochs     <worker>/<rank>  RankState fields (fleet/core/rank_state.py)             EpochTable

Nothing else names these namespaces. Both classes are thin and synchronous: they run wherever
their caller runs. The router calls them off the event loop (Router start, registration,
unregistration); the watcher writes epochs from the loop itself, because its writes come from
synchronous stream callbacks whose order the store must keep (see Worker.persist).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Protocol

from fleet.core.block_hash import ALGOS
from fleet.core.errors import InvalidArgument
from fleet.core.rank_state import RankState

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HTTP = re.compile(r"^https?://[^/\s:]+(:\d{1,5})?/?$")
_ZMQ = re.compile(r"^(tcp://[^\s:]+:\d{1,5}|ipc://\S+|inproc://\S+)$")


class KvStore(Protocol):
    """The store's small key-value surface (fleet.cas.BlobStore implements it)."""

    def kv_put(self, namespace: str, key: str, value: bytes) -> None: ...

    def kv_get(self, namespace: str, key: str) -> bytes | None: ...

    def kv_scan(self, namespace: str) -> dict[str, bytes]: ...

    def kv_delete(self, namespace: str, key: str) -> None: ...


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A vLLM worker as registered: HTTP URL, KV-event PUB and replay endpoints, hash settings.

    `hash_algo` None means "read it from the worker" (/server_info, else vllm:cache_config_info);
    registration stores the algorithm it found, and refuses a spec the worker contradicts.

    Its DP ranks are the global ranks `dp_rank_start .. dp_rank_start + dp_ranks - 1` (`dp_rank_ids`): 0..dp_ranks-1
    for a server that runs every rank, one rank (vLLM's --data-parallel-rank) or a node's ranks
    (--data-parallel-start-rank, --data-parallel-size-local) for a server behind an external or hybrid load
    balancer. vLLM binds global rank r's PUB and replay at the configured port + r, and every batch and /metrics
    series it sends carries r: `kv_events` and `replay` are the configured (rank 0's) endpoints.
    """

    name: str
    url: str
    kv_events: str
    replay: str | None
    model: str
    dp_ranks: int = 1
    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None
    dp_rank_start: int = 0

    @property
    def dp_rank_ids(self) -> range:
        """The global DP ranks this worker's API server serves."""
        return range(self.dp_rank_start, self.dp_rank_start + self.dp_ranks)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise InvalidArgument(f"worker name {self.name!r} must match {_NAME.pattern}")
        if not isinstance(self.url, str) or not _HTTP.match(self.url):
            raise InvalidArgument(f"worker url {self.url!r} must look like http://host:port")
        if not isinstance(self.kv_events, str) or not _ZMQ.match(self.kv_events):
            raise InvalidArgument(f"kv_events {self.kv_events!r} must be a ZMQ endpoint like tcp://host:5557")
        if self.replay is not None and self.replay != "" and not _ZMQ.match(str(self.replay)):
            raise InvalidArgument(
                f"replay {self.replay!r} must be a ZMQ endpoint like tcp://host:5558, or empty"
            )
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument("worker model must be a non-empty string (the served model name)")
        if not isinstance(self.dp_ranks, int) or not 1 <= self.dp_ranks <= 256:
            raise InvalidArgument(f"dp_ranks must be 1..256, got {self.dp_ranks!r}")
        if isinstance(self.dp_rank_start, bool) or not isinstance(self.dp_rank_start, int) or self.dp_rank_start < 0:
            raise InvalidArgument(f"dp_rank_start must be an int >= 0 (the first global DP rank the server runs: "
                                  f"vLLM's --data-parallel-rank or --data-parallel-start-rank), got {self.dp_rank_start!r}")
        self._check_rank_ports()
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size <= 0):
            raise InvalidArgument(f"block_size must be a positive int or None, got {self.block_size!r}")
        if self.hash_algo is not None and self.hash_algo not in ALGOS:
            raise InvalidArgument(
                f"hash_algo must be one of {', '.join(ALGOS)} (xxhash cannot be recomputed)"
            )
        if self.replay == "":
            object.__setattr__(self, "replay", None)

    def _check_rank_ports(self) -> None:
        """vLLM binds global rank r at the configured TCP port + r: the last rank's port must be a port."""
        last = self.dp_rank_start + self.dp_ranks - 1
        for what, ep in (("kv_events", self.kv_events), ("replay", self.replay)):
            if ep and ep.startswith("tcp://") and (port := int(ep.rsplit(":", 1)[1])) + last > 65535:
                raise InvalidArgument(
                    f"dp_rank_start {self.dp_rank_start} + dp_ranks {self.dp_ranks} overflow {what}'s port: vLLM binds "
                    f"rank {last} at {port} + {last} = {port + last}, past 65535")


class WorkerRegistry:
    """Registered worker specs (namespace "workers", key = worker name)."""

    NAMESPACE = "workers"

    def __init__(self, store: KvStore) -> None:
        self.store = store

    def entries(self) -> list[tuple[str, bytes]]:
        """Every stored record, by name; decode each with `decode` (one bad record is that worker's)."""
        return sorted(self.store.kv_scan(self.NAMESPACE).items())

    @staticmethod
    def decode(raw: bytes) -> WorkerSpec:
        return WorkerSpec(**json.loads(raw))

    def put(self, spec: WorkerSpec) -> None:
        """NOTE: dp_rank_start 0 is not written: a worker's record keeps the bytes it had before the field."""
        fields = dataclasses.asdict(spec)
        if not spec.dp_rank_start:
            del fields["dp_rank_start"]
        self.store.kv_put(self.NAMESPACE, spec.name, json.dumps(fields).encode())

    def delete(self, name: str) -> None:
        """Forget a worker. NOTE: its epochs stay, so a re-registration continues them."""
        self.store.kv_delete(self.NAMESPACE, name)


class EpochTable:
    """Each (worker, dp_rank)'s RankState (namespace "epochs", key "<worker>/<rank>", the global DP rank)."""

    NAMESPACE = "epochs"

    def __init__(self, store: KvStore) -> None:
        self.store = store

    def get(self, worker: str, rank: int) -> RankState | None:
        """The persisted state, None if none (or empty). Raises on a record that does not parse."""
        raw = self.store.kv_get(self.NAMESPACE, f"{worker}/{rank}")
        return RankState.from_json(json.loads(raw)) if raw else None

    def put(self, worker: str, rank: int, st: RankState) -> None:
        self.store.kv_put(self.NAMESPACE, f"{worker}/{rank}", json.dumps(st.to_json()).encode())

    def next_epochs(self, spec: WorkerSpec) -> dict[int, RankState]:
        """Fresh rank states for a (re-)registration, written back: epochs stay monotonic across it."""
        ranks = {}
        for r in spec.dp_rank_ids:
            prior = self.get(spec.name, r)
            ranks[r] = RankState(epoch=prior.epoch + 1 if prior is not None else 0)
            self.put(spec.name, r, ranks[r])
        return ranks
