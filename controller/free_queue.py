"""An ordered queue of block keys that CPython's cyclic garbage collector never walks.

The block-pool shadow (controller/shadow_pool.py) keeps each rank's free blocks in eviction order, as many as the
rank's pool holds. An OrderedDict did it, but an OrderedDict is always tracked by the collector and walked key by
key: 64 ranks of 100,000 cached blocks made every full collection about 190 ms, every Route waiting on the event
loop stalled meanwhile (docs/routing.md, "The cyclic garbage collector and the index"). Here the keys (block
hashes, ints, or str names of unhashed blocks) are linked in a ring by two plain dicts, next and previous, holding
only ints and strs: the collector never tracks them. Every operation is O(1); a walk from the front is O(keys
walked); the memory is about an OrderedDict's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, KeysView

Key = int | str  # a block's hash, or the name of an unhashed block (never "")
_END = ""  # the ring's own link: after it the front, before it the tail


class FreeQueue:
    """Keys in order, front first: `add` at the tail, `move_to_front`, `popleft`, `remove` anywhere."""

    __slots__ = ("_next", "_prev", "has")

    def __init__(self) -> None:
        self._next: dict[Key, Key] = {_END: _END}
        self._prev: dict[Key, Key] = {_END: _END}
        # NOTE: `k in q.has` is `k in q` at C speed, for the shadow's per-block loops (a Route asks it for every
        # block of its prompt); it also holds "", the ring's own link, which no caller asks about
        self.has: KeysView[Key] = self._next.keys()

    def __len__(self) -> int:
        return len(self._next) - 1

    def __bool__(self) -> bool:
        return len(self._next) > 1

    def __contains__(self, k: object) -> bool:
        return k is not _END and k in self._next

    def __iter__(self) -> Iterator[Key]:
        """Front to back. The queue must not change during the walk (as with an OrderedDict)."""
        nxt = self._next
        k = nxt[_END]
        while k is not _END:
            yield k
            k = nxt[k]

    def add(self, k: Key) -> None:
        """At the tail; a key already queued keeps its place (as `od[k] = None` does)."""
        nxt, prv = self._next, self._prev
        if k not in nxt:
            tail = prv[_END]
            nxt[tail] = prv[_END] = k
            prv[k], nxt[k] = tail, _END

    def extend(self, keys: Iterable[Key]) -> None:
        """`add` each in turn, linked in bulk (a stored event's blocks, a finished request's)."""
        prv = self._prev
        new = [k for k in dict.fromkeys(keys) if k not in prv]  # NOTE: a key twice in `keys` goes in once, first
        if not new:
            return
        before = [prv[_END], *new[:-1]]
        self._next.update(zip(before, new, strict=True))
        prv.update(zip(new, before, strict=True))
        self._next[new[-1]], prv[_END] = _END, new[-1]

    def remove(self, k: Key) -> None:
        """Raises KeyError if `k` is not queued."""
        if k is _END:
            raise KeyError(k)
        n, p = self._next.pop(k), self._prev.pop(k)
        self._next[p], self._prev[n] = n, p

    def move_to_front(self, k: Key) -> None:
        """Raises KeyError if `k` is not queued."""
        self.remove(k)
        nxt, prv = self._next, self._prev
        head = nxt[_END]
        nxt[_END] = prv[head] = k
        prv[k], nxt[k] = _END, head

    def popleft(self) -> Key:
        """The front key, taken off. Raises KeyError when empty."""
        nxt, prv = self._next, self._prev
        k = nxt[_END]
        if k is _END:
            raise KeyError("popleft(): the queue is empty")
        n = nxt.pop(k)
        del prv[k]
        nxt[_END], prv[n] = n, _END
        return k

    def clear(self) -> None:
        for d in (self._next, self._prev):  # in place: `has` stays a view of _next
            d.clear()
            d[_END] = _END
