"""The long-prompt hashing lane: a Route's prompts over INLINE_HASH_TOKENS tokens in all are checked and hashed in
the loop's default thread pool, not on the event loop, at most HASH_THREADS_PER_TENANT of one tenant's at a time;
its others wait their turn, holding at most LONG_WAIT_TOKENS_PER_TENANT tokens (past it, RESOURCE_EXHAUSTED).

Router._ordered (controller/route_phases.py, phase 1 of a route) hands such a route to `HashLane.ordered`; the servicer
(controller/servicers/route.py) reads INLINE_HASH_TOKENS to keep a long prompt's ids as they came.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

from controller.batch_route import Hashed
from controller.keyed_slots import KeyedSlots
from controller.ordering import CandidateOrder, Ordering, checked_chains, seed_of
from controller.tenant_branches import TenantBranches
from fleet.core.errors import ResourceExhausted

# NOTE: a prompt of at most this many tokens is checked and hashed on the event loop (about 0.9 ms at 4,096
# tokens, 1.8 ms at 8,192, one sha256 block chain); a longer one in a thread. The thread buys nothing below
# this: hashing holds the GIL, so the loop waits for it either way (up to the 5 ms switch interval), and
# the hop itself cost 0.1-0.4 ms a route (measured: 53 us inline against 214 us via the thread at 200 tokens)
INLINE_HASH_TOKENS = 8192
# a tenant's longer prompts hashed at once in the shared thread pool (more buy nothing: hashing holds the GIL);
# its others wait their turn, so one tenant's flood of long prompts leaves the pool's other threads to the rest
HASH_THREADS_PER_TENANT = 2
# a tenant's longer prompts waiting for one of those threads hold at most this many tokens in all: eight prompts of the
# default --max-route-tokens (1,048,576), that is 4 x HASH_THREADS_PER_TENANT waiting beyond those hashing, about four
# rounds of its hashing. One that would pass it is refused (RESOURCE_EXHAUSTED) unless none waits. Counted in tokens,
# not prompts: a waiter holds its request's ids (4 bytes a token: 32 MiB at most per tenant), and a burst of 16,000-
# token prompts (an agent's chats) fits hundreds where it fits eight of the longest. Unbounded, every waiter held its
# ids as Python ints (36 MB per 1M tokens): 24 waiting 1M-token Routes took the controller to 889 MiB.
LONG_WAIT_TOKENS_PER_TENANT = 4 * HASH_THREADS_PER_TENANT << 20
# a prompt (or batch) of at least this many tokens hashed on the event loop takes its tenant's one inline turn: about
# 0.2 ms of hashing, and its ordering; below it a route costs about what taking the turn would
INLINE_TURN_TOKENS = 1024


class HashLane:
    """The tenants' hashing slots and the tokens of their long prompts waiting for one."""

    def __init__(self, candidates: CandidateOrder, branches: TenantBranches) -> None:
        self.candidates, self.branches = candidates, branches
        self.slots = KeyedSlots(HASH_THREADS_PER_TENANT, key_name="tenant", name="long prompts hashed")
        self.inline = KeyedSlots(1, key_name="tenant", name="prompts hashed on the event loop")
        self.waiting: dict[Hashable, int] = {}  # per tenant: tokens of its long prompts waiting for a slot

    @contextlib.asynccontextmanager
    async def inline_turn(self, owner: str | None, num_tokens: int) -> AsyncIterator[None]:
        """The tenant's one turn at hashing on the event loop, held over the block and one pass of the loop after it,
        so each of its routes waiting for the turn goes behind what the loop had ready meanwhile: another tenant's
        route waits for at most one of this tenant's hashings, not for all it has in flight.

        NOTE: every route of a tenant that arrived at once was ready on the loop together and hashed in turn: with one
        tenant's 64 routes of 8,192 tokens in flight, another's 64-token route waited 50 ms (p50; 230 ms at 256), where
        it took 0.4 ms alone, on a Router with no worker to hash for (each route's work: checking its ids); a worker's
        hash chain makes each route about 6x longer (tests/controller/test_route_inline_turn.py). Below INLINE_TURN_TOKENS, or without an
        owner, no turn is taken: the route's own work is about what a turn costs."""
        if owner is None or num_tokens < INLINE_TURN_TOKENS:
            yield
            return
        async with self.inline.hold(owner, None, "Route"):
            yield
            await asyncio.sleep(0)  # NOTE: what was ready meanwhile (another tenant's route) runs before the next turn

    async def ordered(
        self, token_ids: Sequence[int], model: str, salt: str | None, lora: str | None, owner: str | None,
        batch: Sequence[Sequence[int]], num_tokens: int,
    ) -> tuple[Ordering, Sequence[int], Sequence[Sequence[int]]]:
        """Router._ordered for a long prompt (or batch): its ids come back from the hashing thread as lists."""
        # NOTE: a long prompt's O(tokens) work (its ids made a list, checked, hashed, its tuple hash and the
        # Branches it extends) runs in the thread; its ordering reads the ledgers on the loop, as a short one's
        async with self.turn(owner, num_tokens):
            # NOTE: the workers as they are once its turn came (a wait can be long): fewer chains left to the loop
            jobs, warm = self.candidates.hash_jobs(model, lora), self.candidates.warm_keys(model, lora)
            token_ids, pre, seed, observed = await asyncio.to_thread(
                _hashed_long, jobs, warm, token_ids, model, salt, lora, self.branches, owner
            )
            later = await asyncio.to_thread(_hashed_batch, jobs, warm, batch, model, salt, lora,
                                            self.branches, owner) if batch else []
        batch, bpre = [ids for ids, _ in later], [h for _, h in later]
        ordering = self.candidates.order(token_ids, model, salt, lora, pre, seed, observed, owner, batch, bpre)
        return ordering, token_ids, batch

    @contextlib.asynccontextmanager
    async def turn(self, owner: str | None, num_tokens: int) -> AsyncIterator[None]:
        """One of the tenant's hashing slots while the block runs. The tokens of its prompts waiting for one are
        counted; past LONG_WAIT_TOKENS_PER_TENANT a prompt is refused before it waits (a lone waiter never is)."""
        waiting = self.waiting.get(owner, 0)
        if waiting and waiting + num_tokens > LONG_WAIT_TOKENS_PER_TENANT:
            raise ResourceExhausted(
                f"tenant {owner!r} has {waiting:,} tokens of long prompts (over {INLINE_HASH_TOKENS:,} tokens) waiting "
                f"to be hashed, {HASH_THREADS_PER_TENANT} at a time; another {num_tokens:,} would pass the limit of "
                f"{LONG_WAIT_TOKENS_PER_TENANT:,} tokens waiting per tenant; retry once its earlier Routes are answered, "
                "or send fewer long prompts at once"
            )
        self.waiting[owner] = waiting + num_tokens
        waiting_here = True
        try:
            async with self.slots.hold(owner, None, "Route"):
                waiting_here = False
                self._unwait(owner, num_tokens)
                yield
        finally:
            if waiting_here:  # cancelled (the caller went away) while it waited
                self._unwait(owner, num_tokens)

    def _unwait(self, owner: str | None, num_tokens: int) -> None:
        left = self.waiting[owner] - num_tokens
        if left:
            self.waiting[owner] = left
        else:
            del self.waiting[owner]


def _hashed_long(jobs: dict[Any, Any], warm: Sequence[Any], token_ids: Sequence[int], model: str, salt: str | None,
                 lora: str | None, branches: TenantBranches,
                 owner: str | None = None) -> tuple[Sequence[int], dict[Any, list[int]], int, dict[Any, int]]:
    """A long prompt's O(tokens) work, in its hashing thread: its ids as a list (a protobuf repeated field arrives
    as is), checked and hashed (checked_chains), their tuple hash (the ordering's tie-break seed), and the chains of
    the `warm` keys observed in `branches` in the order the ordering would observe them. Returns (ids, chains,
    seed, leading shared blocks per observed key)."""
    if not isinstance(token_ids, list | tuple | str | bytes | bytearray) and isinstance(token_ids, Sequence):
        token_ids = list(token_ids)
    chains = checked_chains(jobs, token_ids, model, salt, lora)
    observed = {ck: branches.observe(chains[ck], owner) for ck in warm if ck in chains}
    return token_ids, chains, seed_of(token_ids), observed


def _hashed_batch(jobs: dict[Any, Any], warm: Sequence[Any], batch: Sequence[Sequence[int]], model: str,
                  salt: str | None, lora: str | None, branches: TenantBranches,
                  owner: str | None = None) -> list[tuple[Sequence[int], Hashed]]:
    """_hashed_long for a batch's later prompts, in the same thread: each one's ids as a list, checked, hashed and
    observed."""
    out = []
    for ids in batch:
        ids, chains, _, observed = _hashed_long(jobs, warm, ids, model, salt, lora, branches, owner)
        out.append((ids, Hashed(chains, observed)))
    return out
