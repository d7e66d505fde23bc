"""Several runs of the same cells, reported as one: the median per contender and metric, with its range.

A cell's `runs` may hold a contender more than once (`--repeat N`, or several `--json` files given to
`--from-json`). `collapse` replaces them with one entry whose summary holds, per metric, the median of the runs
(the lower middle one for an even count, so every figure is one that was measured), a `spread` of (min, max)
for the figures the tables show, and, for the counts a single bad run must not hide (stale warm routes,
requests to sleeping workers, failures), their sum over the runs.
"""

from __future__ import annotations

from statistics import median_low
from typing import Any

SUMMED = ("stale_warm", "stale_raced", "to_sleeping", "ok", "n", "timed_out", "errors", "aborted", "warm", "retried")
SPREAD = ("prefilled", "recomputed", "ttft_p50", "ttft_p99", "rps")


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Saved runs of the same commit and cells -> one results dict whose cells hold every run.

    Runs of different commits or different cells are refused: their median would describe no tree."""
    first = results[0]
    for r in results[1:]:
        if r["commit"] != first["commit"]:
            raise ValueError(f"runs of different commits ({first['commit'][:7]}, {r['commit'][:7]}) are not merged")
        if [_key(c) for c in r["cells"]] != [_key(c) for c in first["cells"]]:
            raise ValueError("runs of different cells are not merged")
        if r.get("options") != first.get("options"):
            raise ValueError("runs with different options are not merged")
    out = dict(first, took_s=sum(r["took_s"] for r in results), repeats=sum(r.get("repeats", 1) for r in results))
    out["cells"] = [
        dict(c, runs=[run for r in results for run in r["cells"][i]["runs"]]) for i, c in enumerate(first["cells"])
    ]
    return out


def _key(cell: dict[str, Any]) -> tuple[str, str]:
    return cell["workload"]["name"], cell["cache"]


def collapse(cell: dict[str, Any]) -> None:
    """Group the cell's runs by contender, in first-seen order; each group of summarized runs becomes one entry."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in cell["runs"]:
        groups.setdefault(r["contender"], []).append(r)
    cell["runs"] = [_one(runs) for runs in groups.values()]


def _one(runs: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in runs if "summary" in r]
    if len(runs) == 1 or not done:
        return runs[0]
    sums = [r["summary"] for r in done]
    summary = {k: median_of([s[k] for s in sums]) for k in sums[0]}
    summary.update({k: sum(s[k] or 0 for s in sums) for k in SUMMED if k in sums[0]})
    if all(s.get("stale_warm") is None for s in sums):
        summary["stale_warm"] = summary["stale_raced"] = None  # a peer: no verdicts to count
    summary["runs"] = len(done)
    summary["spread"] = {k: _range([s[k] for s in sums]) for k in SPREAD if k in sums[0]}
    return dict(done[0], summary=summary)


def median_of(xs: list[Any]) -> Any:
    """The lower median of the runs that measured it (a TTFT is None where no request completed)."""
    vals = [x for x in xs if x is not None]
    if not vals:
        return None
    if all(isinstance(x, bool) for x in vals):
        return any(vals)  # e.g. ttft_lower_bound: one run's timeouts make the median's bound a bound too
    return median_low(vals)  # every other figure of a summary is a number


def _range(xs: list[Any]) -> tuple[Any, Any] | None:
    nums = [x for x in xs if x is not None]
    return (min(nums), max(nums)) if nums else None
