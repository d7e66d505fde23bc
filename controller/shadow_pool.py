"""A shadow of each rank's vLLM block pool, fed by the router's own routes and corrected by KV events.

Pure: no I/O, no clock of its own (callers pass `now`). vLLM announces an eviction (BlockRemoved)
only after the engine has scheduled the request that caused it, and the event then crosses ZMQ and
the watcher: a route decided in between trusts blocks that are gone (a stale WARM route). The
router knows what it just sent, so it can replay vLLM's own eviction rule ahead of the events.

The model mirrors vLLM v1's `BlockPool` and `FreeKVCacheBlockQueue` (vllm/v1/core/block_pool.py,
kv_cache_utils.py):

- the pool holds `num_gpu_blocks - 1` usable blocks (block 0 is the null block);
- free blocks wait in one queue in eviction order; at start every block is free and unhashed;
- a request's cache hit `touch`es its blocks: ref_cnt += 1, and a block whose ref_cnt was 0 leaves
  the free queue (it can no longer be evicted);
- only the leading run of cached blocks is a hit: every block after the first miss gets a new block,
  even one whose hash is cached on its own (the pool then maps the hash to both copies);
- its new blocks are popped from the queue's front (`popleft_n`); a popped block that still
  carries a hash is evicted (`_maybe_evict_cached_block`: one BlockRemoved);
- when the request ends its blocks are freed in reverse order (`KVCacheManager.free`): ref_cnt
  -= 1, and those at 0 are appended to the queue's tail, so of one request the tail is evicted
  first and its prefix last;
- `reset_prefix_cache` (AllBlocksCleared) drops every hash and keeps the blocks;
- the scheduler admits waiting requests first come, first served: a request whose blocks do not
  fit (pinned blocks of running requests hold the pool) waits, and every later one waits behind it
  until frees make room. A waiting request will take the queue's front blocks when admitted, so a
  route decided meanwhile must not count on them: `resident_prefix` stops at any block within the
  first (waiting requests' new blocks) of the eviction order ("at risk").

Every block here is named by its hash; unhashed ones (never used, a prompt's partial last block)
are anonymous. Events correct the model (controller/shadow_events.py): a BlockStored it did not
predict takes a slot (the real pool had to), a BlockRemoved it did not predict frees the hash, a
clear or an epoch drop empties it. A predicted eviction is kept until its BlockRemoved confirms it, or for `grace_s` (a
prediction the events never confirm was wrong: the index's view is trusted again).

A Route is only a question until its request reaches the worker, and whether it is tracked is its caller's
choice. An untracked route does not change the pool (`speculate`): only its own tenant's Routes believe what it
would evict. A tracked one is admitted, and every tenant believes its evictions for `unsent_s`, the time its
request needs to reach the engine; past that only its own tenant's, until a BlockStored of one of its new blocks
shows it sent (every tenant's from then). If it ends before that, its admission is undone (`free`).
The router keeps a pool per rank in controller/shadow.py (ShadowPools).

    pool = RankPool(num_gpu_blocks=5)             # 4 usable blocks
    pool.allocate("r1", [11, 12], 1, now=0.0)     # 2 hashed blocks + 1 partial: [] evicted
    pool.free("r1")                               # queue: fresh, partial, 12, 11 (front first)
    pool.allocate("r2", [21, 22], 0, now=1.0)     # fresh, then the partial: [] evicted
    pool.allocate("r3", [31], 0, now=2.0)         # -> [12]: the tail of r1 goes first
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from controller.free_queue import Key
from controller.shadow_blocks import anon_key
from controller.shadow_events import ShadowEvents
from controller.shadow_unsent import Unconfirmed

# NOTE: how long every tenant believes what a tracked route evicts before an event shows its request on the engine:
# the stand-in admitted requests 10-12 ms after their route at the median and 236-270 ms at p95 (docs/routing.md),
# and the events take a few ms more. Past it the route may never have been sent (tracking is the caller's choice):
# before, one tenant's tracked Routes, never sent, hid every tenant's blocks for the 5 s grace.
UNSENT_S = 1.0


class RankPool(ShadowEvents):
    """One rank's pool: requests admitted first come, first served, freed, and corrected by KV events
    (controller/shadow_events.py), over its blocks (controller/shadow_blocks.py) and its unsent tracked routes
    (controller/shadow_unsent.py)."""

    def __init__(self, num_gpu_blocks: int, grace_s: float = 5.0, unsent_s: float = UNSENT_S) -> None:
        super().__init__(num_gpu_blocks)
        self.grace_s, self.unsent_s = grace_s, unsent_s
        # routes not admitted yet (FCFS): their chain, partial blocks, their owner
        self._waiting: OrderedDict[str, tuple[Sequence[int], int, str | None]] = OrderedDict()

    # what the router reads
    def resident_prefix(self, chain: Sequence[int], matched: int, now: float, owner: str = "") -> int:
        """Of the `matched` leading blocks the index holds, how many are not known to be evicted, nor
        at risk from the waiting requests admitted before this one. `owner`'s Route believes the evictions
        that events and tracked routes shown sent predicted, those of other tenants' tracked routes for
        `unsent_s`, and those of its own routes: an untracked Route may never be sent, so another tenant's
        cannot hide this one's blocks (before, 8 of them, never sent, made every other tenant's Route on the
        rank COLD for the 5 s grace), nor can a tracked one that no event shows sent past `unsent_s`."""
        self.expire(now)
        risk, ev = self.at_risk(), self.evicted
        if ev or risk:
            for i, h in enumerate(chain[:matched]):
                if h in risk:
                    return i
                e = ev.get(h)
                if e is not None and (e[1] is None or e[1] == owner
                                      or (type(e) is Unconfirmed and now - e[0] < self.unsent_s)):
                    return i
        return matched

    def at_risk(self) -> set[int]:
        """Hashes the waiting requests will evict when admitted, replayed in their order (`_taken_by`)."""
        return self._taken_by(self._waiting.values()) if self._waiting else set()

    def num_waiting(self) -> int:
        return len(self._waiting)

    # the router's routes
    def allocate(self, route: str, chain: Sequence[int], num_partial: int, now: float,
                 speculative: str | None = None, owner: str | None = None) -> list[int]:
        """A request with these full-block hashes (and `num_partial` unhashed blocks) arrives: it is
        admitted if nothing waits and its blocks fit, else it waits (first come, first served).
        Returns the hashes its admission evicted, in order (none while it waits). `speculative`: the tenant
        of an untracked route (perhaps never sent): see `speculate`. `owner`: the tenant of a tracked route:
        others' Routes believe its evictions for `unsent_s`, then not until a BlockStored of one of its new
        blocks shows the request sent (`stored`); if the route ends before that its admission is undone
        (`free`). None: everyone believes them, from now.

        A request with more blocks than the pool holds is not modelled: vLLM refuses a prompt past
        its max_model_len, whose KV it checks fits the pool at start, so it never runs. NOTE: before,
        one such Route (tracked, never sent) waited here for its TTL: every free block of the rank was
        at risk, so every tenant's match there was 0 (COLD), and each Route walked the whole queue."""
        if route in self._held or route in self._waiting:
            raise ValueError(f"route {route!r} already holds blocks")
        if len(chain) + num_partial > self.num_gpu_blocks - 1:
            return []
        if speculative is not None:
            return self.speculate(chain, num_partial, now, speculative)
        hit = self._hit(chain)
        if self._waiting or (self._need(chain, num_partial, hit) > self.num_free() and self._pinned()):
            self._waiting[route] = (chain, num_partial, owner)
            return []
        return self._admit(route, chain, num_partial, hit, now, owner)

    def speculate(self, chain: Sequence[int], num_partial: int, now: float, owner: str) -> list[int]:
        """What admitting an untracked route would evict, read off the queue's front: the pool does not change
        (its caller may never send it, and a request that is sent is seen through its events). Only `owner`'s
        Routes believe the evictions (`resident_prefix`); one everyone believes already stays so. Returns them.

        NOTE: it used to be admitted and freed at once: its hits moved to the tail, the blocks it took left the
        model and its never-sent blocks joined the tail hashed, so the next tracked route predicted, for every
        tenant, the eviction of blocks vLLM kept (a resident prompt routed COLD)."""
        if len(chain) + num_partial > self.num_gpu_blocks - 1:
            return []
        hit = self._hit(chain)
        if self._waiting or (self._need(chain, num_partial, hit) > self.num_free() and self._pinned()):
            return []  # it would wait: what it takes once admitted is not known now (the waiting are at_risk)
        free, ev = self._free, self.evicted
        touched = {h for h in chain[:hit] if h in free.has}  # its hits leave the queue before it takes blocks
        n = min(len(chain) - hit + num_partial, self._fresh + len(free) - len(touched)) - self._fresh
        out: list[int] = []
        for k in free:
            if n <= 0:
                break
            if k in touched:
                continue
            n -= 1
            if isinstance(k, int):
                out.append(k)
        for g in out:
            e = ev.get(g)
            if e is None or e[1] is not None:
                ev.pop(g, None)
                ev[g] = (now, owner)
        return out

    def _hit(self, chain: Sequence[int]) -> int:
        """The leading blocks cached here: vLLM's prefix hit. A later block cached on its own is not reused."""
        hit, ref, free = 0, self._ref, self._free.has
        while hit < len(chain) and (chain[hit] in ref or chain[hit] in free):
            hit += 1
        return hit

    def _need(self, chain: Sequence[int], num_partial: int, hit: int) -> int:
        """Blocks the request takes out of the free queue: its `hit` leading blocks that are free, and a new
        block for every block after them (and each partial one)."""
        free = self._free.has
        return sum(1 for h in chain[:hit] if h in free) + len(chain) - hit + num_partial

    def _drain(self, now: float) -> list[int]:
        """Admit waiting requests in arrival order while they fit."""
        out: list[int] = []
        while self._waiting:
            route, (chain, num_partial, owner) = next(iter(self._waiting.items()))
            hit = self._hit(chain)
            if self._need(chain, num_partial, hit) > self.num_free() and self._pinned():
                break
            del self._waiting[route]
            out += self._admit(route, chain, num_partial, hit, now, owner)
        return out

    def _admit(self, route: str, chain: Sequence[int], num_partial: int, hit: int, now: float,
               owner: str | None = None) -> list[int]:
        """Admit the request whose `hit` leading blocks (`_hit`, walked once by the caller) are cached here.
        With an `owner`, other tenants' Routes believe what it evicts for `unsent_s`, then once it is shown sent."""
        ref, free, ev = self._ref, self._free, self.evicted
        held: list[int | None] = []
        for k in chain[:hit]:
            self._touch(k)
            held.append(k)
        out: list[int] = []
        popped: list[Key] = []  # NOTE: kept for an owner's route only, to undo it (`_withdraw`)
        unsent = owner is not None
        entry = Unconfirmed((now, owner)) if owner is not None else (now, None)
        num_fresh = self._fresh
        avail = self._fresh + len(free)
        for h in [*chain[hit:], *([None] * num_partial)]:
            if avail <= 0:
                break  # the engine would wait (or preempt); what fits is what is known
            avail -= 1
            if self._fresh:  # NOTE: _popleft inlined: this loop is on the route path, once per new block
                self._fresh -= 1
            else:
                gone = free.popleft()
                if self._front_seq:
                    self._front_seq.pop(gone, None)
                if unsent:
                    popped.append(gone)
                if isinstance(gone, int):
                    out.append(gone)
                    ev.pop(gone, None)
                    ev[gone] = entry
            if h is not None and (h in ref or h in free.has):
                # cached on its own after the hit: vLLM computes it again into the new block (its pool maps
                # one hash to both copies); the copy is held here unhashed
                h = None
            if h is None:
                self._anon_pinned += 1
            else:
                ref[h] = 1
                if ev:
                    ev.pop(h, None)
                if unsent:
                    self._unsent_block[h] = route
            held.append(h)
        self._held[route] = held
        if isinstance(entry, Unconfirmed):
            self._track(route, hit, entry, num_fresh - self._fresh, popped)
        return out

    def free(self, route: str, now: float) -> list[int]:
        """The request ended: its blocks return to the queue's tail, last block first; then waiting
        requests are admitted while they fit. Returns the hashes their admission evicted."""
        if self._waiting.pop(route, None) is not None:  # ended (or dropped) before it was admitted
            return self._drain(now)
        held = self._held.pop(route, [])
        u = self._unsent.pop(route, None)
        if u is not None:  # no event showed it sent: its admission is undone, its hits freed as usual
            self._withdraw(u, held[u.hit:])
            held = held[:u.hit]
        back: list[Key] = []  # to the tail, in this order
        for h in reversed(held):
            if h is None:
                self._anon_pinned = max(0, self._anon_pinned - 1)
                back.append(anon_key())
            elif h in self._ghost:  # its hash was dropped while it ran: the block comes back unhashed
                self._ghost[h] -= 1
                if not self._ghost[h]:
                    del self._ghost[h]
                    back.append(anon_key())
            elif h not in self._ref:
                continue
            elif self._ref[h] > 1:
                self._ref[h] -= 1
            else:
                del self._ref[h]
                back.append(h)
        self._free.extend(back)
        return self._drain(now)

    def expire(self, now: float) -> None:
        ev = self.evicted
        while ev and now - next(iter(ev.values()))[0] >= self.grace_s:
            ev.popitem(last=False)
