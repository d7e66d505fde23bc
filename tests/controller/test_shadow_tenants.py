"""What one tenant's Routes make the block-pool shadow predict must not hide another tenant's resident blocks
(issue #27 hardening). A Route is only a question until its request reaches the worker: what an untracked Route
would evict counts for its own tenant's Routes only; what a tracked one evicts, for everyone while its request may be
on its way, and past that only once the worker's events show it sent.

The real Router on a `kvfleet sim-vllm` worker of 64 blocks (the shadow: 63 usable, vLLM's null block); the
prompts are sent straight to the worker, each with its tenant's salt, so the index and the shadow learn them
from the worker's events.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import aiohttp
from support.one_worker import one_worker, synced

from controller.cost import CostConfig
from controller.router import Router
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.core.block_hash import external_chain

B, NUM_BLOCKS, KEY = 16, 64, ("w0", 0)


def _salt(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()


def _toks(seed: int, num_blocks: int) -> list[int]:
    return [seed * 100_000 + k for k in range(num_blocks * B)]



async def _send(r: Router, sim: SimVllm, toks: list[int], tenant: str) -> None:
    """The request straight to the worker with the tenant's salt; then every batch it published is ingested."""
    body = {"prompt": toks, "max_tokens": 1, "cache_salt": _salt(tenant)}
    async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
    await synced(r, sim)


def _worker(tmp_path: Path, cost: CostConfig | None = None) -> Any:
    return one_worker(tmp_path, NUM_BLOCKS, cost)


def _chain(r: Router, toks: list[int], tenant: str) -> list[int]:
    cfg = r.worker("w0").view().hash_cfg
    assert cfg is not None
    return external_chain(cfg, toks, cache_salt=_salt(tenant))


async def test_an_untracked_route_never_sent_leaves_the_shadow_as_it_was(tmp_path: Path) -> None:
    """An untracked Route used to be admitted and freed at once: it took the queue's front out of the model and
    put its never-sent blocks at the tail, so the next tracked route, really sent, predicted for every tenant the
    eviction of a prompt vLLM kept, which then went COLD for the 5 s grace."""
    async with _worker(tmp_path) as (r, sim):
        victim, foothold = _toks(2, 10), _toks(50, 3)
        fill = [("filler", _toks(1, 10)), ("victim", victim)]
        fill += [("filler", _toks(i, 10)) for i in range(3, 7)] + [("mallory", foothold)]  # 63 blocks
        for tenant, p in fill:
            await _send(r, sim, p, tenant)
        pool = r.shadow.get(KEY)
        assert pool is not None
        before = pool.queue()
        assert len(before) == 63 and None not in before  # full, in stored order

        a = foothold + _toks(900, 10)  # mallory asks where its 13-block prompt would go, and never sends it
        da = await r.route(a, "m", cache_salt=_salt("mallory"), owner="mallory")
        assert da.worker == "w0"
        assert pool.queue() == before  # NOTE: before, the front 10 blocks left and 11 of mallory's joined the tail

        b = _toks(700, 10)  # a bystander's request, routed tracked and really sent
        db = await r.route(b, "m", cache_salt=_salt("bystander"), owner="bystander", track=True)
        await _send(r, sim, b, "bystander")
        assert r.release_route(db.route_id, owner="bystander")
        assert set(_chain(r, victim, "victim")) <= set(sim.engine.resident_external())  # vLLM kept it
        dv = await r.route(victim, "m", cache_salt=_salt("victim"), owner="victim")
        assert (dv.verdict, dv.matched_tokens) == ("WARM", 160)  # NOTE: before, COLD with 0 matched


async def test_a_tracked_route_never_sent_hides_another_tenants_blocks_only_while_it_may_be_on_its_way(
    tmp_path: Path,
) -> None:
    """Tracking is the caller's choice. A tracked Route's predicted evictions used to be believed by every tenant for
    the 5 s grace, sent or not: mallory's Route of 60 new blocks, released at once and never sent, sent the victim's
    fully resident prompt COLD for 5 s. Now a release before any event shows the request sent undoes the admission,
    and one held unsent is believed by other tenants for `unsent_s` only (the time a request needs to reach the
    engine: within it, the victim's Route must not trust blocks an honest request of mallory's is evicting)."""
    # NOTE: a long reconcile grace: a look at the worker's /metrics past it would end the Routes never sent
    async with _worker(tmp_path, CostConfig(reconcile_grace_s=30.0)) as (r, sim):
        victim, foothold = _toks(2, 10), _toks(50, 3)
        await _send(r, sim, victim, "victim")
        await _send(r, sim, foothold, "mallory")
        pool = r.shadow.get(KEY)
        assert pool is not None
        before = pool.queue()
        assert before == [None] * 50 + _chain(r, victim, "victim")[::-1] + _chain(r, foothold, "mallory")[::-1]

        a = foothold + _toks(900, 60)  # its 3 warm blocks, then 60 new: the 50 fresh ones and the victim's 10
        da = await r.route(a, "m", cache_salt=_salt("mallory"), owner="mallory", track=True)
        assert da.worker == "w0" and set(_chain(r, victim, "victim")) <= set(pool.evicted)
        dv = await r.route(victim, "m", cache_salt=_salt("victim"), owner="victim")
        assert (dv.verdict, dv.matched_tokens) == ("COLD", 0)  # it may be on its way
        assert r.release_route(da.route_id, owner="mallory")  # never sent
        assert not pool.evicted and pool.queue() == before
        dv = await r.route(victim, "m", cache_salt=_salt("victim"), owner="victim")
        assert (dv.verdict, dv.matched_tokens) == ("WARM", 160)  # NOTE: before, COLD for 5 s

        pool.unsent_s = 0.2  # (1 s by default)
        da = await r.route(a, "m", cache_salt=_salt("mallory"), owner="mallory", track=True)  # held, never sent
        await asyncio.sleep(0.25)
        assert r.flights.get(da.route_id) is not None  # still held
        dv = await r.route(victim, "m", cache_salt=_salt("victim"), owner="victim")
        assert (dv.verdict, dv.matched_tokens) == ("WARM", 160)  # NOTE: before, COLD for 5 s
        assert set(_chain(r, victim, "victim")) <= set(sim.engine.resident_external())  # control: vLLM kept it
        assert r.release_route(da.route_id, owner="mallory")
