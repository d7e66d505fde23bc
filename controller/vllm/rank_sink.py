"""One DP rank's KV-event stream of a worker: where it is published (`rank_endpoint`) and where its batches go
(`RankSink`: the Subscriber's sink, charging the worker's event budget; Worker's part, controller/vllm/watcher.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.vllm.budget import STEP_COST
from controller.vllm.events import EventBatch

if TYPE_CHECKING:
    from controller.vllm.watcher import Worker


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's per-DP-rank endpoint: TCP port + rank (inproc/ipc get a _dp<rank> suffix)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class RankSink:
    """One (worker, dp_rank) stream's sink (controller/vllm/subscriber.py StreamSink): the worker's rank state, budget and
    batches."""

    def __init__(self, worker: Worker, rank: int) -> None:
        self.w, self.r = worker, rank

    def last_seq(self) -> int:
        return self.w.ranks[self.r].seq

    async def on_batch(self, seq: int, batch: EventBatch) -> None:
        await self.w.on_batch(self.r, seq, batch)

    def muted(self) -> bool:
        return self.w.guard.faulty()

    def refuse(self, seq: int, n: int, what: str = "") -> None:
        """A message refused undecoded (budget.refusal: too many events, or too many bytes for them): faulty."""
        self.w.guard.trip(n)
        self.w._trip(self.r, seq, n, what)

    def admit(self, seq: int, cost: int) -> bool:
        """A message's cost before it is decoded (budget.message_cost), or its blocks' once decoded (budget.blocks_cost);
        False: faulty, not applied."""
        if self.w.guard.admit(self.r, cost, 0):
            return True
        self.w._trip(self.r, seq, 0, f"a message costing {cost:,} (1 plus 1 per 4 KiB, then 1 per 4 block hashes)")
        return False

    def skip(self, seq: int) -> None:
        self.w.ranks[self.r] = self.w.ranks[self.r].at_seq(seq)

    def resume(self, seq: int) -> None:
        """The stream goes on at `seq` after a faulty hold, nothing sent meanwhile read (Subscriber._sit_out). An
        AllBlocksCleared the rank awaited (fence "clear") may have been among it: Worker.lift_settled.
        NOTE: a reset or sleep the controller drove while the worker was faulty left the fence up for good, the
        worker serving and always COLD until the next clear."""
        self.w.ranks[self.r] = self.w.ranks[self.r].at_seq(seq - 1)
        if self.w.ranks[self.r].fence == "clear":
            self.w.resumed.add(self.r)
            self.w.lift_settled(self.r)

    def on_invalidate(self, reason: str, seq: int | None) -> None:
        """An invalidation steps the epoch and writes the store: it costs STEP_COST of the rank's budget.
        NOTE: uncharged, a flood of seq resets stepped the epoch 11,709 times in 4 s, never faulty."""
        if not self.w.guard.admit(self.r, STEP_COST, 0):
            self.w._trip(self.r, self.w.ranks[self.r].seq if seq is None else max(seq, self.w.ranks[self.r].seq), 0,
                         f"a stream invalidation ({reason}) costing {STEP_COST:,}")
            return
        self.w.on_stream_invalidate(self.r, reason, seq)
