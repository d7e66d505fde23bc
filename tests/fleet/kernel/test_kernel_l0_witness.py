"""The witness's layer-0 reference does not read the layer-0 memo it checks. Found by review: with one
memo row off by 1e-3 before the prefill, EvictReport.exact stayed True and every witness row held,
because each reference (layer0_delta, the never-saw session) read the same memo row."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fleet.core.kernel import Kernel, check_bench, exactness

POST = exactness._Bench("numpy", "cpu", 1, 0).post


class _PoisonedMemo(Kernel):
    """Kernel.synthetic, but a 1-layer kernel's memo row of one survivor is off by 1e-3 before use."""

    @classmethod
    def synthetic(
        cls, cfg: Any, seed: int = 0, backend: str = "numpy", device: str = "cpu", **kw: Any
    ) -> Kernel:
        k = Kernel.synthetic(cfg, seed, backend, device, **kw)
        if cfg.n_layers == 1:
            k.ops._proj0(np.asarray(POST), 0, len(POST))  # fill the memo rows of the survivors
            k.ops._tab[k.ops._slots.rows[POST[5]]] += 1e-3
        return k


def test_a_wrong_memo_row_fails_the_witness(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = exactness.run_checks(backend, hf=False)
    assert all(r.ok for r in clean)  # control: holds with the memo intact
    monkeypatch.setattr(exactness, "Kernel", _PoisonedMemo)
    monkeypatch.setattr(check_bench, "Kernel", _PoisonedMemo)  # the checks' shared kernels (check_bench.Bench)
    rows = exactness.run_checks(backend, hf=False)
    failing = [r for r in rows if not r.ok]
    for r in rows:
        print(f"[poisoned l0 memo {backend}] {r.name}: {r.value:.3e} {r.status}")
    assert failing and all(r.value > 1e-4 for r in failing)  # before: every row held


def test_the_adoption_row_control_goes_through_adoption(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the adopted-prefix row's control was span-kept vs never-saw (the
    poison-vs-never row's value), which no adoption touches. Its control now adopts blocks that
    differ from the reference's, so it is 0 when adoption ignores the blocks."""
    b = exactness._Bench(backend, "cpu", 1, 0)
    row = exactness.prefix_adoption(b)
    poison = exactness.evict_vs_never(b)[1]
    assert row.ok and row.control is not None and row.control > 0 and row.control != poison.value
    real = Kernel.session

    def recompute(self: Kernel, prefix: Any = None) -> Any:  # adoption as a no-op: blocks ignored
        s = real(self)
        if prefix is not None:
            s.append(list(prefix.tokens))
        return s

    monkeypatch.setattr(Kernel, "session", recompute)
    blind = exactness.prefix_adoption(exactness._Bench(backend, "cpu", 1, 0))
    print(f"[adoption control {backend}] {row.control:.3e}; with the blocks ignored {blind.control:.3e}")
    assert blind.control == 0.0 and not blind.ok  # before: 0.809, and the row held
