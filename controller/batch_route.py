"""A batched request's later prompts in a route (a completions `prompt` list; docs/routing.md, "Batches").

vLLM runs each prompt of a batch as an engine request of its own on the worker the batch is sent to, each with its
own prefix-cache hit. So the router costs a candidate by what the whole batch would reuse there: the cost is the one
a single prompt has (controller/cost.py `terms`), with its cached, prefill and amortized tokens summed over the
prompts (`CandidateState.batch_cached`, `terms(batch=...)`); the load terms are the candidate's, as for any request.
And the route records every prompt as placed where the batch goes: each one's conversation in the working set
(controller.demand) and its blocks in the rank's block-pool shadow (controller.shadow_pool), as if each had come
alone. Before, only the first prompt counted: a batch whose later prompts were warm on another worker went by its
first, and the ledgers knew nothing of the later prompts the worker then held.

The first prompt stays the route's `token_ids` (its chain, seed and shared prefix work as for a single prompt);
what is here is the later prompts' share. Pure bookkeeping over the ledgers the router passes in.
"""

from __future__ import annotations

import time
from collections.abc import Sequence, Sized
from typing import Any, NamedTuple

from controller.demand import Conversation, DemandLedger
from controller.index import PrefixIndex, RankKey
from controller.shadow import ShadowPools
from controller.tenant_branches import TenantBranches
from fleet.core.block_hash import external_chain

# NOTE: the most prompts of one batch a route looks at: a larger batch is routed by its first MAX_BATCH_PROMPTS (the
# proxy sends no more, the Route servicer looks at no more) and sent whole. Each is a chain per hash config and a few
# ledger look-ups per candidate on the controller's event loop, which every tenant's routes share: at 256, one route
# of 255 x 32-token prompts held it 5.4 ms (p50; 15.8 ms max) against 0.95 ms for a single prompt of the inline-hashing
# limit (8,192 tokens), 3 workers; at 32, 32 x 256 tokens held it 1.55 ms and 32 x 32 tokens 0.76 ms.
MAX_BATCH_PROMPTS = 32


def within(num_first: int, batch: Sequence[Sized], max_tokens: int) -> int:
    """How many of a batch's later prompts, in order, fit with its first (`num_first` tokens) in `max_tokens`.

    NOTE: --max-route-tokens bounds a Route, not a request: vLLM runs a batch whose prompts each fit the model
    however many tokens they make together. A Route over it refused the whole batch (the proxy answered 400 for a
    request vLLM runs); now the batch is routed by its leading prompts that fit, as a batch over MAX_BATCH_PROMPTS is
    by its first ones."""
    n = num_first
    for i, p in enumerate(batch):
        n += len(p)
        if n > max_tokens:
            return i
    return len(batch)


class LaterPrompt(NamedTuple):
    """One later prompt under one hash config (chain key)."""

    chain: list[int]
    num_shared: int  # its leading blocks other conversations share (Branches.observe)
    prev: tuple[int, Conversation] | None  # the recorded conversation it continues, if any


class Hashed(NamedTuple):
    """A later prompt's work done off the event loop: its chains per chain key, and what Branches.observe returned
    for those of the warm keys (hash_lane._hashed_long). A key missing (a worker that came meanwhile) is done in order."""

    chains: dict[Any, list[int]]
    observed: dict[Any, int]


def later_prompts(ck: Any, hash_cfg: Any, lora_key: Any, batch: Sequence[Sequence[int]], pre: Sequence[Hashed] | None,
                  salt: str | None, branches: TenantBranches, demand: DemandLedger,
                  owner: str | None) -> list[LaterPrompt]:
    """Each later prompt's chain under the chain key `ck` (hashed off the loop where `pre` has it), its shared
    blocks and the conversation it continues."""
    out = []
    for i, ids in enumerate(batch):
        done = pre[i] if pre is not None else None
        chain = done.chains.get(ck) if done is not None else None
        if chain is None:
            chain = external_chain(hash_cfg, ids, lora=lora_key, cache_salt=salt)
        nshared = done.observed.get(ck) if done is not None else None
        if nshared is None:
            nshared = branches.observe(chain, owner)
        out.append(LaterPrompt(chain, nshared, demand.previous(chain)))
    return out


def cached_tokens(index: PrefixIndex, shadow: ShadowPools, key: RankKey, parts: Sequence[LaterPrompt],
                  block_size: int, owner: str) -> tuple[int, ...]:
    """Each later prompt's proven-warm prefix on the rank, in tokens: the index's match less what the block-pool
    shadow knows evicted (as the first prompt's, CandidateOrder._state)."""
    out = []
    now = time.monotonic()
    for p in parts:
        matched = index.residency(key, p.chain)[0]
        if matched:
            matched = shadow.resident_prefix(key, p.chain, matched, now, owner)
        out.append(matched * block_size)
    return tuple(out)


def demand_with(demand: DemandLedger, key: RankKey, first: int, parts: Sequence[LaterPrompt], solo: int) -> int:
    """The rank's working set with the whole batch placed there: the first prompt's figure (`first`, -1: unknown)
    plus what each later prompt adds to the rank's demand on its own."""
    if first < 0 or not parts:
        return first
    base = demand.demand(key)
    return first + sum(demand.demand_with(key, p.prev[1] if p.prev else None, len(p.chain), p.num_shared,
                                          group_of(p, solo)) - base for p in parts)


def group_of(p: LaterPrompt, solo: int) -> int:
    """The prompt's return-evidence group: its last shared block, else the tenant's own (ordering.solo_group)."""
    return p.chain[p.num_shared - 1] if p.num_shared else solo


def placed(parts: Sequence[LaterPrompt], solo: int) -> list[tuple[list[int], int, int]]:
    """What the router records of each later prompt where the batch goes: (chain, shared blocks, group)."""
    return [(p.chain, p.num_shared, group_of(p, solo)) for p in parts]
