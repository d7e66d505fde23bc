"""Offline model of the workers' caches: the trace replayed under each routing policy.

Each worker is the stand-in's own engine (`fleet.app.testkit.sim_vllm.engine.SimEngine`: vLLM's block
hashing, LRU eviction, sleep/wake hazards), so the model is the same code the live workers run.
A request sent to a sleeping worker hangs there until the client's timeout (counted), then the
policy routes it again without that worker — as the live demo does.

Policies (one `choose` method each):
    recorded   kvfleet's live choices, replayed: a fidelity check (must give the live numbers)
    greedy     "greedy, perfect knowledge": knows every worker's true cache and serving state and
               takes the longest true prefix per request (ties: fewest cached blocks). NOT an
               oracle: it knows no future, ignores load, and piles agents onto one worker
    sticky     session-sticky consistent hashing (the agent's name on a ring of workers), skipping
               sleeping workers: what a sticky-session load balancer does
    blind      a prefix-aware router that trusts its KV-event index and clears a worker only on
               AllBlocksCleared *as delivered* (vLLM queues it until the next engine step): no
               serving state, no epochs (what shipped routers do; fleet/app/testkit/baseline.py)
    round_robin  request i -> worker i mod N, each worker with its own prefix cache
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.index import PrefixIndex
from controller.vllm.events import decode_batch
from fleet.app.demo.trace import Lifecycle, Request, Trace
from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.engine import SimEngine
from fleet.core.block_hash import chain, external_chain


@dataclass(slots=True)
class PolicyResult:
    """Counts of one policy over the trace (every figure is tokens or routes; docs/demo.md)."""

    policy: str
    num_requests: int = 0
    total_tokens: int = 0
    reused_tokens: int = 0
    warm_routes: int = 0
    stale_warm_routes: int = 0
    to_sleeping: int = 0
    failed: int = 0  # requests that got no answer at all (live replays only)
    per_worker: dict[str, int] = field(default_factory=dict)  # requests served by each worker
    per_worker_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens sent to each worker

    @property
    def prefill_tokens(self) -> int:
        return self.total_tokens - self.reused_tokens

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.total_tokens if self.total_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "requests": self.num_requests, "total_tokens": self.total_tokens,
                "reused_tokens": self.reused_tokens, "prefill_tokens": self.prefill_tokens,
                "hit_rate": round(self.hit_rate, 6), "warm_routes": self.warm_routes,
                "stale_warm_routes": self.stale_warm_routes, "to_sleeping": self.to_sleeping, "failed": self.failed,
                "per_worker": dict(sorted(self.per_worker.items())),
                "per_worker_tokens": dict(sorted(self.per_worker_tokens.items())),
                "max_min_share": max_min_share(self.per_worker)}

    @classmethod
    def for_workers(cls, policy: str, workers: Sequence[str]) -> PolicyResult:
        """An empty result with every worker listed (a worker that serves nothing shows as 0)."""
        return cls(policy, per_worker=dict.fromkeys(workers, 0), per_worker_tokens=dict.fromkeys(workers, 0))

    def count(self, worker: str, num_tokens: int) -> None:
        self.per_worker[worker] = self.per_worker.get(worker, 0) + 1
        self.per_worker_tokens[worker] = self.per_worker_tokens.get(worker, 0) + num_tokens


def max_min_share(per_worker: dict[str, int]) -> float | None:
    """Requests of the busiest worker over the idlest (None when a worker served none: unbounded)."""
    vals = list(per_worker.values())
    return round(max(vals) / min(vals), 3) if vals and min(vals) > 0 else None


@dataclass(slots=True)
class Fleet:
    """The workers' true state: engines, who is asleep, what waits there, events as delivered."""

    engines: dict[str, SimEngine]
    asleep: set[str] = field(default_factory=set)
    delivered: PrefixIndex = field(default_factory=PrefixIndex)

    @classmethod
    def build(cls, trace: Trace) -> Fleet:
        f = cls({})
        for name in trace.workers:
            cfg = SimEngineConfig(block_size=trace.block_size, num_blocks=trace.num_blocks)
            f.engines[name] = SimEngine(cfg, functools.partial(f._deliver, name))
        return f

    def _deliver(self, name: str, events: list[Any]) -> None:
        """One published batch, through the real wire encoding and decoder, into the index."""
        for ev in decode_batch(wire.encode_batch(0.0, events)).events:
            self.delivered.apply((name, 0), ev)

    def true_blocks(self, name: str, req: Request) -> int:
        """Leading blocks of the request resident on the worker right now (0 while it sleeps)."""
        eng = self.engines[name]
        n = 0
        for d in chain(eng.hash_cfg, req.token_ids, cache_salt=req.salt):
            if d not in eng.cache:
                break
            n += 1
        return n

    def serve(self, name: str, req: Request, out: PolicyResult) -> None:
        assert name not in self.asleep, name
        res = self.engines[name]._step(req.token_ids, None, req.salt, False)
        out.total_tokens += res.num_prompt_tokens
        out.reused_tokens += res.num_cached_tokens

    def lifecycle(self, ev: Lifecycle, out: PolicyResult) -> None:
        eng = self.engines[ev.worker]
        if ev.action == "sleep":
            eng.sleep(ev.level, "abort")
            self.asleep.add(ev.worker)
            return
        eng.wake_up(None)
        self.asleep.discard(ev.worker)


class RoutingPolicy:
    """Chooses a worker for a request: `(worker, claimed_blocks)`; claimed 0 means COLD."""

    name = "policy"

    def choose(self, fleet: Fleet, req: Request, i: int, tried: frozenset[str] = frozenset()) -> tuple[str, int]:
        """The worker for `req` (not one of `tried`, which timed out asleep) and the blocks claimed."""
        raise NotImplementedError


class Recorded(RoutingPolicy):
    name = "kvfleet"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def choose(self, fleet: Fleet, req: Request, i: int, tried: frozenset[str] = frozenset()) -> tuple[str, int]:
        return req.worker, req.claimed_tokens // self.block_size


class Greedy(RoutingPolicy):
    name = "greedy"

    def choose(self, fleet: Fleet, req: Request, i: int, tried: frozenset[str] = frozenset()) -> tuple[str, int]:
        awake = [n for n in fleet.engines if n not in fleet.asleep]
        best = min(awake, key=lambda n: (-fleet.true_blocks(n, req), len(fleet.engines[n].cache), n))
        return best, fleet.true_blocks(best, req)


class Blind(RoutingPolicy):
    name = "blind"

    def choose(self, fleet: Fleet, req: Request, i: int, tried: frozenset[str] = frozenset()) -> tuple[str, int]:
        cfg = next(iter(fleet.engines.values())).hash_cfg
        hashes = external_chain(cfg, req.token_ids, cache_salt=req.salt)
        names = [n for n in fleet.engines if n not in tried]
        best = max(names, key=lambda n: (fleet.delivered.match((n, 0), hashes), n))  # as BaselineRouter
        return best, fleet.delivered.match((best, 0), hashes)


class Sticky(RoutingPolicy):
    """Consistent hashing of the session (agent) name over the workers, skipping sleeping ones."""

    name = "sticky"
    VNODES = 64

    def __init__(self, workers: Sequence[str]) -> None:
        ring = [(self._h(f"{w}#{v}"), w) for w in workers for v in range(self.VNODES)]
        self.ring = sorted(ring)

    @staticmethod
    def _h(key: str) -> int:
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")

    def choose(self, fleet: Fleet, req: Request, i: int, tried: frozenset[str] = frozenset()) -> tuple[str, int]:
        h = self._h(req.agent)
        start = next((j for j, (p, _) in enumerate(self.ring) if p >= h), 0)
        for j in range(len(self.ring)):
            w = self.ring[(start + j) % len(self.ring)][1]
            if w not in fleet.asleep and w not in tried:
                return w, 0
        raise ValueError("no awake worker")


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def choose(self, fleet: Fleet, req: Request, i: int, tried: frozenset[str] = frozenset()) -> tuple[str, int]:
        names = list(fleet.engines)
        return names[(i + len(tried)) % len(names)], 0


def busiest(fleet: Fleet, served: dict[str, int]) -> str:
    """The awake worker that served the most requests so far (ties: the larger name). The live
    run aims its sleeps with the same rule, so every policy loses the worker it leans on most."""
    awake = [n for n in fleet.engines if n not in fleet.asleep]
    return max(awake, key=lambda n: (served.get(n, 0), n))


def replay(trace: Trace, policy: RoutingPolicy) -> PolicyResult:
    """Run the trace's requests and lifecycle events, in order, with `policy` choosing workers.

    A sleep hits the policy's own busiest worker (`busiest`), its wake the worker that sleep hit;
    for kvfleet's recorded choices that is the very worker the live run put to sleep.
    """
    fleet, out, i = Fleet.build(trace), PolicyResult.for_workers(policy.name, trace.workers), 0
    served: dict[str, int] = {}
    slept: dict[str, str] = {}
    for ev in trace.events:
        if isinstance(ev, Lifecycle):
            if ev.action == "sleep":
                slept[ev.via] = busiest(fleet, served)
                if isinstance(policy, Recorded) and slept[ev.via] != ev.worker:
                    raise ValueError(f"model infidelity: the live run slept {ev.worker}, the model {slept[ev.via]}")
            fleet.lifecycle(dataclasses.replace(ev, worker=slept[ev.via]), out)
            continue
        out.num_requests += 1
        tried: set[str] = set()
        while True:  # a sleeping worker hangs the request until the client's timeout; then route again
            worker, claimed = policy.choose(fleet, ev, i, frozenset(tried))
            asleep = worker in fleet.asleep
            if claimed > 0:
                out.warm_routes += 1
                out.stale_warm_routes += asleep or fleet.true_blocks(worker, ev) < claimed
            if not asleep:
                break
            out.to_sleeping += 1
            tried.add(worker)
        i += 1
        served[worker] = served.get(worker, 0) + 1
        out.count(worker, ev.num_tokens)
        fleet.serve(worker, ev, out)
    return out


def replay_all(trace: Trace) -> dict[str, PolicyResult]:
    """The same trace under every policy (kvfleet's recorded choices first)."""
    policies: Sequence[RoutingPolicy] = (Recorded(trace.block_size), Greedy(), Sticky(trace.workers), Blind(),
                                  RoundRobin())
    return {p.name: replay(trace, p) for p in policies}
