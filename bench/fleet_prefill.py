"""Fleet prefill tokens on the demo's workload: kvfleet (live) vs the other routings, cache sizes side by side.

    python bench/fleet_prefill.py                      # the demo's default fleet, three cache sizes
    python bench/fleet_prefill.py --agents 3 --turns 12 --capacities 2048

For each per-worker cache size the whole demo runs live (controller, local Ray, stand-ins), its
trace is replayed under session-sticky hashing, greedy longest-prefix with perfect knowledge (not an
oracle: it knows no future and ignores load), the lifecycle-blind prefix router and round-robin
(and live through vllm-router kv_aware when installed), and the figures (defined in docs/demo.md)
go side by side, as ratios to kvfleet's. Writes the
<!-- bench:fleet --> section of docs/benchmarks.md and docs/fleet_prefill.png.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from benchdoc import write_section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.app.cli.demo import run_demo  # noqa: E402
from fleet.app.demo.summary import LABELS, NO_CLAIMS, ORDER  # noqa: E402
from fleet.app.demo.workload import DemoConfig  # noqa: E402


def run_one(agents: int, turns: int, workers: int, num_blocks: int) -> dict[str, Any]:
    t0 = time.monotonic()
    out = asyncio.run(run_demo(DemoConfig(agents=agents, turns=turns, workers=workers, num_blocks=num_blocks)))
    s = out.summary
    s["bench_wall_s"] = round(time.monotonic() - t0, 1)
    return s


def table(runs: list[tuple[int, dict[str, Any]]]) -> str:
    rows = ["| blocks / worker | routing | prefill tokens | vs kvfleet | hit rate | requests per worker | "
            "stale warm routes | requests to sleeping |", "|---:|---|---:|---:|---:|---|---:|---:|"]
    for nb, s in runs:
        ours = s["policies"]["kvfleet"]["prefill_tokens"] or 1
        for name in [n for n in ORDER if n in s["policies"]]:
            p = s["policies"][name]
            stale = "n/a" if name in NO_CLAIMS else str(p["stale_warm_routes"])
            share = "/".join(str(v) for v in p["per_worker"].values())
            rows.append(f"| {nb} | {LABELS[name]} | {p['prefill_tokens']:,} | {p['prefill_tokens'] / ours:.2f}x | "
                        f"{100 * p['hit_rate']:.1f}% | {share} | {stale} | {p['to_sleeping']} |")
    return "\n".join(rows)


def plot(runs: list[tuple[int, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [n for n in ORDER if all(n in s["policies"] for _, s in runs)]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + k * width for i in range(len(runs))]
        ys = [s["policies"][name]["prefill_tokens"] for _, s in runs]
        bars = ax.bar(xs, ys, width, label=LABELS[name])
        for b, (_, s) in zip(bars, runs, strict=True):
            n = s["policies"][name]["to_sleeping"]
            if n:
                ax.annotate(f"{n} to sleeping", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                            va="bottom", fontsize=7)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))], [f"{nb} blocks/worker" for nb, _ in runs])
    ax.set_ylabel("prefill tokens (lower is better)")
    w = runs[0][1]["workload"]
    ax.set_title(f"Demo workload: {w['agents']} agents x {w['turns']} turns, {w['requests']} requests, "
                 f"{w['workers']} workers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    d = DemoConfig()
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--capacities", default="4096,1024,512", help="blocks per stand-in worker, comma-separated")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    a = p.parse_args(argv)
    runs = []
    for nb in (int(x) for x in a.capacities.split(",")):
        s = run_one(a.agents, a.turns, a.workers, nb)
        runs.append((nb, s))
        print(f"{nb} blocks/worker: kvfleet {s['policies']['kvfleet']['prefill_tokens']:,} prefill tokens, "
              f"x{s['kvfleet_over_best_other_prefill']} the best other ({s['best_other']}); "
              f"run {s['bench_wall_s']}s", flush=True)
    png = a.out.parent / "fleet_prefill.png"
    plot(runs, png)
    w = runs[0][1]["workload"]
    body = "\n".join([
        "## Fleet prefill on the demo's workload (`bench/fleet_prefill.py`)",
        "",
        f"{w['agents']} agents x {w['turns']} turns over one shared system prompt ({w['requests']} requests, "
        f"final histories {w['final_history_blocks']:,} blocks in all, "
        f"{w['prompt_tokens']:,} prompt tokens, longest {w['longest_prompt']:,}), {w['workers']} vLLM stand-ins, "
        "a fork into 2 branches, a quarantined tool result, one worker slept and woken through the "
        "controller and one behind its back. kvfleet's figures are the live stand-ins' own counts; the "
        "others replay the same trace through the stand-in's engine code, vllm-router live on fresh "
        "stand-ins when installed (definitions: docs/demo.md). Requests are sent one at a time, so there "
        "is no queueing here: placement shows in prefill and share; queueing and TTFT are in the fleet "
        "routing section below.",
        "",
        table(runs),
        "",
        "Model fidelity (kvfleet's live choices replayed through the model, prefill delta vs live): "
        + ", ".join(f"{nb} blocks: {s['model_fidelity']['delta']}" for nb, s in runs) + ".",
        "",
        "![fleet prefill](fleet_prefill.png)",
    ])
    write_section("fleet", body, a.out)
    print(f"wrote {a.out} (section fleet) and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
