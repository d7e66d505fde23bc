"""Forks on the parent's node share its blocks copy-on-write (DESIGN §4/§5), on a real local Ray.

A fork adopts the parent's block-aligned prefix from the node's object store and computes only
the tokens past it; its log is still the whole history, so a regeneration replays it exactly.
"""

from __future__ import annotations

import random

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
    kfleet.fork(tenant, "p", "c")
    n = len(kfleet.tokens(tenant, "p"))
    info = kfleet.info(tenant, "c")
    adopted = (n - 1) // BS * BS                                   # it computes its own last logits
    print(f"fork of {n} tokens: adopted {info['adopted_tokens']}, computed {n - info['adopted_tokens']}; "
          f"bytes shared {info['bytes_shared']}, alone {info['bytes_alone']}")
    assert info["adopted_tokens"] == adopted > 0 and info["bytes_shared"] == adopted // BS * block_bytes
    ops = kfleet.store.oplog_read(tenant, "c")
    assert ops[-1] == {"op": "fork", "parent": "p", "at": len(ops) - 1}
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
