"""A forgetting verb whose call to vLLM fails may still have acted: the rank awaits the clear it may have queued.

A pause with mode=wait is answered once vLLM's requests in flight have finished; a drain longer than the verb's
bound (the HTTP timeout plus --reset-drain-timeout) fails the call while vLLM goes on. The rank was marked
`error` and its index dropped, but its fence was kept: the blocks the drained requests stored (in vLLM, a running
request's later prefill chunks and full output blocks) were indexed, vLLM
then reset its cache (the AllBlocksCleared queued, published with the first step after a resume), and once resumed
the worker was routed WARM to blocks it no longer held. Now a failed verb that would queue a clear puts fence
"clear" up; it lifts with the clear, or, where vLLM never acted, once the rank serves again and CLEAR_SETTLE_S
have passed (docs/lifecycle.md). The real Router on two `kvfleet sim-vllm` workers with a clock.
"""

from __future__ import annotations

import asyncio

import pytest
from support.one_worker import warm
from support.stand_ins import complete, routed_stand_ins
from support.waits import wait_until

from controller.router import Router
from controller.vllm.http import WorkerHttpError
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.core.block_hash import external_chain

LONG = list(range(9000, 9040))
HISTORY = list(range(1000, 1100))  # 6 full blocks
BLOCK = 16


async def _complete(url: str, prompt: list[int], max_tokens: int) -> int:
    return (await complete(url, prompt, max_tokens))[0]


def _held(r: Router, sim: SimVllm, prompt: list[int]) -> int:
    """The leading tokens of `prompt` the stand-in really holds."""
    resident, n = set(sim.engine.resident_external()), 0
    for h in external_chain(r.worker("w0").view().hash_cfg, prompt):
        if h not in resident:
            break
        n += 1
    return n * BLOCK


async def _route(r: Router, prompt: list[int]) -> tuple[str, str, int]:
    d = await r.route(prompt, "m")
    return d.worker, d.verdict, d.matched_tokens


@pytest.fixture
async def fleet(tmp_path):
    eng = SimEngineConfig(model="m", num_blocks=64, time_scale=1.0, decode_base_s=0.04, max_num_seqs=1)
    # the pause's call is bounded by 0.3 s: the drain below outlasts it
    async with routed_stand_ins(tmp_path, eng, http_timeout_s=0.3, reset_drain_s=0.0) as (r, sims):
        yield r, sims[0]


async def test_a_wait_pause_that_outlasts_its_call_fences_what_its_drain_stores(fleet) -> None:
    r, sim = fleet
    busy = asyncio.create_task(_complete(sim.url, LONG, 70))  # decodes for about 2.8 s
    await wait_until(lambda: sim.engine.running, "the long request to run")
    queued = asyncio.create_task(_complete(sim.url, HISTORY, 2))  # waits for it: stores its blocks > 2 s later
    await wait_until(lambda: sim.engine.waiting, "the second request to wait")

    with pytest.raises(WorkerHttpError, match="TimeoutError"):
        await r.lifecycle("w0", "pause", mode="wait")
    assert r.worker("w0").ranks[0].fence == "clear"  # before: ""
    assert await busy == 200  # vLLM's pause went on: the running request finished, then the cache reset
    await wait_until(lambda: not sim.engine.running, "the drain to end")
    # NOTE: as in vLLM, whose wait pause drains the requests holding blocks alone, the queued one waits for the
    # resume (the stand-in ran it in the drain, and this test relied on it, until round thirty-six)
    assert not queued.done() and sim.engine.waiting == 1
    await asyncio.sleep(0.3)  # three looks at the paused worker

    await r.lifecycle("w0", "resume")
    # the first step after it publishes vLLM's clear, then the queued request's blocks: the fence lifts with the clear
    assert await queued == 200
    await wait_until(lambda: r.worker("w0").ranks[0].fence == "", "the clear")
    await warm(r, HISTORY + [7])  # the queued request's blocks, stored after the clear, read
    assert _held(r, sim, LONG + [7]) == 0  # the drained request's blocks went with the pause's reset
    assert await _route(r, LONG + [7]) in (("w0", "COLD", 0), ("w1", "COLD", 0))  # before: WARM, none held
    assert _held(r, sim, HISTORY + [7]) == 96  # what follows the clear is proof again
    assert await _route(r, HISTORY + [7]) == ("w0", "WARM", 96)


async def test_a_failed_verb_vllm_never_acted_on_leaves_no_fence_for_good(fleet) -> None:
    """Control: vLLM refuses a release of a worker it has not paused (HTTP 400, nothing done, no clear queued). The
    fence the failure put up lifts once the worker serves again and CLEAR_SETTLE_S have passed, at its next batch."""
    r, sim = fleet
    with pytest.raises(WorkerHttpError, match="400"):
        await r.lifecycle("w0", "release_kv_cache_memory")
    assert r.worker("w0").ranks[0].fence == "clear"
    await wait_until(lambda: r.worker("w0").ranks[0].serving, "a look to find it serving")
    for i in range(40):  # a new prompt a tenth of a second, each stored in a batch of its own
        assert await _complete(sim.url, list(range(20_000 + 100 * i, 20_032 + 100 * i)), 1) == 200
        if r.worker("w0").ranks[0].fence == "":
            break
        await asyncio.sleep(0.1)
    assert r.worker("w0").ranks[0].fence == ""
    assert await _complete(sim.url, HISTORY, 1) == 200
    await wait_until(lambda: _held(r, sim, HISTORY + [7]) == 96, "the stand-in to hold the prompt")
    await warm(r, HISTORY + [7])
    assert await _route(r, HISTORY + [7]) == ("w0", "WARM", 96)
