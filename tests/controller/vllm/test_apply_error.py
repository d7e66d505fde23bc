"""A batch the watcher fails to apply (any error, not only a decode error) drops its rank's index at that seq, and
the stream goes on with the next batch; it never freezes the rank or marks the whole worker down (regression).

Found by review, twice (a block hash the hash check refused, a KV connector's block size 0 taken for the pool's):
an error raised while a batch was applied left the batch's seq untaken, so every later live message was a gap whose
replay handed back the same batch, which raised again. The rank ingested nothing more while vLLM's replay buffer
held that batch (10,000 batches), each message cost a whole replay, a traceback and an epoch step, and a tail
poll's raise marked every rank of the worker down. The fault is injected into the real Router's index (it raises on
one batch's block, every time that batch is applied, as those two did); the stand-in's PUB and replay are real. The
bad batch is lost live (the stand-in's simulated PUB drop), so the tail poll is the one that applies it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from support.one_worker import one_worker, synced

from fleet.app.testkit.sim_vllm import wire

POISON = 1 << 45


def _stored(h: int) -> wire.VllmBlockStored:
    return wire.VllmBlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                                medium="GPU", lora_name=None)


async def test_a_batch_that_fails_to_apply_drops_its_rank_once_and_the_stream_goes_on(tmp_path: Path) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        w, pub = r.worker("w0"), sim.publisher
        assert pub is not None
        real = r.index.apply

        def apply(key: Any, ev: Any) -> None:
            if POISON in getattr(ev, "block_hashes", ()):
                raise RuntimeError("injected: this batch cannot be applied")
            real(key, ev)

        r.index.apply = apply  # type: ignore[method-assign]

        def bumps(reason: str) -> float:
            return r.metrics.registry.get_sample_value("kvfleet_epoch_bumps_total", {"reason": reason}) or 0.0

        pub.publish([_stored(7)])
        await synced(r, sim)
        epoch = w.ranks[0].epoch
        pub.drop_next = 1  # the bad batch is the last one and lost live: the tail poll replays it
        bad = pub.publish([_stored(POISON)])
        for _ in range(100):
            if w.ranks[0].seq >= bad or bumps("tail_replay_error"):
                break
            await asyncio.sleep(0.02)
        pub.publish([_stored(1 << 40)])  # and a live batch after it
        await synced(r, sim)
        await asyncio.sleep(0.3)  # a few more tail polls (every 0.1 s)
        print(f"bad batch at seq {bad}: rank at seq {w.ranks[0].seq} of {pub.seq - 1}, epoch +{w.ranks[0].epoch - epoch}"
              f", apply errors {bumps('apply_error'):.0f}, tail replay errors {bumps('tail_replay_error'):.0f}")
        # before the fix: the tail poll raised, every time: the worker marked down (tail_replay_error), the rank
        # stuck at the seq before the bad batch
        assert bumps("tail_replay_error") == 0 and bumps("apply_error") == 1
        assert w.ranks[0].seq == pub.seq - 1 and w.ranks[0].epoch == epoch + 1
        assert r.index.num_blocks(("w0", 0)) == 1  # the batch after the bad one was applied
        assert [row.serving for row in r.workers()] == [True]
