"""OwnedLru and Counts (controller/owned.py): bookkeeping whose cap evicts the largest owner's oldest entry."""

from __future__ import annotations

import random

from controller.owned import Counts, OwnedLru


def test_past_the_cap_the_owner_with_the_most_loses_its_oldest() -> None:
    lru: OwnedLru[str, int] = OwnedLru(4)
    lru.put("b1", "bravo", 1)
    for i in range(10):
        lru.put(f"m{i}", "mallory", i)
    assert len(lru) == 4 and "b1" in lru and lru.get("b1") == 1
    assert [k for k in (f"m{i}" for i in range(10)) if k in lru] == ["m7", "m8", "m9"]
    assert lru.pop("m8") == 8 and lru.pop("m8") is None and lru.get("m8") is None
    lru.put("b1", "bravo", 5)  # a put of a key held replaces it
    assert len(lru) == 3 and lru.get("b1") == 5
    lru.put("x", None, 0)      # no owner: one owner of its own
    assert lru.get("x") == 0 and len(lru) == 4


def test_counts_track_the_largest_under_random_changes() -> None:
    rng, c, ref = random.Random(7), Counts(), {}
    for _ in range(5000):
        k = f"t{rng.randrange(6)}"
        d = 1 if ref.get(k, 0) == 0 or rng.random() < 0.6 else -1
        c.add(k, d)
        ref[k] = ref.get(k, 0) + d
        if not ref[k]:
            del ref[k]
        if ref:
            assert ref[c.largest()] == max(ref.values())
