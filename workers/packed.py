"""An op log as one bytes value between a fleet and its kernel hosts (a fork's starting point, the child's log).

A host answers every session it holds on one event loop, and Ray turns what a call takes or returns into bytes
there: a fork point's log of 200,000 ops took it about 1.2 s to pickle, and every other tenant's call on the host
waited meanwhile (another tenant's `info`: 1 ms alone, 2.7 s at the median beside one tenant's fork points). So the
host packs a log on the session's tenant's lane (workers/lanes.py) and unpacks one there, and Ray moves bytes.
Between the processes of one fleet only: Ray pickles what they exchange already.
"""

from __future__ import annotations

import pickle
from typing import Any

from fleet.core.oplog import Op


class Packed:
    """A session call's answer that grows with its log (its pieces, its working set), packed on the tenant's lane:
    Ray moves its bytes, and the fleet unpacks it (`FleetRebuild._call`). NOTE: not a bytes subclass: Ray moves
    one as plain bytes, and the fleet could not tell it from an answer."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def of(cls, value: Any) -> Packed:
        return cls(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def unpack(self) -> Any:
        return pickle.loads(self.data)


def pack_ops(ops: list[Op]) -> bytes:
    """`ops` as one bytes value (run it off the host's event loop)."""
    return pickle.dumps(list(ops), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_ops(data: bytes) -> list[Op]:
    """The ops `pack_ops` packed (run it off the host's event loop)."""
    ops = pickle.loads(data)
    if not isinstance(ops, list):
        raise TypeError(f"packed ops: expected a list, got {type(ops).__name__}")
    return ops
