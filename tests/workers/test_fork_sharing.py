"""Forks on the parent's node share its blocks copy-on-write (DESIGN §4/§5), on a real local Ray.

A fork adopts the parent's block-aligned prefix from the node's object store and computes only
the tokens past it; its log is still the whole history, so a regeneration replays it exactly.
"""

from __future__ import annotations

import random
from typing import Any

from support.workers import SPEC, kill_host, replay_locally

from fleet.core.kernel import max_abs_delta
from workers.fleet import KernelFleet
from workers.spec import make_kernel

PROMPT = "You are agent one. Plan, then act. " * 3          # 105 bytes: 6 whole blocks + 9
BS = SPEC.block_size


def test_fork_adopts_parent_blocks_bit_identically_and_copies_on_write(kfleet: KernelFleet, tenant: str) -> None:
    block_bytes = make_kernel(SPEC).block_bytes
    kfleet.create_session(tenant, "p", PROMPT)
    ref = kfleet.store.put(b"tool: the answer is 42 (source: notes, page 7).", tenant)
    kfleet.append(tenant, "p", " a question, withdrawn later.")
    kfleet.add_tool_result(tenant, "p", ref)
    kfleet.evict(tenant, "p", 1, mode="exact")                    # the ledger shifts: replayed without KV
    kfleet.append(tenant, "p", [5, 6, 7])                         # model output piece
    kfleet.append(tenant, "p", " go on")
    child = kfleet.fork(tenant, "p", "c")
    n = len(kfleet.tokens(tenant, "p"))
    info = kfleet.info(tenant, "c")
    adopted = (n - 1) // BS * BS                                   # it computes its own last logits
    print(f"fork of {n} tokens: adopted {info['adopted_tokens']}, computed {n - info['adopted_tokens']}; "
          f"bytes shared {info['bytes_shared']}, alone {info['bytes_alone']}")
    assert info["adopted_tokens"] == adopted > 0 and info["bytes_shared"] == adopted // BS * block_bytes
    ops = kfleet.store.oplog_read(tenant, "c")
    assert ops[-1] == {"op": "fork", "parent": "p", "at": len(ops) - 1, "op_id": child["create_op_id"]}
    alone = replay_locally(ops[:-1], kfleet.store, tenant)         # built alone, never forked
    assert kfleet.pieces(tenant, "c") == kfleet.pieces(tenant, "p") == alone.pieces
    assert kfleet.digest(tenant, "c") == alone.digest()
    d_alone = max_abs_delta(kfleet.last_logits(tenant, "c"), alone.session.last_logits)

    parent_digest = kfleet.digest(tenant, "p")
    kfleet.fork(tenant, "p", "sibling")                            # adopts the same object-store blocks
    kfleet.evict(tenant, "c", 0, mode="exact")                     # rewrites every block the child adopted
    lc = kfleet.append(tenant, "c", " child branch").logits
    assert kfleet.digest(tenant, "p") == kfleet.digest(tenant, "sibling") == parent_digest
    mine = replay_locally(kfleet.store.oplog_read(tenant, "c"), kfleet.store, tenant)
    d_diverged = max_abs_delta(lc, mine.session.last_logits)
    assert kfleet.digest(tenant, "c") == mine.digest()
    lp = kfleet.append(tenant, "p", " parent branch").logits
    control = max_abs_delta(lp, lc)
    print(f"shared fork vs built alone: max|d| = {d_alone}; after evict+append {d_diverged}; "
          f"control parent vs child after diverging {control} (> 0)")
    assert d_alone == 0.0 and d_diverged == 0.0 and control > 0.0

    digest = kfleet.digest(tenant, "c")                            # a crash: regenerated from its log
    kill_host(kfleet.store_url, kfleet.list_sessions(tenant=tenant)[0]["node"])
    assert kfleet.digest(tenant, "c") == digest and kfleet.num_regenerations == 1
    assert kfleet.info(tenant, "c")["adopted_tokens"] == 0         # the whole log replayed, no blocks adopted


def test_eight_forks_hold_the_prefix_once(kfleet: KernelFleet, tenant: str) -> None:
    text = "".join(random.Random(1).choices("abcdefgh ijklmnop.", k=1500))
    kfleet.create_session(tenant, "root", PROMPT)
    kfleet.append(tenant, "root", text)
    forks = [f"f{i}" for i in range(8)]
    for i, child in enumerate(forks):
        kfleet.fork(tenant, "root", child)
        kfleet.append(tenant, child, f" branch {i}: try the next step.")
    kfleet.fork(tenant, "root", "replayed", share=False)           # control: a private copy by replay
    kfleet.append(tenant, "replayed", " branch 0: try the next step.")
    rows = {r["session"]: r for r in kfleet.list_sessions(tenant=tenant)}
    assert kfleet.digest(tenant, "f0") == kfleet.digest(tenant, "replayed")   # same bytes either way
    shared = {rows[c]["bytes_shared"] for c in forks}
    assert len(shared) == 1                                        # every fork adopted the same blocks
    shared_once = shared.pop()
    alone = sum(rows[c]["bytes_alone"] for c in forks)
    eager = 8 * rows["replayed"]["bytes_alone"]                    # 8 forks that each replayed
    root = rows["root"]["bytes_alone"] + rows["root"]["bytes_shared"]
    print(f"8 forks of {rows['root']['tokens']} tokens: sharing = {alone} B alone (8 suffixes) + {shared_once} B "
          f"shared once = {alone + shared_once} B; eager copies (replay) = {eager} B "
          f"({eager / (alone + shared_once):.1f}x); the parent holds {root} B of its own")
    assert rows["replayed"]["bytes_shared"] == 0 and rows["replayed"]["adopted_tokens"] == 0
    [stats] = kfleet.node_stats()                                  # the object-store copies: the prefix once
    assert stats["cached_tokens"] <= rows["root"]["tokens"] + BS    # (+ the tenant's salt page)
    assert shared_once == rows["f0"]["adopted_tokens"] // BS * make_kernel(SPEC).block_bytes > 0
    assert alone <= 8 * 3 * make_kernel(SPEC).block_bytes          # <= 16 recomputed + the suffix, each
    assert alone + shared_once < eager / 4


def test_fork_after_a_reposition_eviction_replays_and_files_nothing(kfleet: KernelFleet, tenant: str) -> None:
    kfleet.create_session(tenant, "r", PROMPT)
    kfleet.append(tenant, "r", " a long aside that the agent later drops, and then some.")
    kfleet.append(tenant, "r", " the point.")
    kfleet.evict(tenant, "r", 1, mode="reposition")                 # survivors keep KV that saw the aside
    [before] = kfleet.node_stats()
    kfleet.fork(tenant, "r", "rc")
    [after] = kfleet.node_stats()
    ops = kfleet.store.oplog_read(tenant, "rc")
    assert kfleet.info(tenant, "rc")["adopted_tokens"] == 0          # replayed: its KV is not f(tokens)
    assert after["cached_tokens"] == before["cached_tokens"]        # and the tree got none of its blocks
    assert kfleet.digest(tenant, "rc") == kfleet.digest(tenant, "r") == replay_locally(ops).digest()


# A parent whose KV a reposition eviction re-rotated, and a later session whose prompt starts with the parent's
# tokens now: had the parent's blocks been filed under those tokens, the later session would adopt them.
SYSTEM = "You are the parent agent. " * 4
ASIDE = "An aside that will be evicted with reposition. " * 2
TASK = "Here is a long task description that both share. " * 3
MORE = "A further message from the user, long enough here. " * 3


def _prefilled(tokens: list[int]) -> tuple[str, Any]:
    """The digest and last logits of `tokens` prefilled by a session of their own (no adopted blocks)."""
    s = make_kernel(SPEC).session()
    s.append(tokens)
    return s.digest(), s.last_logits


def _shared_blocks(a: list[int], b: list[int]) -> int:
    """Tokens of the whole blocks `a` and `b` (the prefix `b`, a new session's prompt, may adopt) begin with."""
    n = 0
    while n < min(len(a), len(b) - 1) and a[n] == b[n]:
        n += 1
    return n // BS * BS


def test_share_prefix_of_a_re_rotated_session_files_none_of_its_blocks(kfleet: KernelFleet, tenant: str) -> None:
    """A cross-node fork asks the parent's host for its blocks (share_prefix), which files them in the node's tree.

    NOTE: before, a parent re-rotated by a reposition eviction filed them too: its tokens now start with the system
    prompt and the task, whose KV still carries the evicted aside. A new session of the tenant whose prompt starts
    with them adopted 240 tokens of that KV (digest unlike its own prefill, max|d logits| 0.096), and changed once
    it was rebuilt from its log."""
    p = kfleet.create_session(tenant, "p", SYSTEM)
    system_tokens = kfleet.tokens(tenant, "p")
    kfleet.append(tenant, "p", ASIDE)
    kfleet.append(tenant, "p", TASK)
    assert not kfleet.evict(tenant, "p", 1, mode="reposition").result.exact
    tokens = kfleet.tokens(tenant, "p")
    shared = kfleet.nodes.call(p["node"], "share_prefix", tenant, "p", tokens)
    assert len(shared["refs"]) * BS == _shared_blocks(system_tokens, tokens)   # the create's own blocks only
    v = kfleet.create_session(tenant, "v", SYSTEM + TASK + " And then some more words.")
    mine = kfleet.tokens(tenant, "v")
    digest, logits = _prefilled(mine)
    assert v["adopted_tokens"] == _shared_blocks(system_tokens, mine) > 0
    assert kfleet.digest(tenant, "v") == digest
    assert max_abs_delta(kfleet.last_logits(tenant, "v"), logits) == 0.0


def test_a_fork_whose_parent_is_re_rotated_meanwhile_files_none_of_its_blocks(kfleet: KernelFleet,
                                                                             tenant: str) -> None:
    """A same-node fork (the gRPC Fork: no node named) reads its parent's fork point, then the parent's host files the
    parent's blocks and the child adopts them. Here the parent gets an append and a reposition eviction in between
    (a concurrent client's calls, run right after the fork point is read).

    NOTE: before, the host checked the fork point's ops only, then filed the parent's current, re-rotated blocks
    under their tokens: a later session of the tenant adopted 288 tokens of them (max|d logits| 0.082)."""
    kfleet.create_session(tenant, "p", SYSTEM)
    system_tokens = kfleet.tokens(tenant, "p")
    kfleet.append(tenant, "p", ASIDE)
    kfleet.append(tenant, "p", TASK)
    call, fired = kfleet.nodes.call, []

    def racing(node: str, method: str, *args: Any) -> Any:
        out = call(node, method, *args)
        if method == "call" and args[2] == "fork_point" and not fired:
            fired.append(1)
            kfleet.append(tenant, "p", MORE)
            kfleet.evict(tenant, "p", 1, mode="reposition")
        return out

    kfleet.nodes.call = racing  # type: ignore[method-assign]
    try:
        child = kfleet.fork(tenant, "p", "c")
    finally:
        kfleet.nodes.call = call  # type: ignore[method-assign]
    assert fired and child["node"] == kfleet.registry.get(tenant, "p").node  # type: ignore[union-attr]
    ops = kfleet.store.oplog_read(tenant, "c")
    assert kfleet.digest(tenant, "c") == replay_locally(ops).digest()     # the child: its fork point, exactly
    v = kfleet.create_session(tenant, "v", SYSTEM + TASK + MORE[:40] + " and more.")
    mine = kfleet.tokens(tenant, "v")
    digest, logits = _prefilled(mine)
    assert v["adopted_tokens"] == _shared_blocks(system_tokens, mine) > 0
    assert kfleet.digest(tenant, "v") == digest
    assert max_abs_delta(kfleet.last_logits(tenant, "v"), logits) == 0.0
