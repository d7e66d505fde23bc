"""The block-pool shadow keeps its free blocks where CPython's cyclic collector never walks them.

Each rank's shadow queues as many free blocks as the rank's pool holds. In an OrderedDict (always tracked, walked
key by key) 64 ranks of 100,000 cached blocks made every full collection about 190 ms, every Route waiting meanwhile
(docs/routing.md, "The cyclic garbage collector and the index"); controller/free_queue.py keeps them in plain
dicts of ints and strs, which the collector never tracks.
"""

from __future__ import annotations

import gc
import random
from collections import OrderedDict

import pytest

from controller.free_queue import FreeQueue
from controller.shadow_pool import RankPool


def walked(root: object) -> int:
    """How many references a collection that reaches `root` follows: those of every tracked object reachable from
    it through tracked objects (an untracked one is passed over, whatever it holds), classes left out."""
    seen: set[int] = set()
    stack, n = [root], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or not gc.is_tracked(o) or isinstance(o, type):
            continue
        seen.add(id(o))
        refs = gc.get_referents(o)
        n += len(refs)
        stack.extend(refs)
    return n


def test_free_blocks_are_not_walked_by_the_collector() -> None:
    p = RankPool(num_gpu_blocks=1001)
    for i in range(0, 800, 16):
        p.stored(range(10_000 + i, 10_016 + i), now=0.0, parent=None)  # 800 cached blocks, all free
    p.allocate("r1", [10_000, 10_001, 42, 43], 1, now=1.0)  # a hit, two new blocks and a partial one
    p.free("r1", now=2.0)  # back to the tail: hashes and an unhashed block
    assert p.num_free() == 1000 and p.queue()[-5:] == [None, 43, 42, 10_001, 10_000]  # last block first
    assert walked(p) < 100, "the collector walks the shadow's free blocks one by one"


def test_free_queue_keeps_an_ordered_dicts_order() -> None:
    rng = random.Random(7)
    for _ in range(300):
        q, od = FreeQueue(), OrderedDict[int, None]()
        for _ in range(150):
            op, keys = rng.random(), list(od)
            if op < 0.3:
                k = rng.randrange(40)
                q.add(k)
                od.setdefault(k, None)  # a key already queued keeps its place
            elif op < 0.4:
                ks = [rng.randrange(40) for _ in range(rng.randrange(4))]  # perhaps one twice
                q.extend(ks)
                for k in ks:
                    od.setdefault(k, None)
            elif op < 0.55 and keys:
                k = rng.choice(keys)
                q.move_to_front(k)
                od.move_to_end(k, last=False)
            elif op < 0.75 and keys:
                k = rng.choice(keys)
                q.remove(k)
                del od[k]
            elif op < 0.97 and keys:
                assert q.popleft() == od.popitem(last=False)[0]
            elif op >= 0.99:
                q.clear()
                od.clear()
            k = rng.randrange(40)
            assert list(q) == list(od) and len(q) == len(od) and (k in q) == (k in od)


def test_free_queue_keeps_nothing_of_what_left() -> None:
    """Under churn (the front staying put while keys behind it come and go) it holds what is queued and no more."""
    q, od = FreeQueue(), OrderedDict[int, None]()
    for k in range(10):
        q.add(k)
        od[k] = None
    for k in range(10, 20_000):
        q.extend([k])
        od[k] = None
        q.remove(k - 5)
        del od[k - 5]
    assert list(q) == list(od) == [0, 1, 2, 3, 4, *range(19_995, 20_000)]
    assert len(q._next) == len(q._prev) == len(q) + 1  # the ring's own link and one entry a key
    with pytest.raises(KeyError):
        q.remove(7)
    q.clear()
    with pytest.raises(KeyError):
        q.popleft()
