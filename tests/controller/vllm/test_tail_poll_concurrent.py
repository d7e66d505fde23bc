"""A DP worker's tail polls run side by side: a rank whose replay endpoint does not answer holds only its own poll,
never another rank's recovery of a lost final batch (regression).

Found by review: the watcher's tail loop polled a worker's ranks one after another, each poll waiting up to its
StreamLimits (1 s of silence by default). A rank whose replay endpoint went silent held every later rank's poll, and
the next round's of every earlier one, for that long each round: a lost last batch (nothing after it shows the gap)
stayed unapplied, its blocks routed COLD, for as long as the silent rank's timeout. The catch-up at start already
ran side by side (test_catch_up_concurrent.py). Real stand-in (`kvfleet sim-vllm`, rank 0: its simulated PUB drop
loses the batch, its real replay ROUTER has it), a real Router on SQLite, and a real ZMQ ROUTER for rank 1's replay
that holds the tail polls' requests (tests/support/held_replay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import zmq.asyncio
from support.dp_front import free_pair
from support.held_replay import HELD, HeldReplay

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store


def _stored(h: int) -> wire.VllmBlockStored:
    return wire.VllmBlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                                medium="GPU", lora_name=None)


async def _until(pred, what: str, n: int = 500) -> None:  # type: ignore[no-untyped-def]
    for _ in range(n):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(what)


async def test_a_rank_whose_replay_is_silent_holds_no_other_ranks_tail_poll(tmp_path: Path) -> None:
    events, replay = free_pair(), free_pair()  # rank r's at port + r, as vLLM binds them
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64), kv_events_port=events,
                                  replay_port=replay)).start()
    ctx = zmq.asyncio.Context()
    held = HeldReplay(ctx, 1, port=replay + 1)  # rank 1's replay: answers only while `released` is set
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, http_timeout_s=10.0, stream=HELD))
    pub = sim.publisher
    assert pub is not None
    try:
        await r.start()
        held.released.set()  # the registration's catch-up of rank 1 is answered (an empty replay)
        await r.register_worker(WorkerSpec("w", sim.url, sim.kv_events, sim.replay, "m", dp_ranks=2))
        w = r.worker("w")
        pub.publish([_stored(7)])
        await _until(lambda: w.applied_seq(0) == pub.seq - 1, "rank 0 never ingested its first batch")
        held.released.clear()
        seen = held.requests
        await _until(lambda: held.requests > seen, "rank 1's tail poll never asked")  # now held, for up to 60 s

        def tails() -> float:
            return r.metrics.registry.get_sample_value("kvfleet_kv_event_replays_total", {"outcome": "tail"}) or 0.0

        before = tails()
        pub.drop_next = 1  # rank 0's last batch is lost live: only its tail poll can bring it
        lost = pub.publish([_stored(8)])
        # before the fix: rank 0's next poll waited for rank 1's held one (60 s here; 1 s of silence by default)
        await _until(lambda: w.applied_seq(0) >= lost, f"rank 0 stuck at seq {w.ranks[0].seq} < {lost} behind rank 1's "
                     "silent replay", n=250)
        assert tails() == before + 1  # brought by a tail poll, not a live message
        assert not held.released.is_set() and held.requests == seen + 1  # control: rank 1's poll is still out
    finally:
        held.released.set()
        with contextlib.suppress(Exception):
            await r.stop()
        await held.close()
        ctx.term()
        await sim.stop()
        store.close()


class _Held:
    """A rank's stream whose tail poll waits until `go` is set (its replay endpoint silent until then)."""

    def __init__(self, go: asyncio.Event) -> None:
        self.go, self.polls, self.out = go, 0, 0

    async def poll_tail(self) -> int:
        self.polls, self.out = self.polls + 1, self.out + 1
        try:
            await self.go.wait()
        finally:
            self.out -= 1
        return 0


async def test_tail_polls_are_bounded_and_one_at_a_time_per_rank() -> None:
    from controller.vllm.tail_polls import TailPolls

    go, ended = asyncio.Event(), []
    ranks = [(r, _Held(go)) for r in range(4)]
    polls = TailPolls(2, lambda r, e: ended.append((r, e)))
    for _ in range(3):  # three ticks while every replay is silent
        polls.start(ranks)
        await asyncio.sleep(0.05)
    assert [s.polls for _, s in ranks] == [1, 1, 0, 0]  # at most 2 at once; a rank still out gets no second poll
    go.set()
    await _until(lambda: len(ended) == 4, "the held polls never ended")
    assert sorted(ended) == [(r, None) for r in range(4)] and all(s.out == 0 for _, s in ranks)
    polls.start(ranks)
    await _until(lambda: len(ended) == 8, "the next tick's polls never ran")
    assert [s.polls for _, s in ranks] == [2, 2, 2, 2]
    await polls.stop()
