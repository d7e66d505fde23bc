"""The block-pool shadow's ledger of tracked routes that no event has shown sent (controller/shadow_pool.py).

A tracked route is admitted at once, and every tenant believes its evictions for `unsent_s`, the time its request
needs to reach the engine; past that only its own tenant's (an `Unconfirmed` entry), until a BlockStored of one of
its new blocks shows it sent (`_sent`: every tenant's from then). If it ends before that, its admission is undone
(`_withdraw`): its new blocks give their slots back at the queue's front, in the order they were taken (`_put_back`).
"""

from __future__ import annotations

from controller.free_queue import Key
from controller.shadow_blocks import RankBlocks, anon_key


class Unconfirmed(tuple[float, str]):
    """A tracked route's predicted eviction before an event showed it sent: (when, owner). Every tenant's Routes
    believe it for `RankPool.unsent_s` after `when`, then its owner's only."""

    __slots__ = ()


class Unsent:
    """A tracked route admitted here whose request no event has shown sent yet: its hit count, the entry its
    evictions share in `evicted`, and what its new blocks took off the queue's front, in order (fresh blocks
    first, then hashes or anon_key names), to undo its admission if it ends unsent; `seq` numbers the first of
    `popped` among every unsent route's (the rest follow it), to put them back in the order they were taken."""

    __slots__ = ("hit", "entry", "num_fresh", "popped", "seq")

    def __init__(self, hit: int, entry: Unconfirmed, num_fresh: int, popped: list[Key], seq: int) -> None:
        self.hit, self.entry, self.num_fresh, self.popped, self.seq = hit, entry, num_fresh, popped, seq


class UnsentRoutes(RankBlocks):
    """A rank's blocks, and its tracked routes admitted with an owner that no event has shown sent."""

    def __init__(self, num_gpu_blocks: int) -> None:
        super().__init__(num_gpu_blocks)
        self._unsent: dict[str, Unsent] = {}  # tracked routes with an owner, admitted, not shown sent
        self._unsent_block: dict[int, str] = {}  # their new hashed blocks -> the route
        self._num_taken = 0  # blocks unsent routes took off the queue's front, ever (`Unsent.seq`)

    def _track(self, route: str, hit: int, entry: Unconfirmed, num_fresh: int, popped: list[Key]) -> None:
        """A tracked route with an owner was admitted: `num_fresh` fresh blocks and then `popped` taken for it."""
        self._unsent[route] = Unsent(hit, entry, num_fresh, popped, self._num_taken)
        self._num_taken += len(popped)

    def _withdraw(self, u: Unsent, new: list[int | None]) -> None:
        """Undo the admission of a tracked route that ended with no event showing it sent (it may never have been):
        each of its `new` blocks gives its slot back as it was taken, at the front, in the order taken; an eviction
        it predicted and nothing confirmed is withdrawn. A slot whose block another route holds too stays with it."""
        ref, ghost, ev = self._ref, self._ghost, self.evicted
        withdrawn = set()
        for g in u.popped:
            if isinstance(g, int) and ev.get(g) is u.entry:
                del ev[g]
                withdrawn.add(g)
        back: list[tuple[Key | None, int]] = []  # (the slot, when it was taken)
        seqs = [*[-1] * u.num_fresh, *range(u.seq, u.seq + len(u.popped))]
        for h, k, seq in zip(new, [*[None] * u.num_fresh, *u.popped], seqs, strict=False):
            if h is None:
                self._anon_pinned = max(0, self._anon_pinned - 1)
            else:
                self._unsent_block.pop(h, None)
                if h in ghost:  # a clear came meanwhile: the slot comes back unhashed, once its last holder ends
                    ghost[h] -= 1
                    if ghost[h]:
                        continue  # NOTE: another route still holds it; `free` gives it back at 0 (not twice)
                    del ghost[h]
                elif ref.get(h, 0) > 1:
                    ref[h] -= 1
                    continue
                elif ref.pop(h, None) is None:
                    continue
            back.append((k, seq))
        for k, seq in reversed(back):
            if k is None:
                self._fresh += 1
                continue
            if isinstance(k, int) and (k not in withdrawn or self.cached(k) or k in ghost):
                k = anon_key()  # its eviction was confirmed (or is past the grace), or it is held again: unhashed
            self._put_back(k, seq)

    def _put_back(self, k: Key, seq: int) -> None:
        """Put an undone route's slot back at the queue's front, behind the slots other undone routes took before it
        (taken in that order, they were in that order). NOTE: at the absolute front, two routes undone in the order
        they came left their blocks reversed ([1, 2, 3, 4] -> [2, 1, 3, 4]): vLLM, which got neither, evicts 1."""
        free, front = self._free, self._front_seq
        before = []
        for j in free:
            if front.get(j, seq) >= seq:
                break
            before.append(j)
        free.add(k)
        free.move_to_front(k)
        for j in reversed(before):
            free.move_to_front(j)
        front[k] = seq

    def _sent(self, route: str) -> None:
        """An event showed the route's request sent: every tenant believes its evictions from now."""
        u = self._unsent.pop(route)
        for h in self._held.get(route, [])[u.hit:]:
            if h is not None:
                self._unsent_block.pop(h, None)
        ev, public = self.evicted, (u.entry[0], None)
        for g in u.popped:
            if isinstance(g, int) and ev.get(g) is u.entry:
                ev[g] = public  # NOTE: in place: its age (and so its expiry) is unchanged
