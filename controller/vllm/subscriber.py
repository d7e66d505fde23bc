"""ZMQ SUB for one (worker, dp_rank) KV-event stream, with gap repair over a DEALER replay socket
(controller/vllm/replay.py).

Frames: [topic, seq (>= 8 bytes, first 8 big-endian), payload]. The subscriber keeps the stream
contiguous: a gap is repaired by a replay from the worker's replay ROUTER.
A gap that replay does not fill, a seq going backwards (publisher restart), a decode error or an
unknown event type is reported to the sink as an invalidation; the sink then fails closed.

Everything a worker sends is bounded (`StreamLimits`): a live frame larger than `max_msg_bytes`
is dropped by ZMQ itself (ZMQ_MAXMSGSIZE; the peer is disconnected and the gap shows on the next
frame), and so is one replay (controller/vllm/replay.py).
Events are applied in slices that yield to the event loop (controller/vllm/budget.py), and a sink
that is muted (its worker overran its event budget: faulty) gets only the seqs, nothing decoded,
and no replay is asked for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from controller.metrics import Metrics
from controller.vllm.budget import Slicer, blocks_cost, message_cost, refusal
from controller.vllm.events import EventBatch, EventDecodeError, UnknownEventType, decode_batch, parse_seq
from controller.vllm.ratelog import RateLog
from controller.vllm.replay import Replays
from fleet.core.errors import InvalidArgument

log = logging.getLogger(__name__)
# while its worker is faulty, a stream's socket is closed; every MUTED_POLL_S the subscriber looks whether the hold
# has ended (then it connects again). NOTE: read at full speed, a faulty worker's flood of 65,000 messages a second
# cost other tenants' Routes 6.9 ms at the median (0.7 without it); read one message per 10 ms, the rest queued in
# the socket up to ZMQ's RCVHWM (1,000 messages of up to max_msg_bytes each): 250 of 7.6 MiB held 1.46 GiB
MUTED_POLL_S = 0.05
# a SUB socket's queue holds at most this many bytes of messages (RCVHWM, in messages of up to max_msg_bytes; at
# least 4): past it ZMQ stops reading the connection, so the backlog waits in the worker's own send queue (vLLM's
# PUB keeps up to 100,000 messages) and the kernel's buffers, not in the controller. NOTE: at ZMQ's default (1,000
# messages) a burst of 250 messages of 7.6 MiB took the controller's RSS up by 703 MiB before one was read
QUEUE_BYTES = 64 << 20
def _digest(payload: bytes) -> bytes:
    """What a replayed payload is remembered by: the duplicate check only needs equality."""
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Bounds on what one worker's KV-event stream may cost the controller.

    Defaults: vLLM keeps `buffer_steps` = 10,000 batches for replay and sets its replay SNDHWM to
    2 * (buffer_steps + 1), so a whole honest replay fits `replay_max_batches`.
    """

    replay_timeout_s: float = 1.0  # silence between two replay frames
    replay_deadline_s: float = 10.0  # one whole replay, first request to end marker
    replay_max_batches: int = 20_002
    replay_max_bytes: int = 256 << 20
    # one ZMQ message (ZMQ_MAXMSGSIZE on SUB and DEALER). A batch is one engine step's events: ~100 KiB
    # at vLLM's default step sizes (budget.MSG_BASE_BYTES). NOTE: was 64 MiB, ~1 s of decoding each.
    max_msg_bytes: int = 8 << 20
    max_resident_blocks: int = 1 << 20  # per rank, when its /metrics gives no num_gpu_blocks
    max_events_per_s: int = 20_000  # per rank: the event budget's refill (controller/vllm/budget.py)
    max_event_burst: int = 200_000  # per rank: the budget's depth (a full honest catch-up replay fits)
    faulty_hold_s: float = 60.0  # a worker over its budget is faulty (not serving) this long
    # one worker's ranks whose tail polls run at once (each replay may hold up to replay_max_bytes while it is read)
    max_tail_polls: int = 4

    def __post_init__(self) -> None:
        for name in ("replay_timeout_s", "replay_deadline_s", "faulty_hold_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not v > 0:
                raise InvalidArgument(f"{name} must be > 0 seconds, got {v!r}")
        for name in ("replay_max_batches", "replay_max_bytes", "max_msg_bytes", "max_resident_blocks",
                     "max_events_per_s", "max_event_burst", "max_tail_polls"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {v!r}")


class StreamSink(Protocol):
    """Where a stream's batches go. `on_batch` may be a coroutine function (it then yields while it
    applies a large batch); a sink may also have `muted() -> bool` and `skip(seq)`: while muted, it
    is told only the seq of each live batch, and no replay is asked for it; `admit(seq, cost) -> bool`:
    charged each message's budget.message_cost before it is decoded (False: not decoded), and its
    budget.blocks_cost once decoded, but in a restart's catch-up (False: not applied); and
    `refuse(seq, events, what)`: told of a message refused undecoded (budget.refusal). A sink that mutes
    also has `resume(seq)`: the stream goes on at `seq` after a hold, nothing sent meanwhile read."""

    def last_seq(self) -> int: ...

    def on_batch(self, seq: int, batch: EventBatch) -> Any: ...

    def on_invalidate(self, reason: str, seq: int | None) -> None: ...


class Subscriber(Replays):
    """Reads one PUB endpoint; calls the sink in strict seq order."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay: str | None, sink: StreamSink,
                 metrics: Metrics, *, topic: bytes = b"", limits: StreamLimits | None = None, label: str = "") -> None:
        self.ctx, self.endpoint, self.replay_endpoint = ctx, endpoint, replay
        self.label = label or endpoint  # who the stream is, in log lines (the watcher: "worker W rank R")
        self.lines = RateLog(log)
        self.sink, self.metrics, self.topic = sink, metrics, topic
        self.limits = limits or StreamLimits()
        # seq -> digest of a batch applied from a replay, so the same batch arriving live is skipped.
        # NOTE: this used to keep the payloads themselves: every tail poll's answer (up to
        # replay_max_bytes) stayed held until 4,096 seqs later (six polls: +1,440 MiB).
        self._replayed: dict[int, bytes] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closing = False
        self._fresh = False  # sitting out a hold, or connected again after it with no message read yet
        self.slicer = Slicer()

    def muted(self) -> bool:
        m = getattr(self.sink, "muted", None)
        return bool(m()) if m is not None else False

    def _connect(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_msg_bytes)
        sock.setsockopt(zmq.RCVHWM, max(4, QUEUE_BYTES // self.limits.max_msg_bytes))
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(self.endpoint)
        return sock

    async def start(self, catch_up_from: int | None = None) -> bool:
        """Connect; with `catch_up_from`, first rebuild by replay from that seq (controller restart).

        Returns:
            True when a catch-up replay was answered and every batch of it read (the sink not muted meanwhile).
        """
        if self._closing:  # stopped before it began: a socket opened now would never be closed
            return False
        self._sock = self._connect()
        caught_up = False
        if catch_up_from is not None and self.replay_endpoint:
            batches = await self.replay(catch_up_from)
            self.metrics.kv_event_replays.labels("catch_up" if batches is not None else "failed").inc()
            caught_up = batches is not None
            prev: int | None = None
            for seq, payload in batches or []:
                # NOTE: applied whatever came, a reply with a hole (a batch missing between two it holds) skipped the
                # missing batch's removals and clears: a block evicted there stayed WARM. Stopped at the hole, the
                # live stream's next message is a gap, repaired by replay or failed closed (controller/vllm/replay.py)
                # NOTE: a batch older than asked (vLLM's replay sends seq >= start only) was applied too: batches from
                # before the rank's epoch began, where an old AllBlocksCleared could lift the fence "clear" of a sleep
                # this controller drove and the old stores after it index blocks the worker's sleep had discarded
                if self.muted() or seq < catch_up_from or (prev is not None and seq != prev + 1):
                    caught_up = False
                    break
                prev = seq
                self._replayed[seq] = _digest(payload)
                await self._apply(seq, payload, catch_up=True)
            del batches
            self._prune_replayed()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return caught_up and not self.muted()

    async def stop(self) -> None:
        self._closing = True  # NOTE: a cancel swallowed by asyncio.wait_for (3.11) still ends _run
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sock is not None:
            self._sock.close(0)

    async def _run(self) -> None:
        while not self._closing:
            sock = self._sock
            assert sock is not None  # closed only while it sits out, and then opened again (or closing)
            frames = await sock.recv_multipart()
            await self.slicer.tick()  # a live flood yields too (even muted: skip decodes nothing)
            try:
                async with self._lock:
                    await self.handle(frames)
            except Exception:  # the watcher must outlive any bad frame
                log.exception("KV event handling failed for %s", self.endpoint)
                try:
                    self.sink.on_invalidate("decode_error", None)
                except Exception:  # NOTE: raising here would end this task and freeze the stream
                    log.exception("invalidation after a bad frame failed for %s", self.endpoint)
            if self.muted():
                await self._sit_out()

    async def _sit_out(self) -> None:
        """A faulty worker's stream: its socket is closed until the hold ends, then opened anew. Its index was
        dropped when it turned faulty, so nothing it sent meanwhile is needed: the first message after the hold
        takes the stream from its seq, with no repair and no tail poll before it."""
        assert self._sock is not None
        self._fresh = True  # from now until the first message after the hold: no tail poll (see poll_tail)
        self._sock.close(0)
        self._sock = None
        while self.muted() and not self._closing:
            await asyncio.sleep(MUTED_POLL_S)
        if not self._closing:
            self._sock = self._connect()

    def _invalidate(self, reason: str, seq: int | None, why: str, *, exc_info: bool = False) -> None:
        """Tell the sink the stream failed at `seq`, and log why (RateLog): a restart (seq reset) at INFO."""
        level = logging.INFO if reason == "seq_reset" else logging.WARNING
        self.lines.log(level, reason, "KV events of %s (%s): %s%s: %s; its index is dropped until new events prove it "
                       "again", self.label, self.endpoint, reason, "" if seq is None else f" at seq {seq}", why,
                       exc_info=exc_info)
        self.sink.on_invalidate(reason, seq)

    async def handle(self, frames: list[bytes]) -> None:
        """One live message, in order: duplicate check, reset, gap repair, then apply."""
        if len(frames) < 3:
            self.metrics.kv_event_decode_errors.inc()
            if not self.muted():  # a faulty worker's index is gone already: nothing to invalidate
                self._invalidate("decode_error", None, f"a message of {len(frames)} frames (vLLM sends 3: topic, seq, "
                                 "payload)")
            return
        try:
            seq = parse_seq(frames[1])
        except EventDecodeError as e:
            self.metrics.kv_event_decode_errors.inc()
            if not self.muted():
                self._invalidate("decode_error", None, str(e))
            return
        if self.muted():
            self.sink.skip(seq)  # type: ignore[attr-defined]  # muted() is only True for a sink that has skip
            return
        fresh, self._fresh = self._fresh, False
        last = self.sink.last_seq()
        if seq <= last:
            if seq in self._replayed and self._replayed[seq] == _digest(frames[2]):
                return  # already applied from a replay
            self._replayed.clear()
            self._invalidate("seq_reset", None, f"seq {seq} after {last}: a new publisher (the worker restarted), or a "
                             "repeated message")
            last = -1
        if seq > last + 1:
            if fresh:  # back from a hold (_sit_out): what came between went to an index since dropped
                self.sink.resume(seq)  # type: ignore[attr-defined]  # only a sink that mutes sits out
            else:
                await self._repair(last, seq)
        await self._apply(seq, frames[2])

    async def poll_tail(self) -> int:
        """Ask replay for anything after the last seq (a lost final batch shows no gap until the
        next one arrives); apply a contiguous run. Returns the number of batches recovered."""
        if not self.replay_endpoint or self.muted() or self._fresh:
            return 0
        async with self._lock:
            if self._fresh:  # NOTE: checked before the lock only, a poll between a hold's end and the first
                return 0     # message after it replayed the hold's batches, and that message then skipped the rest
            last = self.sink.last_seq()
            batches = await self.replay(last + 1)
            n = 0
            for seq, payload in batches or []:
                # a fresh stream (-1) may start anywhere: a suffix of the stream is sound
                if (seq != self.sink.last_seq() + 1 and self.sink.last_seq() >= 0) or self.muted():
                    break
                self._replayed[seq] = _digest(payload)
                await self._apply(seq, payload)
                n += 1
            del batches
            if n:
                self.metrics.kv_event_replays.labels("tail").inc()
                self.metrics.kv_event_replayed_batches.inc(n)
            self._prune_replayed()
            return n

    async def _apply(self, seq: int, payload: bytes, *, catch_up: bool = False) -> None:
        await self.slicer.tick()
        if self.muted():
            self.sink.skip(seq)  # type: ignore[attr-defined]
            return
        bad = refusal(payload)
        refuse = getattr(self.sink, "refuse", None)
        if bad is not None:  # never decoded: one decode is one uninterruptible call (budget.peek_num_events)
            self.metrics.kv_event_decode_errors.inc()
            if refuse is not None:
                refuse(seq, *bad)
            else:
                self._invalidate("decode_error", seq, bad[1] or f"a message announcing {bad[0]} events")
            return
        admit = getattr(self.sink, "admit", None)
        if admit is not None and not admit(seq, message_cost(len(payload))):
            return  # over the rank's budget before decoding: the sink made its worker faulty
        try:
            batch = decode_batch(payload)
        except UnknownEventType as e:
            self.metrics.kv_event_decode_errors.inc()
            self._invalidate("unknown_event_type", seq, f"{e} (a vLLM newer than this controller knows?)")
            return
        except EventDecodeError as e:
            self.metrics.kv_event_decode_errors.inc()
            self._invalidate("decode_error", seq, f"{e} (payload of {len(payload):,} bytes)")
            return
        if not catch_up and admit is not None and not admit(seq, blocks_cost(batch)):
            return  # its blocks are over the rank's budget: the sink made its worker faulty
        self.metrics.kv_event_batches.inc()
        try:
            done = self.sink.on_batch(seq, batch)
            if inspect.isawaitable(done):
                await done
        except Exception as e:
            # NOTE: raised out of here, the batch's seq was left untaken (each later message a gap whose replay raised
            # again), a tail poll's raise marked every rank of the worker down, a catch-up's ended the worker's start
            self._invalidate("apply_error", seq, f"applying it failed: {e!r}", exc_info=True)
