"""Fail-closed, lifecycle-aware routing over vLLM workers (DESIGN §9, reference §6).

A WARM verdict needs both: the (worker, dp_rank) is serving (not asleep, not paused, healthy),
and the request's leading blocks are resident on its GPU tier under the current epoch. Every
decision carries the epoch it was computed under. The worker registry and each rank's epoch and
last seq live in the store, so a new Router on the same store knows every worker, trusts no
warmth and rebuilds its index by replay from the persisted seq.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp
import zmq.asyncio

from controller.index import PrefixIndex
from controller.metrics import Metrics
from controller.vllm.hashing import ALGOS, external_chain
from controller.vllm.watcher import Worker
from fleet import lifecycle as lc
from fleet.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from fleet.lifecycle import RankState, Witness

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HTTP = re.compile(r"^https?://[^/\s:]+(:\d{1,5})?/?$")
_ZMQ = re.compile(r"^(tcp://[^\s:]+:\d{1,5}|ipc://\S+|inproc://\S+)$")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    reconcile_interval_s: float = 0.5
    probe_on_route: bool = False
    http_timeout_s: float = 2.0
    replay_timeout_s: float = 1.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A vLLM worker as registered: HTTP URL, KV-event PUB and replay endpoints, hash settings."""

    name: str
    url: str
    kv_events: str
    replay: str | None
    model: str
    dp_ranks: int = 1
    block_size: int | None = None
    hash_algo: str = "sha256"
    hash_seed: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise InvalidArgument(f"worker name {self.name!r} must match {_NAME.pattern}")
        if not isinstance(self.url, str) or not _HTTP.match(self.url):
            raise InvalidArgument(f"worker url {self.url!r} must look like http://host:port")
        if not isinstance(self.kv_events, str) or not _ZMQ.match(self.kv_events):
            raise InvalidArgument(f"kv_events {self.kv_events!r} must be a ZMQ endpoint like tcp://host:5557")
        if self.replay is not None and self.replay != "" and not _ZMQ.match(str(self.replay)):
            raise InvalidArgument(f"replay {self.replay!r} must be a ZMQ endpoint like tcp://host:5558, or empty")
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument("worker model must be a non-empty string (the served model name)")
        if not isinstance(self.dp_ranks, int) or not 1 <= self.dp_ranks <= 256:
            raise InvalidArgument(f"dp_ranks must be 1..256, got {self.dp_ranks!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size <= 0):
            raise InvalidArgument(f"block_size must be a positive int or None, got {self.block_size!r}")
        if self.hash_algo not in ALGOS:
            raise InvalidArgument(f"hash_algo must be one of {', '.join(ALGOS)} (xxhash cannot be recomputed)")
        if self.replay == "":
            object.__setattr__(self, "replay", None)


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    name: str
    url: str
    model: str
    dp_rank: int
    phase: str
    kv: str
    serving: bool
    warm: bool
    epoch: int
    last_seq: int
    num_blocks: int
    load: float
    kv_usage: float
    fence: str
    spec: WorkerSpec


class Candidate(NamedTuple):
    worker: str
    dp_rank: int
    matched_tokens: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker: str
    url: str
    dp_rank: int
    verdict: str
    matched_tokens: int
    epoch: int
    candidates: tuple[Candidate, ...]


class Router:
    """The domain object the gRPC servicers call. Single event loop; no threads."""

    def __init__(self, store: Any, metrics: Metrics | None = None, config: RouterConfig | None = None) -> None:
        self.store, self.metrics, self.cfg = store, metrics or Metrics(), config or RouterConfig()
        self.index = PrefixIndex()
        self._workers: dict[str, Worker] = {}
        self._session: aiohttp.ClientSession | None = None
        self._zctx: zmq.asyncio.Context | None = None
        self._routed = self._matched = 0

    async def start(self) -> None:
        """Open clients and resume every worker the store knows (cold, rebuilt by replay)."""
        self._session = aiohttp.ClientSession()
        self._zctx = zmq.asyncio.Context()
        for name, raw in sorted(self.store.kv_scan("workers").items()):
            spec = WorkerSpec(**json.loads(raw))
            ranks = {}
            for r in range(spec.dp_ranks):
                saved = self.store.kv_get("epochs", f"{name}/{r}")
                st = RankState.from_json(json.loads(saved)) if saved else RankState()
                ranks[r] = dataclasses.replace(st, serving=False)  # trust nothing until seen
            await self._launch(spec, ranks, catch_up=True)

    async def stop(self) -> None:
        for w in list(self._workers.values()):
            await w.stop()
        self._workers.clear()
        if self._session is not None:
            await self._session.close()
        if self._zctx is not None:
            self._zctx.term()

    async def _launch(self, spec: WorkerSpec, ranks: dict[int, RankState] | None, *, catch_up: bool) -> Worker:
        assert self._session is not None and self._zctx is not None, "Router.start() first"
        w = Worker(spec, store=self.store, metrics=self.metrics, index=self.index, cfg=self.cfg,
                   session=self._session, zctx=self._zctx, ranks=ranks)
        self._workers[spec.name] = w
        await w.start(catch_up=catch_up)
        return w

    async def register_worker(self, spec: WorkerSpec) -> WorkerStatus:
        """Validate, persist and start watching a worker; its warmth starts empty."""
        if not isinstance(spec, WorkerSpec):
            raise InvalidArgument("register_worker takes a WorkerSpec")
        if spec.name in self._workers:
            if self._workers[spec.name].spec == spec:
                return self._status(self._workers[spec.name], 0)
            raise AlreadyExists(f"worker {spec.name!r} is registered with another spec; unregister it first")
        self.store.kv_put("workers", spec.name, json.dumps(dataclasses.asdict(spec)).encode())
        ranks = {}
        for r in range(spec.dp_ranks):
            prior = self.store.kv_get("epochs", f"{spec.name}/{r}")  # epochs stay monotonic across re-registration
            epoch = RankState.from_json(json.loads(prior)).epoch + 1 if prior else 0
            ranks[r] = RankState(epoch=epoch)
            self.store.kv_put("epochs", f"{spec.name}/{r}", json.dumps(ranks[r].to_json()).encode())
        w = await self._launch(spec, ranks, catch_up=False)
        return self._status(w, 0)

    async def unregister_worker(self, name: str) -> None:
        w = self._get(name)
        await w.stop()
        del self._workers[name]
        self.index.drop_worker(name)
        self.store.kv_delete("workers", name)  # NOTE: its epochs stay, so a re-registration continues them

    def _get(self, name: str) -> Worker:
        w = self._workers.get(name)
        if w is None:
            raise NotFound(f"no worker named {name!r}; register it first (known: {', '.join(sorted(self._workers))})")
        return w

    async def lifecycle(self, name: str, verb: str, *, level: int | None = None, mode: str | None = None,
                        tags: list[str] | None = None, clear_cache: bool | None = None,
                        dp_rank: int | None = None) -> Witness:
        """Drive one lifecycle verb through the controller and return its witness.

        NOTE: vLLM's verbs act on the whole engine (every DP rank); `dp_rank` only selects which
        rank's epoch the witness reports.
        """
        w = self._get(name)
        call = lc.plan(verb, level=level, mode=mode, tags=tags, clear_cache=clear_cache)
        if dp_rank is not None and dp_rank not in w.ranks:
            raise InvalidArgument(f"dp_rank {dp_rank} out of range for {name} (0..{w.spec.dp_ranks - 1})")
        wit = await w.lifecycle(call)
        return dataclasses.replace(wit, epoch=w.ranks[dp_rank or 0].epoch)

    def workers(self) -> list[WorkerStatus]:
        return [self._status(w, r) for w in self._workers.values() for r in w.ranks]

    def worker(self, name: str) -> Worker:
        return self._get(name)

    def _status(self, w: Worker, r: int) -> WorkerStatus:
        st, key = w.ranks[r], (w.spec.name, r)
        return WorkerStatus(w.spec.name, w.spec.url, w.spec.model, r, st.phase, st.kv, st.serving,
                            w.warmable(r) and bool(self.index.resident(key)), st.epoch, st.seq,
                            self.index.num_blocks(key), w.load.running + w.load.waiting, w.load.kv_usage, st.fence,
                            w.spec)

    async def route(self, token_ids: Sequence[int], model: str, *, cache_salt: str | None = None,
                    lora: str | None = None, probe: bool | None = None) -> RouteDecision:
        """Pick the serving (worker, rank) holding the longest resident prefix; ties by load.

        Raises:
            InvalidArgument: bad token ids, model or salt.
            Unavailable: no serving worker for the model.
        """
        t0 = time.perf_counter()
        _check_route_args(token_ids, model, cache_salt, lora)
        ranked = self._rank(token_ids, model, cache_salt, lora)
        if probe if probe is not None else self.cfg.probe_on_route:
            if not ranked:  # nobody serving as far as we know: one fresh look at every worker
                await asyncio.gather(*(w.reconcile_once() for w in self._workers.values()))
                ranked = self._rank(token_ids, model, cache_salt, lora)
            ranked = await self._probe(ranked, token_ids, model, cache_salt, lora)
        if not ranked:
            raise Unavailable(f"no serving worker for model {model!r}; every candidate is asleep, paused or down")
        blocks, _, name, r = ranked[0]
        w = self._workers[name]
        B = self._block_size(name)
        verdict = "WARM" if blocks > 0 else "COLD"
        self.metrics.route_total.labels(verdict).inc()
        self._routed += len(token_ids)
        self._matched += blocks * B
        if self._routed:
            self.metrics.hit_rate.set(self._matched / self._routed)
        cands = tuple(Candidate(n, rr, b * self._block_size(n)) for b, _, n, rr in ranked)
        self.metrics.route_latency.observe(time.perf_counter() - t0)
        return RouteDecision(name, w.spec.url, r, verdict, blocks * B, w.ranks[r].epoch, cands)

    def _block_size(self, name: str) -> int:
        cfg = self._workers[name].hash_cfg
        return cfg.block_size if cfg is not None else 0

    def _rank(self, token_ids: Sequence[int], model: str, salt: str | None,
              lora: str | None) -> list[tuple[int, tuple[float, float, int], str, int]]:
        chains: dict[Any, list[int]] = {}
        out = []
        head = repr(token_ids[:64]).encode()
        for name, w in self._workers.items():
            adapter = lora or (model if model in w.loras else None)
            if model != w.spec.model and model not in w.loras or (adapter and adapter not in w.loras):
                continue
            for r in w.ranks:
                if not w.ranks[r].serving or w.transitioning:
                    continue
                blocks = 0
                if w.warmable(r) and w.hash_cfg is not None:
                    ck = (w.hash_cfg, adapter, w.loras.get(adapter or ""))
                    if ck not in chains:
                        lk = (adapter, w.loras[adapter]) if adapter else None
                        chains[ck] = external_chain(w.hash_cfg, token_ids, lora=lk, cache_salt=salt)
                    blocks = self.index.match((name, r), chains[ck])
                # ties: load (running + waiting, KV usage), then a per-prefix spread so cold
                # sessions do not all land on one worker
                spread = zlib.crc32(head, zlib.crc32(name.encode()))
                out.append((blocks, (w.load.running + w.load.waiting, w.load.kv_usage, spread), name, r))
        out.sort(key=lambda c: (-c[0], c[1], c[2], c[3]))
        return out

    async def _probe(self, ranked: list[Any], token_ids: Sequence[int], model: str, salt: str | None,
                     lora: str | None) -> list[Any]:
        """Route-time probe of the chosen worker; on a bad answer, fail over to the next one."""
        tried: set[str] = set()
        while ranked:
            _, _, name, r = ranked[0]
            if name in tried:
                return ranked  # probed during this call and still the best choice
            tried.add(name)
            w = self._workers[name]
            epoch = w.ranks[r].epoch
            if await w.probe() and w.ranks[r].epoch == epoch:
                return ranked
            self.metrics.stale_route_guard.labels("probe").inc()
            ranked = self._rank(token_ids, model, salt, lora)
        return ranked


def _check_route_args(token_ids: Sequence[int], model: str, salt: str | None, lora: str | None) -> None:
    if not isinstance(model, str) or not model:
        raise InvalidArgument("route needs a model name")
    if not isinstance(token_ids, list | tuple) or not set(map(type, token_ids)) <= {int} \
            or (token_ids and min(token_ids) < 0):
        raise InvalidArgument("token_ids must be a list of non-negative ints")
    if salt is not None and not isinstance(salt, str):
        raise InvalidArgument("cache_salt must be a string")
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise InvalidArgument("lora must be a non-empty adapter name")
