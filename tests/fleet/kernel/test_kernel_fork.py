"""Must show 4: fork isolation, and N forks cost about prefix + N suffixes (from the accounting)."""

from __future__ import annotations

from support.kernels import make_kernel, rand_ids

from fleet.core.kernel import max_abs_delta


def test_evicting_in_a_branch_leaves_the_sibling_bit_identical(backend: str) -> None:
    k = make_kernel(backend)
    base, tail_a, tail_b = rand_ids(10, 70), rand_ids(11, 20), rand_ids(12, 9)
    parent = k.session()
    parent.append(base)
    a, b = parent.fork(), parent.fork()
    a.append(tail_a)
    a.evict(30, 25, mode="reposition")  # rewrites shared blocks 1.. in A only (copy-on-write)
    a.evict(5, 3, mode="exact")
    got = b.append(tail_b)
    alone = k.session()
    alone.append(base)
    ref = alone.append(tail_b)
    d = max_abs_delta(got, ref)
    c = max_abs_delta(a.append(tail_b), ref)
    print(
        f"[sibling isolation {backend}] B after A's evictions vs B alone: max|Δ|={d:.1e}   control (A) max|Δ|={c:.3e}"
    )
    assert d == 0.0 and c > 0 and b.digest() == alone.digest()
    assert parent.tokens == base and len(parent) == 70


def test_fork_shares_blocks_until_write(backend: str) -> None:
    k = make_kernel(backend)
    bs = k.block_size
    parent = k.session()
    parent.append(rand_ids(13, 5 * bs))
    child = parent.fork()
    assert (child.memory().num_shared_blocks, child.memory().num_blocks) == (5, 5)
    child.append([1, 2, 3])  # a new block: owned alone
    assert (child.memory().num_shared_blocks, child.memory().num_blocks) == (5, 6)
    child.evict(bs * 2 + 1, 2, mode="exact")  # rewrites from block 2 on: blocks 2,3,4 copied
    assert (child.memory().num_shared_blocks, child.memory().num_blocks) == (2, 6)
    child.close()
    assert parent.memory().num_shared_blocks == 0  # ref counts came back down


def test_eight_forks_cost_prefix_plus_eight_suffixes(backend: str) -> None:
    k = make_kernel(backend)
    bs, bb = k.block_size, k.block_bytes
    prefix_len, suffix_len = 40 * bs + 5, 20  # the prefix ends mid-block: that block is copied on write
    root = k.session()
    root.append(rand_ids(14, prefix_len))
    forks = [root.fork() for _ in range(8)]
    for i, f in enumerate(forks):
        f.append(rand_ids(100 + i, suffix_len))
    reps = [f.memory() for f in forks]
    shared = reps[0].bytes_shared
    total = shared + sum(r.bytes_alone for r in reps)  # physical bytes: shared blocks counted once
    eager = sum(r.bytes_total for r in reps)  # what 8 eager copies would hold
    prefix_blocks = prefix_len // bs  # full blocks stay shared
    suffix_blocks = -(-(prefix_len + suffix_len) // bs) - prefix_blocks  # partial block copied + new ones
    print(
        f"[fork memory {backend}] 8 forks: {total} B with CoW vs {eager} B eager "
        f"({eager / total:.2f}x); prefix {prefix_blocks} blocks + 8 x {suffix_blocks} suffix blocks"
    )
    assert all(r.bytes_shared == prefix_blocks * bb for r in reps)
    assert all(r.bytes_alone == suffix_blocks * bb for r in reps)
    assert total == (prefix_blocks + 8 * suffix_blocks) * bb
    assert eager == 8 * (prefix_blocks + suffix_blocks) * bb
