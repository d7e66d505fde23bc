"""An exactness check's record: a measured max|Δ| with its control (fleet/core/kernel/exactness.py runs them,
fleet/core/kernel/hf_check.py adds the HF parity rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ExactnessCheck:
    """One exactness row. `claim`: "== 0" (bit-exact), "> 0" (a control), "<= 1e-4", or "reported".

    `control` is the coarse control (e.g. one token changed); `ulp_control` is the same comparison
    against a run whose input differs by one ulp (one embedding element nudged), which shows the
    check resolves a 1-ulp difference, not only a large one. A row that could not run has
    `ran=False` and is never ok.
    """

    name: str
    claim: str
    value: float
    control: float | None
    ok: bool
    note: str = ""
    ulp_control: float | None = None
    ran: bool = True

    @property
    def status(self) -> str:
        return "not run" if not self.ran else ("holds" if self.ok else "FAILS")

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "claim": self.claim,
            "value": self.value,
            "control": self.control,
            "ulp_control": self.ulp_control,
            "ok": self.ok,
            "status": self.status,
            "note": self.note,
        }


def not_run(name: str, claim: str, why: str) -> ExactnessCheck:
    """A check that did not run: reported as such, never ok."""
    return ExactnessCheck(name, claim, float("nan"), None, False, why, None, False)
