"""The kernel's exactness checks, run live: each is a measured max|Δ| with its control.

Used by `kvfleet witness` (the command keeps the design card's name), bench/gpu_check.py and the CUDA
test. Every exactness row pairs its zero with a non-vacuous control (> 0) measured the same way.

"Witness" names other things elsewhere, so this module does not: fleet.core.lifecycle's Witness is the
cache-loss witness of a dormancy action (DESIGN section 9), and a session's eviction record is its
eviction proof. Here a row is an ExactnessCheck.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fleet.core.kernel.check_bench import Bench as _Bench
from fleet.core.kernel.check_bench import exact_row, random_ids
from fleet.core.kernel.checks import ExactnessCheck
from fleet.core.kernel.config import ModelConfig
from fleet.core.kernel.kernel import Kernel
from fleet.core.kernel.rope import rope_np, tables
from fleet.core.kernel.types import K_POST, K_RAW, PrefixKV, max_abs_delta


def prefix_reuse(b: _Bench) -> ExactnessCheck:
    k = b.kernel()
    ids = random_ids(9, 400, k.config.vocab_size)
    ref = k.session().append(ids)
    worst = 0.0
    for split in (1, 31, 32, 177, 399):
        s = k.session()
        s.append(ids[:split])
        worst = max(worst, max_abs_delta(s.append(ids[split:]), ref))
    poke = [(ids[0] + 1) % k.config.vocab_size] + ids[1:]
    return exact_row(
        "prefix reuse (A then B == A+B, 5 splits of 400)",
        worst,
        max_abs_delta(k.session().append(poke), ref),
        max_abs_delta(b.kernel(nudged=ids[-1]).session().append(ids), ref),
        "control: first token changed",
    )


def decode(b: _Bench) -> ExactnessCheck:
    k = b.kernel()
    ids = random_ids(10, 120, k.config.vocab_size)
    ref = k.session().append(ids)
    s = k.session()
    s.append(ids[:80])
    for t in ids[80:]:
        got = s.append([t])  # token-by-token decode across a tile boundary (tile 64)
    poke = ids[:-1] + [(ids[-1] + 1) % k.config.vocab_size]
    return exact_row(
        "decode (80 + 40 one at a time == 120 at once)",
        max_abs_delta(got, ref),
        max_abs_delta(k.session().append(poke), ref),
        max_abs_delta(b.kernel(nudged=ids[-1]).session().append(ids), ref),
        "control: last token changed",
    )


def evict_vs_never(b: _Bench) -> list[ExactnessCheck]:
    k = b.kernel()
    never = k.session()
    never.append(b.pre)
    ref = never.append(b.post + b.query)
    s = k.session()
    s.append(b.pre)
    s.append(b.span)
    s.evict(len(b.pre), len(b.span))
    d = max_abs_delta(s.append(b.post + b.query), ref)
    c = max_abs_delta(b.run(b.pre + b.span + b.post), ref)
    return [
        exact_row(
            "evict-vs-never (write-time span)", d, c, b.ulp(b.pre + b.post, ref), "control: poison-vs-never"
        ),
        ExactnessCheck("poison-vs-never (control: span kept)", "> 0", c, None, c > 0),
    ]


def middleexact_row(b: _Bench) -> ExactnessCheck:
    ref = b.run(b.pre + b.post)
    got, _ = b.evicted("exact", 2)
    return exact_row(
        "middle eviction, exact mode (2 layers)",
        max_abs_delta(got, ref),
        max_abs_delta(b.run(b.pre + b.span + b.post), ref),
        b.ulp(b.pre + b.post, ref),
        "control: span kept",
    )


def sabotaged_rope(k: Kernel, shift: int) -> Any:
    """`k.ops.rope` rotating every key `shift` positions too far (a wrong-position bug)."""
    rope = k.ops.rope
    return lambda x, positions: rope(x, np.asarray(positions) + shift)


def reposition_invariant(b: _Bench) -> ExactnessCheck:
    k = b.kernel()
    s = k.session()
    s.append(b.pre + b.span + b.post)
    lo, n, L = len(b.pre), len(b.post), len(b.span)
    old_k = s.kv_numpy(lo + L, lo + L + n)[K_POST]
    r = s.evict(lo, L, mode="reposition")
    cos, sin = tables(k.config, L + 1)
    c = max_abs_delta(rope_np(old_k, cos[L], -sin[L]), s.kv_numpy(lo, lo + n)[K_POST])
    # sabotage: the same eviction with the rotation 3 positions off must be caught
    bad = Kernel.synthetic(k.config, **b.kw)  # type: ignore[arg-type]  # its own ops instance
    bad.ops.rope = sabotaged_rope(bad, 3)
    t = bad.session()
    t.append(b.pre + b.span + b.post)
    sab = t.evict(lo, L, mode="reposition").invariant_delta or 0.0
    # 1 ulp: the check against the first survivor's stored Kraw row nudged by one ulp per element
    rows = s.kv_numpy(lo, lo + n)
    rows[K_RAW, :, :, 0] = np.nextafter(rows[K_RAW, :, :, 0], np.float32(np.inf))
    ulp = max_abs_delta(rows[K_POST], k.ops.to_numpy(k.ops.rope_rows(k.ops.from_numpy(rows[K_RAW]), lo)))
    ok = s.rope_invariant_delta() == 0.0 and r.invariant_delta == 0.0 and c > 0 and sab > 0 and ulp > 0
    return ExactnessCheck(
        "reposition invariant K[i] == RoPE(Kraw[i], i)",
        "== 0",
        max(s.rope_invariant_delta(), r.invariant_delta or 0.0),
        sab,
        ok,
        f"control: rope at position+3 caught ({sab:.2e}); composed rotation {c:.2e}",
        ulp,
    )


def reposition_depth(b: _Bench) -> list[ExactnessCheck]:
    out = []
    for L in (1, 4):
        ref = b.run(b.pre + b.post, L)
        got, r = b.evicted("reposition", L)
        d, c = max_abs_delta(got, ref), max_abs_delta(b.run(b.pre + b.span + b.post, L), ref)
        if L == 1:
            row = exact_row(
                "reposition vs never-saw (1 layer)",
                d,
                c,
                b.ulp(b.pre + b.post, ref, 1),
                f"report.exact={r.exact} (measured, invariant_delta={r.invariant_delta})",
            )
            out.append(dataclasses.replace(row, ok=row.ok and r.exact))
        else:
            ok = (not r.exact) and d > 0
            out.append(
                ExactnessCheck(
                    f"reposition divergence ({L} layers, not exact)",
                    "reported",
                    d,
                    c,
                    ok,
                    f"report.exact={r.exact}: survivors attended to the span",
                )
            )
    return out


def _layer0_direct(k: Kernel, tokens: list[int]) -> np.ndarray:
    """Layer 0's (K, Kraw, V) [3, KV, n, hd] of `tokens` at positions 0.., every projection computed
    afresh (the memo neither read nor filled)."""
    with k.ops.limit():
        parts = k.ops.layer0(np.asarray(tokens, np.int64), 0, memo=False)
    return np.stack([k.ops.to_numpy(a) for a in parts])


def layer0_recomputed(b: _Bench) -> ExactnessCheck:
    """After a reposition, layer 0 against a recomputation that bypasses the layer-0 memo.

    NOTE: `EvictReport.invariant_delta` and the never-saw rows compare against computations that
    read the same memo the cache was built from, so a wrong memo row held in both reads 0 (found by
    review: a memo row off by 1e-3 still reported exact=True). This row does not read the memo."""
    k = b.kernel(1)
    s = k.session()
    s.append(b.pre + b.span + b.post)
    s.evict(len(b.pre), len(b.span), mode="reposition")
    got, toks, i = s.kv_numpy(0, len(s))[:, 0], s.tokens, len(b.pre)  # [3, KV, n, hd]
    poke = toks[:i] + [(toks[i] + 1) % k.config.vocab_size] + toks[i + 1 :]
    return exact_row(
        "layer 0 after reposition vs recomputed (memo bypassed)",
        max(max_abs_delta(got, _layer0_direct(k, toks)), s.layer0_delta(memo=False)),
        max_abs_delta(got, _layer0_direct(k, poke)),
        max_abs_delta(got, _layer0_direct(b.kernel(1, nudged=toks[i]), toks)),
        "control: first survivor's id changed",
    )


def sibling_isolation(b: _Bench) -> ExactnessCheck:
    k = b.kernel()
    parent = k.session()
    parent.append(b.pre + b.span)
    a, sib = parent.fork(), parent.fork()
    a.evict(10, 20, mode="reposition")
    a.append(b.post)
    got = sib.append(b.query)
    alone = k.session()
    alone.append(b.pre + b.span)
    ref = alone.append(b.query)
    return exact_row(
        "sibling isolation (evict+append in A; B vs B alone)",
        max_abs_delta(got, ref),
        max_abs_delta(a.append(b.query), ref),
        b.ulp(b.pre + b.span, ref),
        "control: branch A",
    )


def prefix_adoption(b: _Bench) -> ExactnessCheck:
    k = b.kernel()
    src = k.session()
    src.append(b.pre + b.span)
    ids = b.pre + b.span + b.post
    adopted = k.session(prefix=src.export_prefix(48))
    got = adopted.append(ids[48:])
    ref = k.session().append(ids)
    # control through the adoption path: blocks exported from a source whose first token differs,
    # adopted under the reference's token ids. NOTE: the control was span-kept vs never-saw, which
    # adoption never touched (it equalled the poison-vs-never row); this one is 0 if the adopted
    # blocks were ignored (recomputed from the ids) and > 0 only when they are used.
    other = k.session()
    other.append([(ids[0] + 1) % k.config.vocab_size] + ids[1:48])
    p = other.export_prefix(48)
    forged = PrefixKV(tuple(ids[:48]), p.block_size, p.blocks, p.model_id)
    control = max_abs_delta(k.session(prefix=forged).append(ids[48:]), ref)
    return exact_row(
        "exported prefix adopted (zero-copy) + suffix",
        max_abs_delta(got, ref),
        control,
        max_abs_delta(b.kernel(nudged=ids[-1]).session().append(ids), ref),
        "control: adopted blocks of a prefix whose first token differs",
    )


def run_checks(
    backend: str = "numpy", device: str = "cpu", threads: int = 1, seed: int = 0, hf: bool = True
) -> list[ExactnessCheck]:
    """Run every check on fresh synthetic kernels (and HF parity when transformers imports)."""
    b = _Bench(backend, device, threads, seed)
    rows = [
        prefix_reuse(b),
        decode(b),
        *evict_vs_never(b),
        middleexact_row(b),
        reposition_invariant(b),
        *reposition_depth(b),
        layer0_recomputed(b),
        sibling_isolation(b),
        prefix_adoption(b),
    ]
    if hf:
        from fleet.core.kernel.hf_check import hf_parity

        rows.extend(hf_parity(backend, device, threads))
    return rows


def environment(backend: str = "numpy", device: str = "cpu", threads: int = 1) -> dict[str, Any]:
    return Kernel.synthetic(ModelConfig.tiny(), backend=backend, device=device, threads=threads).env()
