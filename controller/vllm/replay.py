"""Gap repair and replay of one KV-event stream (Subscriber's part, controller/vllm/subscriber.py).

A gap in the stream asks the worker's replay ROUTER, over a DEALER socket, for `[b"", start_seq]` and accepts
3-frame (>= 0.26: topic, seq, payload) or 2-frame (older: seq, payload) replies up to the end marker
(seq = 0xFF*8). One replay stops at an overall deadline, a batch count and a byte total (`StreamLimits`); a replay
over any bound fails like one that got no answer: the gap is unrepaired and the rank fails closed. The digests of
the batches applied from a replay are kept a while, so the same batch arriving live is skipped.
NOTE: a ROUTER that trickles frames just under the per-frame timeout, or floods without an end
marker, used to hold the replay (and the reconcile loop behind it) forever and grow without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from controller.vllm.events import END_SEQ, MAX_SEQ, EventDecodeError, parse_seq

if TYPE_CHECKING:
    from controller.metrics import Metrics
    from controller.vllm.budget import Slicer
    from controller.vllm.subscriber import StreamLimits, StreamSink

log = logging.getLogger("controller.vllm.subscriber")  # the stream's own log, as before the move
REPLAYED_WINDOW = 4096  # seqs behind the last one whose replayed payload a live duplicate may still match


class _OverLimit(Exception):
    """A replay passed one of its StreamLimits bounds (the message says which)."""


class Replays:
    """A stream's replays; Subscriber sets what is declared here in its __init__ and supplies `muted`, `_apply` and
    `_invalidate`."""

    ctx: zmq.asyncio.Context
    replay_endpoint: str | None
    limits: StreamLimits
    metrics: Metrics
    sink: StreamSink
    slicer: Slicer
    _replayed: dict[int, bytes]

    if TYPE_CHECKING:
        def muted(self) -> bool: ...

        async def _apply(self, seq: int, payload: bytes, *, catch_up: bool = False) -> None: ...

        def _invalidate(self, reason: str, seq: int | None, why: str, *, exc_info: bool = False) -> None: ...

    async def _repair(self, last: int, seq: int) -> None:
        self.metrics.kv_event_gaps.inc()
        batches = await self.replay(last + 1) if self.replay_endpoint else None
        got = {s: p for s, p in (batches or []) if last < s < seq}
        if last < 0:
            # first message of a fresh stream: any contiguous tail ending at seq-1 is sound
            tail = []
            for s in range(seq - 1, -1, -1):
                if s not in got:
                    break
                tail.append(s)
            for s in reversed(tail):
                if self.muted():
                    break
                await self._apply(s, got[s])
            self.metrics.kv_event_replays.labels("ok" if batches is not None else "failed").inc()
            return
        # NOTE: the first seq the answer lacks, walked from last + 1: at most len(got) + 1 steps, however far the
        # live seq jumped. It was `min(set(range(last + 1, seq)) - set(got))`: one live frame whose seq jumped by
        # 2**24 held the event loop 7.8 s building that set (every Route and the gRPC server waited), by 2**40 for
        # good, growing until the controller ran out of memory
        missing = next((s for s in range(last + 1, seq) if s not in got), None)
        if missing is None:
            self.metrics.kv_event_replays.labels("ok").inc()
            self.metrics.kv_event_replayed_batches.inc(seq - last - 1)
            for s in range(last + 1, seq):
                if self.muted():
                    break
                await self._apply(s, got[s])
            return
        self.metrics.kv_event_replays.labels("unrepaired").inc()
        if not self.replay_endpoint:
            how = "no replay endpoint is registered to repair it"
        elif batches is None:
            how = f"replay ({self.replay_endpoint}) gave no answer"
        else:
            how = f"replay ({self.replay_endpoint}) no longer holds seq {missing}"
        self._invalidate("gap", seq - 1, f"seqs {last + 1}..{seq - 1} were lost (PUB high-water mark or a "
                         f"reconnect) and {how}")

    def _prune_replayed(self) -> None:
        """Keep the digests of the last REPLAYED_WINDOW seqs up to the last one applied: anything
        older, or newer (the stream's seq went back since), can no longer be a live duplicate."""
        last = self.sink.last_seq()
        for s in [s for s in self._replayed if not last - REPLAYED_WINDOW <= s <= last]:
            del self._replayed[s]

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the replay ROUTER for every buffered batch with seq >= start; None on failure.

        Failure includes passing any `StreamLimits` bound (counted as outcome "over_limit").
        """
        assert self.replay_endpoint is not None
        if not 0 <= start <= MAX_SEQ:
            return None  # an impossible start (e.g. a corrupt persisted seq): replay cannot help
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_msg_bytes)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            return await self._read_replay(sock)
        except _OverLimit as e:
            self.metrics.kv_event_replays.labels("over_limit").inc()
            log.warning("replay from %s abandoned: %s", self.replay_endpoint, e)
            return None
        except (TimeoutError, EventDecodeError, zmq.ZMQError):
            return None
        finally:
            sock.close(0)

    async def _read_replay(self, sock: zmq.asyncio.Socket) -> list[tuple[int, bytes]] | None:
        lim = self.limits
        deadline = time.monotonic() + lim.replay_deadline_s
        out: list[tuple[int, bytes]] = []
        nbytes = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _OverLimit(f"no end marker within {lim.replay_deadline_s}s ({len(out)} batches)")
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), min(lim.replay_timeout_s, left))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise _OverLimit(f"no end marker within {lim.replay_deadline_s}s ({len(out)} batches)") from None
                raise
            body = frames[1:] if frames and frames[0] == b"" else frames
            if len(body) == 3:      # >= 0.26: topic, seq, payload
                seq_f, payload = body[1], body[2]
            elif len(body) == 2:    # older: seq, payload
                seq_f, payload = body[0], body[1]
            else:
                return None
            seq = parse_seq(seq_f, allow_end=True)
            if seq == END_SEQ:
                return out
            nbytes += len(payload)
            await self.slicer.tick()  # NOTE: a ready ZMQ socket answers recv without yielding
            if len(out) >= lim.replay_max_batches or nbytes > lim.replay_max_bytes:
                raise _OverLimit(f"more than {lim.replay_max_batches} batches or {lim.replay_max_bytes} bytes")
            out.append((seq, payload))
