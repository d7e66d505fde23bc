"""The layer-0 memo's bookkeeping (exact rows, FIFO reuse) and that eviction from it is invisible."""

from __future__ import annotations

from support.kernels import make_kernel, rand_ids

from fleet.core.kernel import Kernel, ModelConfig, max_abs_delta
from fleet.core.kernel.l0memo import L0Slots


def test_slots_assign_rows_in_order_and_reuse_first_in_first_out() -> None:
    m = L0Slots(4)
    assert m.lookup([7, 9]) == ([0, 1], [(7, 0), (9, 1)])
    assert m.lookup([9, 7]) == ([1, 0], [])  # hits
    assert m.lookup([3, 3]) == ([2, 2], [(3, 2)])  # a repeat inside one call is one miss
    assert m.lookup([5]) == ([3], [(5, 3)])
    assert m.lookup([8, 1]) == ([0, 1], [(8, 0), (1, 1)])  # full: rows 0, 1 (ids 7, 9) reused first
    assert 7 not in m.rows and 9 not in m.rows and m.num_used == 4


def test_a_small_memo_gives_the_same_bits(backend: str) -> None:
    """A memo far smaller than the vocabulary (rows recomputed after reuse) changes no bit."""
    ids = rand_ids(11, 300)
    ref = make_kernel(backend).session().append(ids)
    k = Kernel.synthetic(ModelConfig.tiny(), seed=0, backend=backend, tile_size=32)
    k.ops._slots = L0Slots(64)  # 32 ids per lookup: every tile refills rows
    s = k.session()
    s.append(ids[:150])
    got = s.append(ids[150:])
    c = max_abs_delta(make_kernel(backend).session().append(ids[:-1] + [(ids[-1] + 1) % 512]), ref)
    print(
        f"[l0 memo {backend}] 64-row memo vs default: max|Δ|={max_abs_delta(got, ref):.1e}   control {c:.3e}"
    )
    assert max_abs_delta(got, ref) == 0.0 and c > 0 and k.ops._slots.num_used == 64


def test_a_hit_is_never_reused_by_a_miss_of_the_same_lookup() -> None:
    m = L0Slots(4)
    m.lookup([1, 2])
    m.lookup([3, 4])  # full; the FIFO cursor points at row 0 (id 1)
    rows, misses = m.lookup([1, 5])  # 1 hits row 0, so 5 must not take row 0
    assert rows == [0, 1] and misses == [(5, 1)] and m.rows[1] == 0 and 2 not in m.rows
