"""The same cells under several trace seeds, pooled: is a loss at one seed the workload's, or that seed's?

    python bench/peers/seeds.py RUN.json [RUN.json ...] [--section fleet-routing-seeds] [--notes F] [--no-docs]

Each RUN.json is what `bench/fleet_routing.py --seed S --repeat N --json` saved. They must share every option but the
seed; a cell may come in several files, once per seed and all at one commit, and each cell is pooled alone. The seed draws the trace (the agents' think times,
their tool results and instructions), so each seed is another sample of the same workload, where `--repeat` reruns
one trace. Per cell and contender: each seed's median prefill (its runs' lower median, as the bench's tables give
it), the median over every run of every seed, the median TTFT p50 and p99 over every run, and, where kvfleet's proxy
judged tool results (the agents-tools workload), how many it judged and withheld, summed.

Two comparisons with the best peer, which answer different questions:
- pooled: the peer whose pooled median is lowest, fixed for the cell, against kvfleet's pooled median;
- seed by seed: the lowest peer median of each seed, against kvfleet's median of that seed. The minimum of several
  noisy peers' medians is biased low, so this count leans against kvfleet; it says how often a single
  `--repeat` section would have shown a loss.
As in the bench's tables, only peers that completed every request of a run are compared on prefill (a request that
failed before it ran prefilled nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from peers.repeats import median_of  # noqa: E402
from peers.report import PEER_KINDS, best_peers  # noqa: E402
from peers.summary import summarize  # noqa: E402

Runs = dict[str, dict[int, list[dict[str, Any]]]]  # contender -> seed -> each run's summary
TOP = 1.4  # the plot's scale ends here: a peer that put every request on one worker ran 2.6x


def check(results: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Each cell's seeds, in the order given. Refused: runs that differ in anything but the seed and the cells, a cell
    measured at two commits, or a cell twice under one seed (files may hold different cells, of different commits:
    each cell is pooled alone)."""
    first = results[0]
    seeds: dict[str, list[int]] = {}
    commits: dict[str, str] = {}
    for r in results:
        if {**r["options"], "seed": 0} != {**first["options"], "seed": 0} or r.get("quick") != first.get("quick"):
            raise ValueError("runs whose options differ in more than the seed are not pooled")
        for c in r["cells"]:
            name, seed = _key(c), r["options"]["seed"]
            if commits.setdefault(name, r["commit"]) != r["commit"]:
                raise ValueError(f"{name}: runs of different commits ({commits[name][:7]}, {r['commit'][:7]}) are "
                                 "not pooled")
            have = seeds.setdefault(name, [])
            if seed in have:
                raise ValueError(f"{name} comes twice under seed {seed}: pool --repeat runs with fleet_routing --from-json")
            have.append(seed)
    return seeds


def _key(cell: dict[str, Any]) -> str:
    return f"{cell['workload']['name']}/{cell['cache']}"


class Cell(NamedTuple):
    seeds: list[int]  # in the order given
    runs: Runs
    kinds: dict[str, str]  # contender -> its kind


def pool(results: list[dict[str, Any]]) -> dict[str, Cell]:
    """Every cell's run summaries by contender and seed (each run summarized once), after `check`."""
    cells = {name: Cell(seeds, {}, {}) for name, seeds in check(results).items()}
    for res in results:
        seed = res["options"]["seed"]
        for cell in res["cells"]:
            runs, kinds = cells[_key(cell)].runs, cells[_key(cell)].kinds
            for run in cell["runs"]:
                summary = summarize(run)
                counters = run.get("proxy_counters") or {}
                for what in ("judged", "withheld"):  # tool results the proxy judged and withheld (agents-tools)
                    summary[what] = sum(v for k, v in counters.items() if k.split(" ")[0] == what)
                runs.setdefault(run["contender"], {}).setdefault(seed, []).append(summary)
                kinds[run["contender"]] = run["kind"]
    return cells


def best_peer(runs: Runs, kinds: dict[str, str], seeds: list[int] | None = None) -> str | None:
    """The peer with the lowest median prefill over the given seeds' runs (all seeds: the pooled best), by the bench's
    own rule (peers.report.best_peers: a peer that lost a request in one of those runs is compared only where no peer
    completed them all)."""
    pooled = []
    for c, by in runs.items():
        picked = [s for seed, ss in by.items() if seeds is None or seed in seeds for s in ss]
        if picked:
            summary = {"prefilled": median_of([s["prefilled"] for s in picked]), "ttft_p99": None, "rps": 0.0,
                       "ok": sum(s["ok"] for s in picked), "n": sum(s["n"] for s in picked)}
            pooled.append({"contender": c, "kind": kinds[c], "summary": summary})
    best = best_peers({"runs": pooled})["prefilled"]
    return best[0] if best else None


def cell_table(name: str, seeds: list[int], runs: Runs, kinds: dict[str, str]) -> list[str]:
    pooled = {c: median_of([s["prefilled"] for ss in by.values() for s in ss]) for c, by in runs.items()}
    judged = any(s["judged"] for by in runs.values() for ss in by.values() for s in ss)
    best = best_peer(runs, kinds)
    out = [
        f"**{name}**: prefilled tokens, each seed's median of its runs, and every run pooled"
        + (f" (the pooled best peer: {best})" if best else ""),
        "",
        "| contender | " + " | ".join(f"seed {s}" for s in seeds) + " | pooled (runs) | x pooled best peer | TTFT p50 / p99 ms, pooled | requests not completed |"
        + (" tool results judged / withheld |" if judged else ""),
        "|---|" + "---:|" * (len(seeds) + 4 + judged),
    ]
    for c, by in runs.items():
        per = [median_of([s["prefilled"] for s in by.get(seed, [])]) for seed in seeds]
        every = [s for ss in by.values() for s in ss]
        p50, p99 = (median_of([s[k] for s in every]) for k in ("ttft_p50", "ttft_p99"))
        ratio = f"{pooled[c] / pooled[best]:.2f}x" if best and pooled[best] else "-"
        out.append(
            f"| {c} | " + " | ".join("-" if v is None else f"{v:,}" for v in per)
            + f" | {pooled[c]:,} ({len(every)}) | {ratio} | "
            + " / ".join("-" if t is None else f"{1000 * t:,.0f}" for t in (p50, p99))
            + f" | {sum(s['n'] - s['ok'] for s in every)} |"
            + (f" {sum(s['judged'] for s in every):,.0f} / {sum(s['withheld'] for s in every):,.0f} |" if judged else "")
        )
    return out


def seed_verdicts(name: str, seeds: list[int], runs: Runs, kinds: dict[str, str]) -> str:
    """Seed by seed: kvfleet's median against that seed's best peer median."""
    if "kvfleet" not in runs:
        return f"- {name}: no kvfleet runs"
    parts, wins = [], 0
    for seed in seeds:
        best = best_peer(runs, kinds, [seed])
        ours = median_of([s["prefilled"] for s in runs["kvfleet"].get(seed, [])])
        theirs = median_of([s["prefilled"] for s in runs[best].get(seed, [])]) if best else None
        if ours is None or not theirs:
            parts.append(f"seed {seed}: -")
            continue
        wins += ours <= theirs
        parts.append(f"seed {seed}: {ours / theirs:.2f}x {best}")
    return f"- {name}: kvfleet at or below that seed's best peer in {wins} of {len(seeds)} seeds ({'; '.join(parts)})"


def report(results: list[dict[str, Any]], cells: dict[str, Cell] | None = None) -> str:
    """The section's markdown (`cells`: `pool(results)`, pooled here when not given)."""
    cells = pool(results) if cells is None else cells
    runs_of = sorted({(r["commit"][:7], r.get("cells_arg"),
                       ",".join(dict.fromkeys(run["contender"] for run in r["cells"][0]["runs"])), r.get("repeats", 1))
                      for r in results}, key=str)
    lines = [
        "## Fleet routing across trace seeds (`python bench/peers/seeds.py`)",
        "",
        "Measured with "
        + "; ".join(f"`bench/fleet_routing.py --cells {c} --contenders {k} --repeat {n} --seed S` at commit `{h}`"
                    for h, c, k, n in runs_of)
        + ", everything else as in the sections that published the cells (stand-ins, hazards, timeouts). A seed draws "
        "another trace of the same workload (think times, tool results, instructions); `--repeat` reruns one trace. "
        "The seed-by-seed comparison takes the lowest peer median of each seed, a minimum of noisy figures that leans "
        "against kvfleet; the pooled one fixes the cell's best peer over every run. Only peers that completed every "
        "request of every run are compared on prefill, as in the bench's tables.",
        "",
    ]
    verdicts = []
    for name, (seeds, runs, kinds) in cells.items():
        lines += cell_table(name, seeds, runs, kinds) + [""]
        verdicts.append(seed_verdicts(name, seeds, runs, kinds))
    return "\n".join(lines + verdicts) + "\n"


def plot(results: list[dict[str, Any]], cells: dict[str, Cell], path: Path) -> None:
    """Every run of every seed as a point, relative to its cell's pooled best peer; a bar at each pooled median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.9 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    low = 1.0
    for ax, (name, (_, runs, kinds)) in zip(axes.flat, cells.items(), strict=False):
        best = best_peer(runs, kinds)
        ref = median_of([s["prefilled"] for ss in runs[best].values() for s in ss]) if best else None
        for x, (c, by) in enumerate(runs.items()):
            ys = [s["prefilled"] / ref for ss in by.values() for s in ss] if ref else []
            color = "tab:red" if kinds[c] not in PEER_KINDS else "tab:blue"
            dx = [x + 0.08 * ((i % 5) - 2) for i in range(len(ys))]
            ax.scatter([d for d, y in zip(dx, ys, strict=True) if y <= TOP], [y for y in ys if y <= TOP], s=10,
                       alpha=0.6, color=color)
            over = [y for y in ys if y > TOP]  # off the scale: a triangle at the top, with the largest value
            if over:
                ax.scatter([x], [TOP], marker="^", s=24, color=color)
                ax.annotate(f"{len(over)} up to {max(over):.1f}x", (x, TOP), fontsize=6, ha="center",
                            xytext=(0, -10), textcoords="offset points")
            if ys:
                low = min(low, *ys)
                ax.hlines(median_of(ys), x - 0.3, x + 0.3, color="black", linewidth=1.5)
        ax.axhline(1.0, color="grey", linewidth=0.6, linestyle="--")
        ax.set_xticks(range(len(runs)), list(runs), rotation=30, ha="right", fontsize=7)
        ax.set_title(name, fontsize=9)
    axes.flat[0].set_ylim(low - 0.02, TOP * 1.01)  # shared by every cell
    for row in axes:
        row[0].set_ylabel("prefilled / pooled best peer's median\n(lower is better)", fontsize=8)
    commits = ", ".join(sorted({r["commit"][:7] for r in results}))
    fig.suptitle(f"Fleet routing across trace seeds: every run (bar: pooled median), commit {commits}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--section", default="fleet-routing-seeds", help="the docs/benchmarks.md section to write")
    p.add_argument("--notes", type=Path, help="markdown appended to the section")
    p.add_argument("--no-docs", action="store_true", help="print the section only")
    a = p.parse_args(argv)
    results = []
    for f in a.runs:
        try:
            results.append(json.loads(f.read_text()))
        except (OSError, ValueError) as e:  # a JSONDecodeError is a ValueError
            raise SystemExit(f"seeds: {f}: not a saved fleet_routing run ({e})") from None
    try:
        cells = pool(results)
    except ValueError as e:
        raise SystemExit(f"seeds: {e}") from None
    except KeyError as e:
        raise SystemExit(f"seeds: a run has no {e} (not what fleet_routing --json saves)") from None
    section = report(results, cells)
    png = Path(__file__).resolve().parents[2] / "docs" / (a.section.replace("-", "_") + ".png")
    section += f"\n![every run of every seed, relative to the cell's pooled best peer]({png.name})\n"
    if a.notes is not None:
        section += "\n" + a.notes.read_text().strip() + "\n"
    print(section)
    if not a.no_docs:
        from benchdoc import DOC, write_section

        plot(results, cells, png)
        write_section(a.section, section)
        print(f"wrote {DOC} (section {a.section}) and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
