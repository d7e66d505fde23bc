"""Fleet prefill tokens on the demo's workload: kvfleet (live) vs the oracle and the two baselines.

    python bench/fleet_prefill.py                      # 5 agents x 50 turns, two cache sizes
    python bench/fleet_prefill.py --agents 3 --turns 12 --capacities 2048

For each per-worker cache size the whole demo runs live (controller, local Ray, stand-ins), its
trace is replayed under the oracle, the lifecycle-blind prefix router and round-robin, and the
figures (defined in docs/demo.md) go side by side, as ratios to the oracle. Writes the
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

from fleet.cli.demo import run_demo  # noqa: E402
from fleet.demo.summary import LABELS, ORDER  # noqa: E402
from fleet.demo.workload import DemoConfig  # noqa: E402


def run_one(agents: int, turns: int, num_blocks: int) -> dict[str, Any]:
    t0 = time.monotonic()
    out = asyncio.run(run_demo(DemoConfig(agents=agents, turns=turns, num_blocks=num_blocks)))
    s = out.summary
    s["bench_wall_s"] = round(time.monotonic() - t0, 1)
    return s


def table(runs: list[tuple[int, dict[str, Any]]]) -> str:
    rows = ["| blocks / worker | routing | prefill tokens | × oracle | hit rate | stale warm routes | "
            "requests to sleeping |", "|---:|---|---:|---:|---:|---:|---:|"]
    for nb, s in runs:
        oracle = s["policies"]["oracle"]["prefill_tokens"] or 1
        for name in ORDER:
            p = s["policies"][name]
            stale = "n/a" if name == "round_robin" else str(p["stale_warm_routes"])
            rows.append(f"| {nb} | {LABELS[name]} | {p['prefill_tokens']:,} | {p['prefill_tokens'] / oracle:.3f} | "
                        f"{100 * p['hit_rate']:.1f}% | {stale} | {p['to_sleeping']} |")
    return "\n".join(rows)


def plot(runs: list[tuple[int, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(ORDER)
    for k, name in enumerate(ORDER):
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
    p.add_argument("--agents", type=int, default=5)
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--capacities", default="2048,1024,384", help="blocks per stand-in worker, comma-separated")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    a = p.parse_args(argv)
    runs = []
    for nb in (int(x) for x in a.capacities.split(",")):
        s = run_one(a.agents, a.turns, nb)
        runs.append((nb, s))
        live, oracle = s["policies"]["kvfleet"]["prefill_tokens"], s["policies"]["oracle"]["prefill_tokens"]
        print(f"{nb} blocks/worker: kvfleet {live:,} vs oracle {oracle:,} prefill tokens "
              f"(x{live / max(oracle, 1):.3f}); run {s['bench_wall_s']}s", flush=True)
    png = a.out.parent / "fleet_prefill.png"
    plot(runs, png)
    w = runs[0][1]["workload"]
    body = "\n".join([
        "## Fleet prefill on the demo's workload (`bench/fleet_prefill.py`)",
        "",
        f"{w['agents']} agents x {w['turns']} turns over one shared system prompt ({w['requests']} requests, "
        f"{w['prompt_tokens']:,} prompt tokens, longest {w['longest_prompt']:,}), {w['workers']} vLLM stand-ins, "
        "a fork into 2 branches, a quarantined tool result, one worker slept and woken through the "
        "controller and one behind its back. kvfleet's figures are the live stand-ins' own counts; the "
        "others replay the same trace through the stand-in's engine code (definitions: docs/demo.md).",
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
