"""A prompt prefix that a tracked route still in flight is computing on a worker counts as cached there when
`inflight_prefix` is on (issue #27, tenants2: the 16 agents' opening burst prefilled each tenant's system prompt
on every worker, because KV events had not yet proven it anywhere when the next conversations were routed).

vLLM caches a prompt's full blocks in the step that schedules them, so a request admitted with or after that
route finds them cached. The real Router on two `kvfleet sim-vllm` workers; nothing is run, so no KV event
proves anything: the only evidence is the route in flight.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from support.stand_ins import capacities_known

from controller.cost import CostConfig
from controller.inflight import PENDING_HASHES_PER_RANK, Flight, InFlight
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

SYSTEM = list(range(1, 321))  # 20 full blocks of 16 tokens


def turn(k: int) -> list[int]:
    return SYSTEM + [100_000 * (k + 1) + i for i in range(32)]


@contextlib.asynccontextmanager
async def _router(path: str, inflight_prefix: bool) -> AsyncIterator[Router]:
    store = open_store(f"sqlite:///{path}")
    sims = [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=256))).start() for _ in range(2)]
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, cost=CostConfig(inflight_prefix=inflight_prefix)))
    await r.start()
    try:
        for i, s in enumerate(sims):
            await r.register_worker(WorkerSpec(f"w{i}", s.url, s.kv_events, s.replay, "m"))
        await capacities_known(r)
        yield r
    finally:
        await r.stop()
        for s in sims:
            await s.stop()


async def _second(path: str, inflight_prefix: bool, salt: str | None = None, release: bool = False) -> tuple[str, str, int]:
    """Where the first conversation went, where the second, sharing its system prompt, goes, and the second's prefill
    on the first's worker."""
    async with _router(path, inflight_prefix) as r:
        first = await r.route(turn(0), "m", track=True, cache_salt="t0")
        if release:
            assert r.release_route(first.route_id)
        d = await r.route(turn(1), "m", track=True, cache_salt=salt or "t0")
        print(inflight_prefix, salt, release, first.worker, "->", d.worker, d.verdict,
              [(c.worker, c.cost) for c in d.candidates])
        assert d.verdict == "COLD" and d.matched_tokens == 0  # nothing proven: never claimed WARM
        return first.worker, d.worker, next(c.cost.prefill_tokens for c in d.candidates if c.worker == first.worker)


async def test_a_second_conversation_joins_the_worker_computing_its_system_prompt(tmp_path) -> None:
    first, second, prefill = await _second(f"{tmp_path}/kv.db", inflight_prefix=True)
    assert second == first and prefill == 32  # 32 tokens to prefill there (behind 352 queued), against 352 on the idle worker


async def test_control_off_the_second_goes_to_the_idle_worker(tmp_path) -> None:
    first, second, prefill = await _second(f"{tmp_path}/kv.db", inflight_prefix=False)
    assert second != first and prefill == 352  # events alone: the system prompt is cached nowhere yet


async def test_control_another_tenants_salt_earns_no_credit(tmp_path) -> None:
    first, second, prefill = await _second(f"{tmp_path}/kv.db", inflight_prefix=True, salt="t1")
    assert second != first and prefill == 352  # other salt, other block hashes: vLLM would not share them


async def test_control_a_released_route_earns_no_credit(tmp_path) -> None:
    _, _, prefill = await _second(f"{tmp_path}/kv.db", inflight_prefix=True, release=True)
    assert prefill == 352  # nothing in flight, nothing proven: the whole prompt


def test_pending_counts_leading_blocks_of_routes_in_flight_and_forgets_ended_ones() -> None:
    f = InFlight(ttl_s=60, grace_s=0.25, default_tokens=256)
    key = ("w0", 0)
    f.add(Flight("a" * 32, key, 352, 5, None, 0.0, (1, 2, 3, 4, 5)))
    f.add(Flight("b" * 32, key, 352, 7, None, 0.0, (1, 2, 6, 7)))
    assert f.pending(key, [1, 2, 3, 9]) == 3 and f.pending(key, [1, 2, 6, 7, 8]) == 4
    assert f.pending(("w1", 0), [1, 2]) == 0  # on its rank only
    f.release("a" * 32)
    assert f.pending(key, [1, 2, 3]) == 2  # the blocks both had stay while one holds them
    f.release("b" * 32)
    assert f.pending(key, [1, 2]) == 0 and not f._blocks


def test_the_hashes_kept_per_rank_are_bounded() -> None:
    f, key, n = InFlight(ttl_s=60, grace_s=0.25, default_tokens=256), ("w0", 0), 1024
    for i in range(PENDING_HASHES_PER_RANK // n + 3):  # distinct prompts, never released
        f.add(Flight(f"{i:032x}", key, n * 16, None, None, 0.0, tuple(range(i * n, (i + 1) * n))))
    assert len(f._blocks[key]) == PENDING_HASHES_PER_RANK  # the routes past the bound are tracked without them
    assert len(f) == PENDING_HASHES_PER_RANK // n + 3 and f.pending(key, [0, 1]) == 2
    f.release(f"{0:032x}")
    assert len(f._blocks[key]) == PENDING_HASHES_PER_RANK - n  # and a route tracked without them frees none
    f.release(f"{PENDING_HASHES_PER_RANK // n + 2:032x}")
    assert len(f._blocks[key]) == PENDING_HASHES_PER_RANK - n
