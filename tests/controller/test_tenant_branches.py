"""The shared-prefix forks the router learns (Branches) are kept per tenant under one bound
(controller/tenant_branches.py): one tenant's flood of new prompts never makes another tenant's forks forgotten.

NOTE: before, every tenant's chains went into one pair of generations: a flood of one tenant's new hashes turned
them over, and another tenant's system prompt, not sent meanwhile, was forgotten (its next turns shared nothing).
"""

from __future__ import annotations

from pathlib import Path

from support.one_worker import complete_direct, one_worker, warm

from controller.tenant_branches import TenantBranches
from fleet.core.block_hash import external_chain

B = 16  # the stand-in's block size
SYSTEM = [7_000 + k for k in range(4 * B)]  # acme's system prompt: 4 blocks


def test_past_the_bound_the_tenant_holding_the_most_forgets_its_own() -> None:
    b = TenantBranches(max_blocks=200)
    system = list(range(1, 65))
    for tail in (1_000, 2_000, 3_000):  # three conversations continue it: a fork at its end
        b.observe([*system, tail], "acme")
    assert b.observe([*system, 4_000], "acme") == 64
    for r in range(17):  # bravo: 17 distinct prompts of 64 blocks, 1,088 new hashes
        b.observe([(r + 1) << 40 | k for k in range(64)], "bravo")
    assert b.observe([*system, 5_000], "acme") == 64  # NOTE: before (one shared Branches), 0
    assert b.num_blocks() <= 200 and b.num_blocks("acme") == 64  # bravo's flood went from its own
    lone = TenantBranches(max_blocks=200)  # control: a lone tenant's flood turns over its own generations, as before
    for tail in (1_000, 2_000, 3_000):
        lone.observe([*system, tail], "acme")
    for r in range(17):
        lone.observe([(r + 1) << 40 | k for k in range(64)], "acme")
    assert lone.observe([*system, 5_000], "acme") == 0


async def test_another_tenants_flood_of_routes_leaves_my_system_prompt_shared(tmp_path: Path) -> None:
    """The real Router on a stand-in: acme's three conversations teach it the fork at the end of acme's system
    prompt; bravo then routes 5 distinct prompts of 32 blocks (160 new hashes, the bound is 64); acme's next
    conversation is still recorded as sharing the 4 blocks (before: 0, weighed as if it shared nothing)."""
    async with one_worker(tmp_path, num_blocks=256) as (r, sim):
        r.branches = r.candidates.branches = TenantBranches(max_blocks=64)
        first = [*SYSTEM, *range(90_000, 90_000 + B)]
        await complete_direct(sim, r, first)
        await warm(r, first)
        cfg = r.worker("w0").view().hash_cfg
        assert cfg is not None

        async def shared(toks: list[int], owner: str) -> int:
            await r.route(toks, "m", owner=owner)
            found = r.demand.previous(external_chain(cfg, toks))
            assert found is not None
            return found[1].num_shared

        for t in range(3):
            await shared([*SYSTEM, *range(100_000 * (t + 1), 100_000 * (t + 1) + B)], "acme")
        assert await shared([*SYSTEM, *range(500_000, 500_000 + B)], "acme") == 4  # learned
        for j in range(5):
            await r.route([1_000_000 * (j + 1) + k for k in range(32 * B)], "m", owner="bravo")
        assert await shared([*SYSTEM, *range(600_000, 600_000 + B)], "acme") == 4  # NOTE: before, 0
        assert r.branches.num_blocks() <= 64
