"""The stand-in workers each contender gets fresh: `kvfleet sim-vllm` engines in this process, observed.

Every contender runs against new `SimVllm`s built from the same config, so caches, counters and
sequence numbers start from zero each time. An observing middleware counts, per worker, the
completion requests that arrived and those that arrived while the engine was asleep (the
stand-in itself only knows how many are waiting now). Prefill is read from the engines' own
counters, read from their /metrics as vLLM exports them (`vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total`): prefilled = queries - hits, plus the prompt tokens a preempted request
computed again (`sim:preempted_prefill_tokens_total`, the stand-in's own counter: vLLM counts a request's
first scheduling only, and the reset behind the routers' backs preempts what runs there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.app.testkit.stack import start_sims

MODEL = "sim-model"
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True)
class WorkerStats:
    arrivals: int = 0
    to_sleeping: int = 0
    queries: int = 0  # prompt tokens the engine ran (a request counts once, as vLLM counts it)
    hits: int = 0  # of which served from its prefix cache
    recomputed: int = 0  # prompt tokens computed again after a preemption (the stand-in's own counter)

    @property
    def prefilled(self) -> int:
        return self.queries - self.hits + self.recomputed


def engine_config(
    num_blocks: int, block_size: int, opts: dict[str, Any], defaults: dict[str, Any] | None = None
) -> tuple[SimEngineConfig, dict[str, Any]]:
    """The engine config, with only those options the stand-in knows (its fields change over time):
    `defaults` where it has the field, then `opts`; returns the config and the `opts` it ignored."""
    known = {f.name for f in dataclasses.fields(SimEngineConfig)}
    used = {k: v for k, v in {**(defaults or {}), **opts}.items() if k in known}
    return (
        SimEngineConfig(model=MODEL, block_size=block_size, num_blocks=num_blocks, **used),
        {k: v for k, v in opts.items() if k not in known},
    )


def _observe(sim: SimVllm) -> list[Any]:
    """Count, per stand-in, the completion requests that arrived and those that found it asleep."""
    sim.observed = WorkerStats()  # type: ignore[attr-defined]

    @web.middleware
    async def observe(req: web.Request, handler: Any) -> web.StreamResponse:
        if req.method == "POST" and req.path in COMPLETIONS:
            st = sim.observed  # type: ignore[attr-defined]
            st.arrivals += 1
            st.to_sleeping += sim.engine.is_sleeping()
        return await handler(req)  # type: ignore[no-any-return]

    return [observe]


RESET_TARGETS = ("received", "cached")  # SimFleet.busiest's `by`: the bench's --reset-target


class SimFleet:
    """Named stand-ins w0..w{n-1} on loopback; `stats()` is what they did since `snapshot()`."""

    def __init__(self, sims: dict[str, SimVllm]) -> None:
        self.sims = sims
        self._base: dict[str, WorkerStats] = {n: WorkerStats() for n in sims}

    @classmethod
    async def start(cls, num_workers: int, cfg: SimEngineConfig) -> SimFleet:
        sims = await start_sims(num_workers, cfg, observe=_observe)
        return cls(sims)

    def _arrivals(self, name: str) -> int:
        return int(self.sims[name].observed.arrivals)  # type: ignore[attr-defined]

    def arrived(self) -> int:
        """Completion requests that reached any stand-in so far (not reset by `snapshot`)."""
        return sum(self._arrivals(n) for n in self.sims)

    async def _now(self, name: str, http: aiohttp.ClientSession) -> WorkerStats:
        s = self.sims[name]
        o = s.observed  # type: ignore[attr-defined]
        async with http.get(s.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            m = metric_sums(await r.text())
        return WorkerStats(
            o.arrivals,
            o.to_sleeping,
            int(m.get("vllm:prefix_cache_queries_total", 0)),
            int(m.get("vllm:prefix_cache_hits_total", 0)),
            int(m.get("sim:preempted_prefill_tokens_total", 0)),
        )

    async def snapshot(self, http: aiohttp.ClientSession) -> None:
        self._base = {n: await self._now(n, http) for n in self.sims}

    async def stats(self, http: aiohttp.ClientSession) -> dict[str, WorkerStats]:
        out = {}
        for n in self.sims:
            now, b = await self._now(n, http), self._base[n]
            out[n] = WorkerStats(
                now.arrivals - b.arrivals,
                now.to_sleeping - b.to_sleeping,
                now.queries - b.queries,
                now.hits - b.hits,
                now.recomputed - b.recomputed,
            )
        return out

    def busiest(self, by: str = "received") -> str:
        """The awake worker that received the most requests so far ("received"; requests that reached it while it
        slept count), or that holds the most cached blocks now ("cached"); ties: the larger name."""
        if by not in RESET_TARGETS:
            raise ValueError(f"busiest by {by!r}: one of {', '.join(RESET_TARGETS)}")
        awake = [n for n in self.sims if not self.asleep(n)] or list(self.sims)
        if by == "cached":
            return max(awake, key=lambda n: (len(self.sims[n].engine.cache), n))
        return max(awake, key=lambda n: (self._arrivals(n) - self._base[n].arrivals, n))

    @property
    def block_size(self) -> int:
        return next(iter(self.sims.values())).cfg.engine.block_size

    def asleep(self, name: str) -> bool:
        return self.sims[name].engine.is_sleeping()

    def urls(self) -> list[str]:
        return [s.url for s in self.sims.values()]

    async def stop(self) -> None:
        async with aiohttp.ClientSession() as http:  # wake sleepers first: their queued requests must end
            for n, s in self.sims.items():
                if self.asleep(n):
                    async with http.post(s.url + "/wake_up", timeout=aiohttp.ClientTimeout(total=5)):
                        pass
        for s in self.sims.values():
            await s.stop()


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> {series name: sum over its label sets} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
