"""A lifecycle verb whose caller gives up while vLLM runs it is still answered, and its witness adopted.

grpc.aio cancels a handler whose client's deadline passes (or whose client goes away). A verb cancelled while its
call to vLLM was out adopted nothing: its rank kept the state it took before the call (index dropped, no fence
"clear"). A pause with mode=wait then went on in vLLM: the running requests it let finish kept their blocks
indexed, vLLM reset its cache (the AllBlocksCleared queued, published with the next step), and once resumed the
worker was routed WARM to blocks it no longer held. A verb queued behind a draining reset meets the SDK's 10 s
deadline this way; here the deadline is short. The real controller over gRPC on loopback, two `kvfleet sim-vllm`
workers with a clock (one request at a time, so the second one is still waiting when the pause comes, and stays
queued until the resume, as in vLLM).
"""

from __future__ import annotations

import asyncio

import pytest
from support.proxy_fleet import MODEL, Fleet, start_fleet, until
from support.stand_ins import complete

from fleet.core.block_hash import external_chain
from fleet.sdk import AsyncFleetClient

LONG = list(range(9000, 9040))
HISTORY = list(range(1000, 1100))  # 6 full blocks
BLOCK = 16


async def _complete(url: str, prompt: list[int], max_tokens: int) -> int:
    return (await complete(url, prompt, max_tokens))[0]


def _held(fleet: Fleet, prompt: list[int]) -> int:
    """The leading tokens of `prompt` the stand-in w0 really holds."""
    cfg = fleet.ctl.ctx.router.worker("w0").view().hash_cfg
    resident, n = set(fleet.sims["w0"].engine.resident_external()), 0
    for h in external_chain(cfg, prompt):
        if h not in resident:
            break
        n += 1
    return n * BLOCK


@pytest.mark.parametrize("deadline_s", [0.3, None])
async def test_a_wait_pause_whose_caller_gave_up_still_fences_the_blocks_its_drain_stored(
    tmp_path, deadline_s: float | None
) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, reconcile_s=0.1,
                              engine_kw={"time_scale": 1.0, "decode_base_s": 0.04, "max_num_seqs": 1})
    sim = fleet.sims["w0"]
    caller = AsyncFleetClient(fleet.ctl.address, fleet.tokens["op"], timeout=deadline_s or 10.0)
    try:
        busy = asyncio.create_task(_complete(sim.url, LONG, 20))  # decodes for about 0.8 s
        await until(lambda: asyncio.sleep(0, sim.engine.running), bool)
        queued = asyncio.create_task(_complete(sim.url, HISTORY, 2))  # waits for it, then prefills 6 blocks
        await until(lambda: asyncio.sleep(0, sim.engine.waiting), bool)

        verb = caller.lifecycle("w0", "pause", mode="wait")
        if deadline_s:
            with pytest.raises(Exception, match="(?i)deadline"):
                await verb
        else:
            assert (await verb).kv == "forgotten"
        assert await busy == 200  # the pause let the running request finish, then reset the cache
        await until(lambda: asyncio.sleep(0, sim.engine.is_sleeping() and not sim.engine.running), bool)
        # NOTE: as in vLLM, whose wait pause drains the requests holding blocks alone, the queued one waits for the
        # resume (the stand-in ran it in the drain, and this test relied on it, until round thirty-six)
        assert not queued.done() and sim.engine.waiting == 1
        rank = fleet.ctl.ctx.router.worker("w0").ranks[0]
        assert (rank.phase, rank.kv, rank.fence) == ("paused", "forgotten", "clear")  # before: paused, unknown, ""
        d = await fleet.ctl.ctx.router.route(LONG + [7], MODEL)
        assert _held(fleet, LONG + [7]) == 0  # the drained request's blocks went with the pause's reset
        assert (d.verdict, d.matched_tokens) == ("COLD", 0)  # before: w0 WARM to blocks it no longer held

        await fleet.op.lifecycle("w0", "resume")
        assert await queued == 200  # scheduled once resumed, on the cold cache
    finally:
        await caller.close()
        await fleet.stop()
