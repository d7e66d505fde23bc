"""The bound on a RouteStream write's batch, one rule for both sides (the proxy's requests, the controller's answers).

A write carries its first message and, in `more`, at most MAX_BATCH - 1 others, all together within MAX_BATCH_BYTES
(a message alone goes whatever its size). `Batch(first, size).take(nxt)` says whether `nxt` joins; `size(msg)` is
a message's encoded bytes or an upper bound of them. NOTE: protobuf's ByteSize() costs as much as encoding the message
(11 us for a Route of 2,000 tokens), so the proxy sizes a Route by a bound that encodes none of its ids
(`route_bytes`); the controller's answers are small and are sized exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleet.api.kvfleet.v1 import route_pb2

MAX_BATCH = 32  # messages in one write
# NOTE: the controller refuses a message over its receive limit (--grpc-max-receive-bytes, 4 MiB by default) and ends
# the stream: six Routes of 250k tokens asked at once went in one write of 4.5 MB and every call on it failed; an
# answer names every serving rank (about 58 bytes each), so past ~2,200 ranks 32 answers went over the proxy's limit
MAX_BATCH_BYTES = 256 << 10
IN_MORE = 16  # a message's tag and length in `more`: 16 bytes is more than they take


def route_bytes(msg: route_pb2.RouteStreamRequest) -> int:
    """An upper bound of `msg.ByteSize()` for a Route alone (a varint takes at most 5 bytes for a token id, a
    character at most 4 in UTF-8, and 64 bytes hold the tags, lengths, id and flags); any other message exactly."""
    if msg.WhichOneof("op") != "route" or msg.releases:
        return int(msg.ByteSize())
    r = msg.route
    return 5 * len(r.token_ids) + 4 * (len(r.model) + len(r.lora) + len(r.client_salt)) + 64


class Batch:
    """Whether the next message joins a write's batch (see the module doc). `size` may give an upper bound: where the
    bounds together go past MAX_BATCH_BYTES, the batch is measured exactly (`ByteSize()`) before a message is refused."""

    def __init__(self, first: Any, size: Callable[[Any], int]) -> None:
        self.first, self.size = first, size
        self.n, self.bytes = 1, -1  # bytes: an upper bound (-1: not taken yet: only when a message would join)
        self.exact = False  # `bytes` is the batch's encoded size

    def take(self, nxt: Any) -> bool:
        if self.n >= MAX_BATCH:
            return False
        if self.bytes < 0:
            self.bytes = self.size(self.first)
        grown = self.bytes + (int(nxt.ByteSize()) if self.exact else self.size(nxt)) + IN_MORE
        if grown > MAX_BATCH_BYTES and not self.exact:  # the bounds say no: measure (the first holds the others)
            self.bytes, self.exact = int(self.first.ByteSize()), True
            grown = self.bytes + int(nxt.ByteSize()) + IN_MORE
        if grown > MAX_BATCH_BYTES:
            return False
        self.n, self.bytes = self.n + 1, grown
        return True
