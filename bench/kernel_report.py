"""Shared helpers for the kernel benchmarks: timing and the docs/benchmarks.md section.

The kernel owns one section, `<!-- bench:kernel -->` ... `<!-- /bench:kernel -->`, holding one
sub-section per script (`<!-- bench:kernel_prefill -->` ...). Rewriting is idempotent and touches
nothing outside the kernel section.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from benchdoc import replace_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
PARTS = ("kernel_prefill", "kernel_evict", "kernel_fork")
HEADER = """## KV kernel (`fleet/core/kernel`)

Rerun each part with `./dev.sh bench kernel_prefill`, `./dev.sh bench kernel_evict`,
`./dev.sh bench kernel_fork` (each rewrites only its own block below). The GPU check is
`python bench/gpu_check.py` on a CUDA machine. Each block states its clock (the prefill block uses
the process's CPU time at 1 thread; the others wall-clock), best of the stated repetitions, on the
machine it names; the machine is shared, so treat them as ratios measured side by side in one run,
not absolute speeds.
"""


def best_of(fn: Callable[[], object], reps: int) -> float:
    """Fastest wall-clock seconds of `reps` calls."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def write_part(part: str, body: str) -> None:
    """Replace sub-section `part` inside the kernel section of docs/benchmarks.md (create as needed)."""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if "<!-- bench:kernel -->" not in text:
        inner = HEADER + "\n" + "\n\n".join(f"<!-- bench:{p} -->\n_(not run yet)_\n<!-- /bench:{p} -->" for p in PARTS)
        text = replace_section(text, "kernel", inner)
    i, j = text.find("<!-- bench:kernel -->"), text.find("<!-- /bench:kernel -->")
    section = replace_section(text[i:j], part, body)
    DOC.write_text(text[:i] + section + text[j:])
    print(f"wrote the {part} block of {DOC.relative_to(DOC.parent.parent)}")
