"""A worker whose hashing fails self-calibration has its rank's index dropped once, not at every engine step after it
(regression).

Found by the KV-event fuzz audit (scripts/fuzz_kv_events.py): a block 0 that does not recompute (a worker hashing with
another PYTHONHASHSEED than its registration says) fails calibration, and the rank is not warm-able until a block 0
recomputes again. Meanwhile every batch carrying a store failed it again: the rank's epoch stepped, its index was
dropped and its state written to the store at each engine step (20 of each for 20 steps below), for as long as the
worker ran so. A real Router (SQLite store) whose worker's events come from a real PUB (support/kv_flood.py).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from support.kv_flood import live_stream

from fleet.app.testkit.sim_vllm import wire
from fleet.core.block_hash import HashConfig, external_chain

RIGHT = HashConfig("sha256", None, 16)  # what the worker is registered with (live_stream)
WRONG = HashConfig("sha256", "another-seed", 16)  # what it hashes with


def _stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> Any:
    return wire.VllmBlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16,
                                lora_id=None, medium="GPU", lora_name=None)


async def test_a_failed_calibration_drops_the_rank_once_and_a_block_0_that_recomputes_proves_it_again(
        tmp_path: Path) -> None:
    async with live_stream(tmp_path) as live:
        w, rng = live.r.worker("w0"), random.Random(7)
        writes = 0
        real_put = w.epochs.put

        def put(*a: Any, **k: Any) -> Any:
            nonlocal writes
            writes += 1
            return real_put(*a, **k)

        w.epochs.put = put  # type: ignore[method-assign]  # counted, then written as ever
        toks = list(range(100, 148))
        wrong = external_chain(WRONG, toks)
        await live.send([_stored(wrong, toks)])  # block 0 hashed otherwise: calibration fails
        epoch = w.ranks[0].epoch
        assert not w.calibrated and live.value("kvfleet_epoch_bumps_total", {"reason": "calibration"}) == 1
        writes = 0
        for _ in range(20):  # 20 engine steps, each storing the next block of a running request
            await live.send([_stored([rng.getrandbits(64)], list(range(16)), wrong[-1])])
        print(f"20 steps: epoch +{w.ranks[0].epoch - epoch}, {writes} store writes")
        assert w.ranks[0].epoch == epoch  # before the fix: +20, each written to the store (25 writes; now the ticks')
        assert live.value("kvfleet_epoch_bumps_total", {"reason": "calibration"}) == 1
        assert live.blocks() == 0  # nothing indexed while the worker's hashing is unproven
        assert (await live.r.route(toks, "m")).verdict == "COLD"

        # a block 0 that recomputes proves the worker again: its prompt routes WARM, as before
        other = list(range(500, 548))
        await live.send([_stored(external_chain(RIGHT, other), other)])
        assert w.calibrated and live.blocks() == 3
        d = await live.r.route(other, "m")
        assert (d.verdict, d.matched_tokens) == ("WARM", 48)


async def test_a_second_failure_after_a_proof_drops_the_rank_again(tmp_path: Path) -> None:
    """Control: the rank is dropped once per failure, not once for good."""
    async with live_stream(tmp_path) as live:
        w = live.r.worker("w0")
        for n, cfg in enumerate((WRONG, RIGHT, WRONG)):
            toks = list(range(1000 * n, 1000 * n + 32))
            await live.send([_stored(external_chain(cfg, toks), toks)])
        assert not w.calibrated and live.blocks() == 0
        assert live.value("kvfleet_epoch_bumps_total", {"reason": "calibration"}) == 2
