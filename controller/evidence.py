"""Return rates per (prefix group, stage): how often the router's records of a group come back (controller/demand.py
weighs each conversation's blocks by them). A decayed count of records placed and of records that came back; the
rate is returned / (placed + 1), so a group earns weight only once returns are seen.
"""

from __future__ import annotations

from controller.owned import Counts

Stage = tuple[int, int]  # (group, 0: a first request | 1: a later turn)
MAX_GROUPS = 1 << 14  # evidence kept for this many (group, stage) pairs, then relearned


class Evidence:
    """Decayed counts of records placed and records that came back, per (group, stage); each stage is
    charged to the tenant that began it, and past `max_groups` stages the tenant that began the most
    loses its own (others keep theirs)."""

    def __init__(self, window: float = 64, max_groups: int = MAX_GROUPS) -> None:
        self.decay = 1.0 - 1.0 / window
        self.max_groups = max_groups
        self._placed: dict[Stage, float] = {}
        self._returned: dict[Stage, float] = {}
        self._stages: dict[str, set[Stage]] = {}  # per tenant: the stages it began
        self._count = Counts()  # the same, counted

    def placed(self, st: Stage, tenant: str = "") -> dict[Stage, float]:
        """Count a record placed. Returns the stages whose evidence was dropped to make room (the
        largest tenant's), with the rates they had: theirs are 0 now."""
        dropped: dict[Stage, float] = {}
        if st not in self._placed and len(self._placed) >= self.max_groups:
            top = self._count.largest()
            for gone in self._stages.pop(top):
                dropped[gone] = self.rate(gone)
                del self._placed[gone], self._returned[gone]
                self._count.add(top, -1)
        if st not in self._placed:
            self._stages.setdefault(tenant, set()).add(st)
            self._count.add(tenant, 1)
        self._placed[st] = self._placed.get(st, 0.0) * self.decay + 1.0
        self._returned[st] = self._returned.get(st, 0.0) * self.decay
        return dropped

    def returned(self, st: Stage) -> None:
        if st in self._placed:
            self._returned[st] = min(self._returned[st] + 1.0, self._placed[st])

    def rate(self, st: Stage) -> float:
        """Share of recent records of this (group, stage) that came back (0 without evidence)."""
        p = self._placed.get(st)
        return self._returned[st] / (p + 1.0) if p is not None else 0.0
