"""Must show 2-3: write-time eviction, middle eviction (exact / reposition), the RoPE invariant."""

from __future__ import annotations

import numpy as np
import pytest
from support.kernels import make_kernel, rand_ids

from fleet.core.errors import FailedPrecondition
from fleet.core.kernel import Kernel, ModelConfig, Session, max_abs_delta
from fleet.core.kernel.exactness import sabotaged_rope
from fleet.core.kernel.rope import rope_np, tables
from fleet.core.kernel.types import K_POST, V_IDX

PRE, SPAN, POST, QUERY = rand_ids(1, 45), rand_ids(2, 13), rand_ids(3, 37), rand_ids(4, 6)


def _never(backend: str, n_layers: int) -> tuple[list[float], str]:
    s = make_kernel(backend, n_layers=n_layers).session()
    s.append(PRE + POST)
    return s.append(QUERY), s.digest()


def _poisoned(backend: str, n_layers: int) -> object:
    s = make_kernel(backend, n_layers=n_layers).session()
    s.append(PRE + SPAN + POST)
    return s.append(QUERY)


def test_write_time_eviction_equals_never_saw(backend: str) -> None:
    k = make_kernel(backend)
    never = k.session()
    never.append(PRE)
    ref = never.append(POST + QUERY)
    s = k.session()
    s.append(PRE)
    s.append(SPAN)  # the tool result lands ...
    r = s.evict(len(PRE), len(SPAN), mode="reposition")  # ... and is evicted before anything attends to it
    assert r.tail and r.exact and r.logits_fresh
    d = max_abs_delta(s.append(POST + QUERY), ref)
    kept = k.session()
    kept.append(PRE + SPAN)
    c = max_abs_delta(kept.append(POST + QUERY), ref)
    print(f"[evict-vs-never {backend}] write-time: max|Δ|={d:.1e}   control (span kept) max|Δ|={c:.3e}")
    assert d == 0.0 and c > 0 and s.digest() == never.digest()


@pytest.mark.parametrize("n_layers", [2, 3])
def test_middle_exact_equals_never_saw_at_depth(backend: str, n_layers: int) -> None:
    ref, ref_digest = _never(backend, n_layers)
    s = make_kernel(backend, n_layers=n_layers).session()
    s.append(PRE + SPAN + POST)
    r = s.evict(len(PRE), len(SPAN), mode="exact")
    assert (r.exact, r.tail, r.num_recomputed, r.num_rerotated) == (True, False, len(POST), 0)
    assert s.tokens == PRE + POST and s.positions == list(range(len(PRE + POST)))
    d = max_abs_delta(s.append(QUERY), ref)
    c = max_abs_delta(_poisoned(backend, n_layers), ref)
    print(f"[evict exact {backend} L={n_layers}] max|Δ|={d:.1e}   control (span kept) max|Δ|={c:.3e}")
    assert d == 0.0 and c > 0 and s.digest() == ref_digest


def test_reposition_keeps_rope_invariant(backend: str) -> None:
    k = make_kernel(backend, n_layers=2)
    s = k.session()
    s.append(PRE + SPAN + POST)
    lo, n = len(PRE), len(POST)
    old_k = s.kv_numpy(lo + len(SPAN), lo + len(SPAN) + n)[K_POST]  # survivors' keys at old positions
    r = s.evict(lo, len(SPAN), mode="reposition")
    assert (r.exact, r.tail, r.num_rerotated, r.logits_fresh) == (False, False, n, False)
    assert s.tokens == PRE + POST and s.positions == list(range(lo + n))
    inv = s.rope_invariant_delta()
    # Control: a composed rotation (rotate the old post-RoPE key back by -length, llama.cpp K-shift
    # style) is not bit-exact, so the one-rotation-from-Kraw zero is a real property.
    cos, sin = tables(k.config, len(SPAN) + 1)  # [P, hd/2]
    composed = rope_np(old_k, cos[len(SPAN)], -sin[len(SPAN)])
    c = max_abs_delta(composed, s.kv_numpy(lo, lo + n)[K_POST])
    print(
        f"[reposition invariant {backend}] K==RoPE(Kraw,i): max|Δ|={inv:.1e} (report {r.invariant_delta:.1e})"
        f"   control (composed rotation) max|Δ|={c:.3e}"
    )
    assert inv == 0.0 and r.invariant_delta == 0.0 and c > 0


def test_reposition_layer0_equals_never_saw(backend: str) -> None:
    """Independent of the invariant: layer-0 K (post-RoPE) and V depend only on the token and its
    position, so after a middle reposition the survivors' layer-0 rows equal a never-saw session's."""
    k = make_kernel(backend, n_layers=2)
    lo, n, m = len(PRE), len(POST), len(SPAN)
    kept = k.session()
    kept.append(PRE + SPAN + POST)
    old = kept.kv_numpy(lo + m, lo + m + n)  # [3, L, KV, n, hd]: survivors at their old positions
    s = k.session()
    s.append(PRE + SPAN + POST)
    s.evict(lo, m, mode="reposition")
    never = k.session()
    never.append(PRE + POST)
    got, ref = s.kv_numpy(lo, lo + n), never.kv_numpy(lo, lo + n)  # [3, L, KV, n, hd]
    d = max(max_abs_delta(got[i, 0], ref[i, 0]) for i in (K_POST, V_IDX))
    # Control: span kept, survivors at their old positions: layer-0 K carries the old RoPE angle.
    c = max(max_abs_delta(old[i, 0], ref[i, 0]) for i in (K_POST, V_IDX))
    print(
        f"[reposition layer-0 {backend}] survivors' K,V vs never-saw: max|Δ|={d:.1e}"
        f"   control (span kept, old positions) max|Δ|={c:.3e}"
    )
    assert d == 0.0 and c > 0


def test_reposition_exact_on_one_layer(backend: str) -> None:
    ref, ref_digest = _never(backend, 1)
    s = make_kernel(backend, n_layers=1).session()
    s.append(PRE + SPAN + POST)
    r = s.evict(len(PRE), len(SPAN), mode="reposition")
    d = max_abs_delta(s.append(QUERY), ref)
    c = max_abs_delta(_poisoned(backend, 1), ref)
    print(
        f"[reposition L=1 {backend}] vs never-saw max|Δ|={d:.1e} (report exact={r.exact})   control max|Δ|={c:.3e}"
    )
    assert r.exact and d == 0.0 and c > 0 and s.digest() == ref_digest


@pytest.mark.parametrize("n_layers", [2, 4])
def test_reposition_reports_divergence_on_deep_models(backend: str, n_layers: int) -> None:
    ref, ref_digest = _never(backend, n_layers)
    s = make_kernel(backend, n_layers=n_layers).session()
    s.append(PRE + SPAN + POST)
    r = s.evict(len(PRE), len(SPAN), mode="reposition")
    d = max_abs_delta(s.append(QUERY), ref)
    c = max_abs_delta(_poisoned(backend, n_layers), ref)
    # Honest: survivors' layer>=1 K/V attended to the span at layer 0, so reposition is not exact.
    print(
        f"[reposition L={n_layers} {backend}] vs never-saw max|Δ|={d:.3e} (report exact={r.exact}, "
        f"not claimed)   span kept max|Δ|={c:.3e}"
    )
    assert not r.exact and d > 0 and s.digest() != ref_digest and s.rope_invariant_delta() == 0.0


def test_evict_then_generate_rederives_logits(backend: str) -> None:
    k = make_kernel(backend)
    s, never = k.session(), k.session()
    s.append(PRE + SPAN + POST)
    never.append(PRE + POST)
    s.evict(len(PRE), len(SPAN), mode="exact")
    assert s.generate(8) == never.generate(8) and s.digest() == never.digest()
    b = k.session()
    b.append(PRE + SPAN + POST)
    b.evict(len(PRE), len(SPAN), mode="reposition")
    assert b.last_logits is None and len(b.generate(3)) == 3 and b.last_logits is not None


@pytest.mark.parametrize("n_layers", [1, 2])
def test_reposition_at_a_wrong_position_is_caught(backend: str, n_layers: int) -> None:
    """The invariant is checked by an independent path (the prefill path's RoPE and layer 0 from the
    token ids), so a rotation at position+3 in the eviction path shows up, and exact goes False."""
    good = make_kernel(backend, n_layers=n_layers).session()
    good.append(PRE + SPAN + POST)
    ok = good.evict(len(PRE), len(SPAN), mode="reposition")
    bad_k = Kernel.synthetic(ModelConfig.tiny(n_layers=n_layers), seed=0, backend=backend, tile_size=32)
    bad_k.ops.rope = sabotaged_rope(bad_k, 3)  # the eviction path rotates 3 positions too far
    bad = bad_k.session()
    bad.append(PRE + SPAN + POST)
    r = bad.evict(len(PRE), len(SPAN), mode="reposition")
    print(
        f"[reposition sabotage {backend} L={n_layers}] correct: invariant_delta={ok.invariant_delta:.1e} "
        f"exact={ok.exact}   rope at position+3: invariant_delta={r.invariant_delta:.3e} exact={r.exact}"
    )
    assert ok.invariant_delta == 0.0 and ok.exact == (n_layers == 1)
    assert r.invariant_delta is not None and r.invariant_delta > 0 and not r.exact
    assert bad.rope_invariant_delta() > 0 and bad.layer0_delta() > 0


def test_layer0_is_slot_invariant(backend: str) -> None:
    """A token's layer-0 Kraw and V are the same bits in every tile row slot (they are computed per
    token id, never inside a tile GEMM), which is what makes a 1-layer reposition exact on any CPU.
    Printed beside it: the same rows through a tile GEMM at two slots (may or may not differ by CPU)."""
    k = make_kernel(backend, n_layers=1)
    tok = PRE[:1]
    rows = []
    for pad in (0, 5, 31):  # the token at row slot 0, 5 and 31 of a 32-row tile
        s = k.session()
        if pad:
            s.append(PRE[1 : 1 + pad])
        s.append(tok)
        rows.append(s.kv_numpy(pad, pad + 1))  # [3, 1, KV, 1, hd]
    d = max(max_abs_delta(r[i], rows[0][i]) for r in rows for i in (1, 2))  # Kraw, V
    x = k.ops.embed(np.array(tok * 32), 0, 32)  # the tile GEMM path: the same row in every slot
    gemm = k.ops.to_numpy(k.ops.qkv(x, 0, 0)[2])  # kraw [KV, 32, hd], no ids: projected as a tile
    g = max(max_abs_delta(gemm[:, j], gemm[:, 0]) for j in range(32))
    # Control: K (post-RoPE) does depend on the position, so the comparison sees differences.
    c = max_abs_delta(rows[1][0], rows[0][0])
    print(
        f"[layer-0 slots {backend}] Kraw,V over slots 0/5/31: max|Δ|={d:.1e}   "
        f"control (K at other positions) {c:.3e}   tile-GEMM row across slots (reported) {g:.1e}"
    )
    assert d == 0.0 and c > 0


def test_an_exact_eviction_after_a_reposition_claims_only_what_it_holds(backend: str) -> None:
    """A reposition on a deep model leaves survivors whose layer >= 1 KV carries its span; an `exact` eviction
    after it recomputes its own survivors over them, so it is never-saw's only when it starts at or before the
    reposition's span. Before, every exact eviction said exact=True (0.2 max|Δ| logits from never-saw's)."""
    k = make_kernel(backend)
    a, b, c, d, e = (rand_ids(10 + i, 20) for i in range(5))

    def shifted() -> Session:
        s = k.session()
        s.append(a + b + c + d + e)
        assert not s.evict(20, 20, mode="reposition").exact  # b
        return s

    def never(tokens: list[int]) -> str:
        n = k.session()
        n.append(tokens)
        return n.digest()

    s = shifted()
    r = s.evict(40, 20, mode="exact")  # d, past the reposition's span: e is recomputed over c's shifted KV
    assert s.digest() != never(a + c + e) and (r.exact, r.num_recomputed) == (False, 20)
    assert s.num_exact_tokens == 20  # a's positions
    t = shifted()
    assert not t.evict(40, 40, mode="exact").exact and t.digest() != never(a + c)  # a tail: c still shifted
    with pytest.raises(FailedPrecondition, match="re-rotated"):
        t.export_prefix(32)  # c's blocks would be adopted as a prefill of its tokens
    assert t.export_prefix(16).num_tokens == 16
    u = shifted()  # the control: recomputed from the reposition's own start, everything is a prefill's again
    r = u.evict(20, 20, mode="exact")  # c
    assert (r.exact, u.num_exact_tokens) == (True, 60) and u.digest() == never(a + d + e)
    f = shifted().fork()
    assert f.num_exact_tokens == 20 and not f.evict(59, 1, mode="exact").exact


def test_a_tail_eviction_that_empties_the_session_claims_no_fresh_logits(backend: str) -> None:
    """NOTE: evicting every token (a tail from position 0) reported logits_fresh=True beside last_logits None (found by
    scripts/fuzz_kernel.py's audit). Control: a tail eviction that leaves a token re-derives its logits."""
    s = make_kernel(backend).session()
    s.append(PRE + SPAN)
    r = s.evict(len(PRE), len(SPAN))
    assert r.tail and r.logits_fresh and s.last_logits is not None  # control
    r = s.evict(0, len(PRE))
    assert r.tail and r.exact and len(s) == 0 and s.last_logits is None
    assert not r.logits_fresh
