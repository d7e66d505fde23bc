"""The ledger's entries: a Piece is one span of a session's KV cache (system prompt, message, tool result by
CAS ref, model output) and its state; `drop` takes one out of the cache (fleet/core/context.py keeps the
ledger, fleet/core/ledger.py replays it). Pure core."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fleet.core.oplog import KINDS

RESIDENT, EVICTED, QUARANTINED, SHIFTED = "resident", "evicted", "quarantined", "shifted"


class Tokenizer(Protocol):
    def encode(self, text: str | bytes) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Piece:
    """One ledger entry. `start`/`length` locate its tokens in the KV cache while it is resident.

    state: resident (KV valid) | evicted (dropped, bytes elsewhere) | quarantined (held out) |
           shifted (a reposition eviction moved it; its layer>=1 KV still carries the evicted span).
           A resident piece whose tokens the live session no longer holds at its span reads as
           "KV cache lost" in the working set (`is_resident`); no state marks it (docs/kernel.md).
    """

    piece_id: int
    kind: str
    start: int
    length: int
    tenant: str
    tokens: tuple[int, ...]
    ref: str | None = None
    role: str | None = None
    state: str = RESIDENT

    def __post_init__(self) -> None:
        assert self.kind in KINDS and self.length == len(self.tokens), self

    @property
    def end(self) -> int:
        return self.start + self.length


def drop(pieces: list[Piece], live: list[int], index: int, gone: str, survivor: Callable[[Piece], str]) -> None:
    """Mark `pieces[index]` (in the KV cache) `gone`, and move the pieces after it in the cache down by its
    length, each in the state `survivor(piece)`; `live`: the indices in `pieces` of those in the KV cache (resident
    or shifted), in order, less `index` afterwards. NOTE: only the pieces in the cache are visited (`live`): every
    piece ever appended was, evicted ones included, so a log of n appends and evictions cost O(n^2) to replay
    (100,000 pairs: 408 s for a rebuild on a host; tests/fleet/test_context_evict_cost.py)."""
    p = pieces[index]
    pieces[index] = dataclasses.replace(p, state=gone)
    at = bisect.bisect_left(live, index)
    assert live[at] == index, (index, live[at:at + 1])
    for i in live[at + 1:]:
        q = pieces[i]
        pieces[i] = dataclasses.replace(q, start=q.start - p.length, state=survivor(q))
    del live[at]
