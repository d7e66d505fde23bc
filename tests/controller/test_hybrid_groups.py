"""A hybrid model's KV groups (vLLM's HybridKVCacheCoordinator): WARM and matched_tokens as vLLM would reuse.

A hybrid vLLM (Gemma 3, gpt-oss, Llama 4: sliding-window layers beside full-attention ones) publishes one BlockStored
per KV group, each with its group_idx, kv_cache_spec_kind and, for a sliding-window group, its window. vLLM's hit is
the longest prefix every group serves: a full-attention group needs every block from block 0, a sliding-window group
only the blocks of the window before the hit's end (single_type_kv_cache_manager.SlidingWindowManager
.find_longest_cache_hit), so the sliding-window group's old blocks, which vLLM frees as the window slides and then
evicts (BlockRemoved), cost no hit. The batches are built here as vLLM 0.33.0 encodes them and published over real ZMQ
by the stand-in's publisher (the stand-in itself models one group); the real Router routes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from support.one_worker import one_worker, synced

from controller.router import Router
from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.core.block_hash import HashConfig, external_chain

B, N = 16, 8  # an 8-block prompt
WINDOW = 2 * B  # the sliding-window group needs cdiv(WINDOW - 1, B) = 2 blocks before the hit's end
TOKS = [7_000 + k for k in range(N * B + 1)]  # one token past the last full block: vLLM may hit all 8
H = external_chain(HashConfig("sha256", None, B), TOKS)


def _stored(g: int, kind: str, first: int, n: int, window: int | None = None) -> Any:
    return wire.VllmBlockStored(
        block_hashes=H[first:first + n], parent_block_hash=H[first - 1] if first else None,
        token_ids=TOKS[first * B:(first + n) * B], block_size=B, lora_id=None, medium="GPU", lora_name=None,
        extra_keys=[None] * n, group_idx=g, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def _removed(g: int, hashes: list[int]) -> Any:
    return wire.VllmBlockRemoved(block_hashes=hashes, medium="GPU", group_idx=g)


HYBRID = [_stored(0, "full_attention", 0, N), _stored(1, "sliding_window", 0, N, WINDOW)]


async def _route(r: Router, sim: SimVllm, *batches: list[Any]) -> tuple[str, int]:
    assert sim.publisher is not None
    for b in batches:
        sim.publisher.publish(b)
    await synced(r, sim)
    for _ in range(100):  # the rank's warmth is proven for its epoch a moment after its first batch
        d = await r.route(TOKS, "m")
        if d.verdict == "WARM":
            break
        await asyncio.sleep(0.01)
    return d.verdict, d.matched_tokens


async def test_a_hybrid_prompt_vllm_holds_in_every_group_routes_warm(tmp_path: Path) -> None:
    async with one_worker(tmp_path, 256) as (r, sim):
        assert await _route(r, sim, HYBRID) == ("WARM", N * B)


async def test_the_window_group_freeing_its_old_blocks_keeps_the_prompt_warm(tmp_path: Path) -> None:
    async with one_worker(tmp_path, 256) as (r, sim):
        # the window slid: vLLM freed and then evicted blocks 0..5 of group 1; its last 2 blocks serve the window
        assert await _route(r, sim, HYBRID, [_removed(1, H[:N - 2])]) == ("WARM", N * B)


async def test_the_window_group_losing_its_last_blocks_shortens_the_hit(tmp_path: Path) -> None:
    async with one_worker(tmp_path, 256) as (r, sim):
        # group 1 lost block 7: its longest run of 2 blocks ending at or before block 7 is 5..6, so the hit is 7 blocks
        assert await _route(r, sim, HYBRID, [_removed(1, [H[7]])]) == ("WARM", 7 * B)


async def test_the_full_group_losing_block_0_makes_it_cold(tmp_path: Path) -> None:
    async with one_worker(tmp_path, 256) as (r, sim):
        assert (await _route(r, sim, HYBRID, [_removed(0, [H[0]])]))[1] == 0


async def test_a_group_of_a_kind_not_modelled_fails_closed(tmp_path: Path) -> None:
    async with one_worker(tmp_path, 256) as (r, sim):
        mamba = [_stored(0, "full_attention", 0, N), _stored(1, "mamba", N - 1, 1)]
        assert (await _route(r, sim, mamba))[1] == 0


async def test_a_window_group_store_that_skips_its_null_blocks_routes_warm(tmp_path: Path) -> None:
    """vLLM's BlockPool.cache_full_blocks leaves a null block out of `block_hashes` (and `extra_keys`) but not out of
    `token_ids`, which span every new block (vllm#44451): a sliding-window group whose blocks outside the window are
    null (external tokens a KV connector loaded, SWA allocation) stores only the window's hashes, parent None, with
    all the prompt's tokens. NOTE: such an event was a decode error (tokens != hashes x block size): the batch was
    dropped, the rank invalidated, and the prompt routed COLD; its block 0 is no calibration evidence either."""
    window_only = wire.VllmBlockStored(
        block_hashes=H[N - 2:N], parent_block_hash=None, token_ids=TOKS[:N * B], block_size=B, lora_id=None,
        medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=1, kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=WINDOW)
    async with one_worker(tmp_path, 256) as (r, sim):
        assert await _route(r, sim, [_stored(0, "full_attention", 0, N), window_only]) == ("WARM", N * B)


async def test_control_one_group_routes_warm(tmp_path: Path) -> None:
    async with one_worker(tmp_path, 256) as (r, sim):
        assert await _route(r, sim, [_stored(0, "full_attention", 0, N)]) == ("WARM", N * B)


def _stored_at(g: int, size: int, hashes: list[int], first_token: int) -> Any:
    """A GPU BlockStored of group `g` at its own block size (the hashes are not checked: no route can match them)."""
    toks = list(range(first_token, first_token + size * len(hashes)))
    return wire.VllmBlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=toks, block_size=size, lora_id=None, medium="GPU",
        lora_name=None, extra_keys=[None] * len(hashes), group_idx=g, kv_cache_spec_kind="full_attention")


async def test_groups_of_different_block_sizes_route_cold_without_dropping_the_rank_at_every_step(
        tmp_path: Path) -> None:
    """A hybrid whose KV groups have different block sizes (group 0 at 16, group 1 at 32): no route can be matched
    across them (the index fails closed), so they route COLD; the second size is no calibration failure. NOTE: it was
    one at every step carrying group 1's blocks: the rank's index dropped and its state written each time (5 epoch
    bumps for 5 steps here). Control: a second size in the one group that calibrates still fails it."""
    async with one_worker(tmp_path, 256) as (r, sim):
        assert sim.publisher is not None
        bumps = r.metrics.epoch_bumps.labels("calibration")
        for step in range(5):
            sim.publisher.publish([_stored(0, "full_attention", step, 1) if step else HYBRID[0],
                                   _stored_at(1, 2 * B, [10_000 + step], 50_000 + 64 * step)])
        await synced(r, sim)
        assert bumps._value.get() == 0 and (await r.route(TOKS, "m")).verdict == "COLD"  # before: 5
        sim.publisher.publish([_stored_at(0, 2 * B, [20_000], 90_000)])  # control: group 0's own size changed
        await synced(r, sim)
        assert bumps._value.get() == 1
