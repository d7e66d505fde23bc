"""Held-out evaluation of the quarantine detector policies, side by side in one run (issue #28): the numpy
policies and the encoder committee (the heavier judge, with and without the numpy layers).

    python bench/detector_eval.py            # prints the tables, rewrites the `detector-eval` section
    python bench/detector_eval.py --no-doc   # prints only
    python bench/detector_eval.py --no-encoder   # leaves out the ungated torch policies (minutes, not ~half an hour)
    python bench/detector_eval.py --no-encoder --no-gated   # numpy policies only (~30 s)

Reads the shipped models; the test split `scripts/train_detector.py` wrote (never used while tuning); the
multilingual benign test part `scripts/train_fast.py` wrote; real benign files of the test split's packages
(source "pypi-files"); the generated tool outputs (scripts/injection_corpus/tool_outputs.py, seed 0); the routing
bench's own agent tool results (bench/routing_trace.py, every workload); the repo's hand-written corpus.
Cost: median process CPU ms per KiB at 1 / 4 / 16 / 256 KiB (and 1 MiB, the learned layer's max_chars, for the numpy
policies), and resident MB (a fresh process per policy: its RSS after import, after building the detector, and its
peak after judging a 256 KiB and a 1 MiB result).
The gated policies (rules + learned + the encoder where the learned score >= ENCODER_GATE, or on the windows its
tokenizer cuts into word pieces at most MAX_FRAGMENTATION; the encoder's verdicts off the request path;
docs/quarantine_default.md) also report, per benign set, the share of texts that pass the gate and the CPU of
their heavy jobs (the full verdict of the texts that pass; a text the gate stops gets none).
Writes the figures to tests/fleet/quarantine/data/heldout_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchdoc import write_section

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fleet" / "quarantine"))
sys.path.insert(0, str(ROOT / "bench"))

import quarantine_corpus as C  # noqa: E402
from routing_trace import WORKLOADS, workload  # noqa: E402

from bench.detector_heldout import (  # noqa: E402
    HELDOUT_FILE,
    REAL_BENIGN_SOURCE,
    Scores,
    load_heldout,
    score,
    tool_outputs,
)
from fleet.core.quarantine import DetectorConfig, make_detector  # noqa: E402
from fleet.core.quarantine.detector import Verdict  # noqa: E402
from fleet.core.quarantine.encoder import missing_modules  # noqa: E402
from fleet.core.quarantine.layered import member_scores  # noqa: E402

DATA = ROOT / "tests" / "fleet" / "quarantine" / "data"
MULTILINGUAL_FILE = "benign_multilingual_test.jsonl.gz"
NUMPY_CONFIGS = {
    "rules alone": DetectorConfig(layers=("rules",)),
    "learned alone": DetectorConfig(layers=("learned",)),
    "rules + learned": DetectorConfig(layers=("rules", "learned")),
}
# The committee alone is read off the previous default's verdicts (each member's score is in them), so the
# encoder runs once per text.
ENCODER_FULL = "rules + learned + encoder committee, ungated (opt-in heavier judge)"
ENCODER_ALONE = "encoder committee alone (opt-in heavier judge)"
# The encoder gate chosen on validation by the pre-registered rule (docs/quarantine_default.md: the best validation
# recall with precision >= 0.95, generated FPR <= 0.5%, multilingual validation FPR <= 0.5%); not the default.
ENCODER_GATE = 0.918
GATED = f"rules + learned + encoder gated at learned >= {ENCODER_GATE} (heavy path)"
GATED_CONFIG = DetectorConfig(layers=("rules", "learned", "encoder"), encoder_gate=ENCODER_GATE)
# The window gate chosen on validation by its own pre-registered rule (same bounds; docs/quarantine_default.md): an
# encoder window counts only if at most this share of its tokens are word pieces; not the default either.
MAX_FRAGMENTATION = 0.2
FRAG = f"rules + learned + encoder on windows of fragmentation <= {MAX_FRAGMENTATION} (heavy path)"
FRAG_CONFIG = DetectorConfig(layers=("rules", "learned", "encoder"), encoder_max_fragmentation=MAX_FRAGMENTATION)
# each heavy-path policy: its config, and what lets a text reach the encoder (the cost table's words)
HEAVY = {GATED: (GATED_CONFIG, f"its learned score >= {ENCODER_GATE}"),
         FRAG: (FRAG_CONFIG, f"one of its windows is cut into word pieces at most {MAX_FRAGMENTATION}")}
BENIGN_SETS = ("multilingual_benign", "routing_bench_tool_results", "real_benign", "tool_outputs")
KIBS = (1, 4, 16, 256)
NUMPY_KIBS = (*KIBS, 1024)  # the encoder policies take minutes per MiB
NUMPY_PROCESSES = 5


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (round(max(0.0, c - h), 4), round(min(1.0, c + h), 4))


def bench_tool_results() -> list[str]:
    """Every agent tool result of the routing bench's workloads (the text a tool turn carries)."""
    out = []
    for name in WORKLOADS:
        for s in workload(name, seed=0).sessions:
            for user, _ in s.turns:
                tool = user.split("\ninstruction: ")[0] if name != "demo" else user.split("\n")[0]
                if tool.strip():
                    out.append(tool)
    return sorted(set(out))


def sets() -> dict[str, tuple[list[str], list[int]]]:
    rows = load_heldout(DATA / HELDOUT_FILE)
    ml = [r["text"] for r in load_heldout(DATA / MULTILINGUAL_FILE)]
    real = [r["text"] for r in rows if r["source"] == REAL_BENIGN_SOURCE]
    gen = [t for _, t in tool_outputs()]
    agent = bench_tool_results()
    return {
        "test": ([r["text"] for r in rows], [r["label"] for r in rows]),
        "multilingual_benign": (ml, [0] * len(ml)),
        "routing_bench_tool_results": (agent, [0] * len(agent)),
        "real_benign": (real, [0] * len(real)),
        "tool_outputs": (gen, [0] * len(gen)),
        "repo_corpus": (C.POISONED + C.BENIGN, [1] * len(C.POISONED) + [0] * len(C.BENIGN)),
        "repo_heldout": (
            C.HELDOUT_POISONED + C.HELDOUT_BENIGN,
            [1] * len(C.HELDOUT_POISONED) + [0] * len(C.HELDOUT_BENIGN),
        ),
    }


def summarise(s: Scores) -> dict[str, Any]:
    return s.to_dict() | {
        "precision_ci": wilson(s.tp, s.tp + s.fp),
        "recall_ci": wilson(s.tp, s.tp + s.fn),
        "fpr_ci": wilson(s.fp, s.fp + s.tn),
    }


def gate_costs(texts: list[str], vs: list[Verdict], cpu: list[float], fast_cpu: list[float]) -> dict[str, float]:
    """What the gated policy's heavy path costs on one set: how many texts (and KiB) pass the gate, and the
    process CPU of their full verdicts (every layer: the heavy job) per KiB of the whole set and of the texts
    that pass; the fast path's (rules + learned) CPU per KiB of the set beside it."""
    kib = [len(t.encode("utf-8", "surrogatepass")) / 1024 for t in texts]
    on = [v.encoder_score is not None for v in vs]
    k_all, k_on = sum(kib), sum(k for k, o in zip(kib, on, strict=True) if o)
    c_on = sum(c for c, o in zip(cpu, on, strict=True) if o)
    return {"texts": len(texts), "passed": sum(on), "kib": round(k_all, 1), "kib_passed": round(k_on, 1),
            "heavy_ms_per_kib": round(1000 * c_on / k_all, 3) if k_all else 0.0,
            "heavy_ms_per_kib_passed": round(1000 * c_on / k_on, 3) if k_on else 0.0,
            "fast_ms_per_kib": round(1000 * sum(fast_cpu) / k_all, 3) if k_all else 0.0}


def timed(det: Any, texts: list[str]) -> tuple[list[Verdict], list[float]]:
    vs, cpu = [], []
    for t in texts:
        c0 = time.process_time()
        vs.append(det.inspect(t))
        cpu.append(time.process_time() - c0)
    return vs, cpu


def evaluate(encoder: bool, gated: bool = False) -> dict[str, Any]:
    data = sets()
    rows = load_heldout(DATA / HELDOUT_FILE)
    verdicts: dict[str, dict[str, list[Verdict]]] = {}
    fast_cpu: dict[str, list[float]] = {}
    for name, cfg in NUMPY_CONFIGS.items():
        det = make_detector(cfg)
        got = {k: timed(det, texts) for k, (texts, _) in data.items()}
        verdicts[name] = {k: vs for k, (vs, _) in got.items()}
        if name == "rules + learned":
            fast_cpu = {k: cpu for k, (_, cpu) in got.items()}
    gate: dict[str, dict[str, dict[str, float]]] = {}
    for name, (cfg, _) in HEAVY.items() if gated else ():
        det = make_detector(cfg)
        det.inspect("warm up: the encoder's first call")
        got = {k: timed(det, texts) for k, (texts, _) in data.items()}
        verdicts[name] = {k: vs for k, (vs, _) in got.items()}
        gate[name] = {k: gate_costs(data[k][0], *got[k], fast_cpu[k]) for k in data}
    if encoder:
        det = make_detector(DetectorConfig(layers=("rules", "learned", "encoder")))
        full = {k: [det.inspect(t) for t in texts] for k, (texts, _) in data.items()}
        thr = dict(zip(det.member_names, det.encoder_thresholds, strict=True))
        alone = {
            k: [Verdict(any(p >= thr[m] for m, p in member_scores(v).items())) for v in vs]
            for k, vs in full.items()
        }
        verdicts[ENCODER_ALONE], verdicts[ENCODER_FULL] = alone, full
    out: dict[str, Any] = {"sizes": {k: [len(t), sum(y)] for k, (t, y) in data.items()}, "detectors": {}}
    labels = [r["label"] for r in rows]
    for name, vs in verdicts.items():
        d = {k: summarise(score(vs[k], y)) for k, (_, y) in data.items()}
        d["test_by_source"] = {
            src: score([vs["test"][i] for i in idx], [labels[i] for i in idx]).to_dict()
            for src in sorted({r["source"] for r in rows})
            if (idx := [i for i, r in enumerate(rows) if r["source"] == src])
        }
        out["detectors"][name] = d
    for name, g in gate.items():
        out["detectors"][name]["gate"] = g
    return out


PROBE = """
import json, sys, time
sys.path.insert(0, {root!r})
def rss(key="VmRSS:"):
    return int(open("/proc/self/status").read().split(key)[1].split()[0]) / 1024
from concurrent.futures import ThreadPoolExecutor
from fleet.core.quarantine import DetectorConfig, make_detector
from bench.detector_heldout import tool_outputs
a = rss()
det = make_detector(DetectorConfig(layers={layers!r}, encoder_gate={gate!r}, encoder_max_fragmentation={frag!r}))
judge = ThreadPoolExecutor(1)  # NOTE: on a pool thread, as the controller's judge lanes run it
blob = "\\n".join(t for _, t in tool_outputs())
judge.submit(det.inspect, blob[:4096]).result()
b = rss()
out = {{"import_mb": a, "loaded_mb": b}}
for kib in {kibs!r}:
    text = (blob * (1 + (kib << 10) // len(blob)))[: kib << 10]
    ts = []
    for _ in range(max(3, 192 // kib)):
        t0 = time.process_time(); judge.submit(det.inspect, text).result(); ts.append(time.process_time() - t0)
    ts.sort()
    out[f"{{kib}} KiB"] = ts[len(ts) // 2] * 1000 / kib
    out[f"peak_mb {{kib}} KiB"] = rss("VmHWM:")
print(json.dumps(out))
"""


def cost(layers: tuple[str, ...], kibs: tuple[int, ...] = KIBS, gate: float | None = None,
         processes: int = 1, frag: float | None = None) -> dict[str, float]:
    """CPU ms per KiB (median of max(3, 192 // KiB) runs, process CPU time: other load on the machine counts only
    through the cache and the cores it shares) and resident MB of a fresh process that builds and runs the policy
    (its peak after each size, smallest first). Each text is judged on a pool thread, as the controller's judge
    lanes (controller/judge_lanes.py) run it: glibc gives that thread its own malloc arena, which does not hand
    its top back to the kernel after every call as the main thread's heap does (about 200 minor page faults and
    0.4-0.5 ms of system time per 4 KiB on the main thread; none on the pool thread), and keeps about 2 MB more
    resident at its peak. With `processes` > 1, each figure is the median over that many fresh processes, and the
    4 KiB figure's range is kept beside it.

    NOTE: the peak is the process's VmHWM, not ru_maxrss: Linux carries the forking parent's peak into a child's
    ru_maxrss across exec, so after `evaluate` every policy read the bench's own 61 MB."""
    code = PROBE.format(root=str(ROOT), layers=layers, kibs=kibs, gate=gate, frag=frag)
    runs = []
    for _ in range(processes):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    out["4 KiB min"], out["4 KiB max"] = (round(f(r["4 KiB"] for r in runs), 3) for f in (min, max))
    out["processes"] = processes
    return out


def latency(encoder: bool, gated: bool = False) -> dict[str, dict[str, float]]:
    # NOTE: the numpy policies in 5 fresh processes each: one process's CPU per call moves by up to 25% with no
    # other load (3.96-5.24 ms per 4 KiB result over six, all user time: its memory layout), so one is not a figure
    out = {name: cost(cfg.layers, NUMPY_KIBS, processes=NUMPY_PROCESSES) for name, cfg in NUMPY_CONFIGS.items()}
    for name, (cfg, _) in HEAVY.items() if gated else ():
        out[name] = cost(cfg.layers, KIBS, cfg.encoder_gate, frag=cfg.encoder_max_fragmentation)
    if encoder:
        out[ENCODER_FULL] = cost(("rules", "learned", "encoder"))
        out[ENCODER_ALONE] = cost(("encoder",))
    return out


def per4(v: dict[str, float]) -> str:
    """CPU ms per 4 KiB result, with its range over the processes when there were several."""
    if v.get("processes", 1) > 1:
        return f"{v['4 KiB'] * 4:.2f} ({v['4 KiB min'] * 4:.2f}-{v['4 KiB max'] * 4:.2f})"
    return f"{v['4 KiB'] * 4:.2f}"


def _ci(d: dict[str, Any], key: str, k: str, n: str) -> str:
    lo, hi = d[f"{key}_ci"]
    return f"{d[key]:.3f} [{lo:.3f}, {hi:.3f}]"


def render(ev: dict[str, Any], lat: dict[str, dict[str, float]], elapsed: float) -> str:
    sz = ev["sizes"]
    took = f"One run ({elapsed / 60:.0f} min)" if elapsed >= 120 else f"One run ({elapsed:.0f} s)"
    lines = [
        "## Quarantine detector, held-out (bench/detector_eval.py)",
        "",
        f"{took}. Test split: {sz['test'][0]} tool results ({sz['test'][1]} injections; "
        "read for eight configurations, the seventh the rules' escape view, whose letters-only rule was chosen after a "
        "false positive it showed, the eighth the encoder's fragmentation gate; docs/quarantine_default.md). "
        f"Multilingual benign test part: {sz['multilingual_benign'][0]} tool outputs (real Django / Sphinx "
        f"translations in ~100 languages as messages, JSON, logs, CSV; shell output, tracebacks, code, base64 / hex). "
        f"Routing bench agent tool results: {sz['routing_bench_tool_results'][0]}. Real benign files: "
        f"{sz['real_benign'][0]}; generated tool outputs (seed 0): {sz['tool_outputs'][0]}. Brackets: Wilson 95%.",
        "",
        "| policy | test precision | test recall | tp / fp / fn | multilingual FPR | routing-bench FPR "
        "| real benign FPR | generated FPR | repo corpus P / R | repo held-out P / R |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in ev["detectors"].items():
        t, m, a, r, g = (
            d["test"],
            d["multilingual_benign"],
            d["routing_bench_tool_results"],
            d["real_benign"],
            d["tool_outputs"],
        )
        c, h = d["repo_corpus"], d["repo_heldout"]
        fpr = [f"{x['fp']}/{x['fp'] + x['tn']} (<= {x['fpr_ci'][1]:.3f})" for x in (m, a, r, g)]
        lines.append(
            f"| {name} | {_ci(t, 'precision', 'tp', 'fp')} | {_ci(t, 'recall', 'tp', 'fn')} | {t['tp']} / {t['fp']} / "
            f"{t['fn']} | {' | '.join(fpr)} | {c['precision']:.3f} / {c['recall']:.3f} | "
            f"{h['precision']:.3f} / {h['recall']:.3f} |"
        )
    load = " / ".join(f"{x:.1f}" for x in ev.get("load", ()))
    lines += [
        "",
        "Cost: median process CPU ms per KiB of tool-output text, each text judged on a pool thread as the "
        "controller's judge lanes run it (one thread of numpy; torch's threads summed; "
        f"load average before / after the cost runs {load} on {os.cpu_count()} cores), and resident MB of a fresh "
        "process (after importing fleet.core.quarantine / after building the policy and judging 4 KiB / peak after "
        "judging 256 KiB / peak after judging 1 MiB). The numpy policies' figures are medians over "
        f"{NUMPY_PROCESSES} fresh processes (a single process's CPU per call moves by up to 25% with its memory "
        "layout), with the range of the 4 KiB result's figure beside it:",
        "",
        "| policy | 1 KiB | 4 KiB | 16 KiB | 256 KiB | 1 MiB | ms per 4 KiB result | RSS MB import / loaded / peak 256 KiB "
        "/ 1 MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, v in lat.items():
        mib = (f"{v['1024 KiB']}", f"{v['peak_mb 1024 KiB']:.0f}") if "1024 KiB" in v else ("-", "-")
        lines.append(
            f"| {n} | {v['1 KiB']} | {v['4 KiB']} | {v['16 KiB']} | {v['256 KiB']} | {mib[0]} | {per4(v)} | "
            f"{v['import_mb']:.0f} / {v['loaded_mb']:.0f} / {v['peak_mb 256 KiB']:.0f} / {mib[1]} |"
        )
    for name, (_, passes) in HEAVY.items():
        if name not in ev["detectors"]:
            continue
        lines += ["", f"The heavy path of \"{name}\": a text reaches the encoder only when {passes} (otherwise the "
                  "fast verdict is final). Per set: texts (KiB) that pass the gate, and the process CPU of their full "
                  "verdicts (the heavy jobs) in ms per KiB of the whole set and of the texts that pass; the fast path's "
                  "(rules + learned) per KiB of the set beside it:", "",
                  "| set | pass the gate | KiB passing | heavy ms / KiB of the set | heavy ms / KiB passing "
                  "| fast ms / KiB of the set |", "|---|---|---|---|---|---|"]
        for k, g in ev["detectors"][name]["gate"].items():
            lines.append(f"| {k} | {g['passed']}/{g['texts']} | {g['kib_passed']} of {g['kib']} | "
                         f"{g['heavy_ms_per_kib']} | {g['heavy_ms_per_kib_passed']} | {g['fast_ms_per_kib']} |")
    if ENCODER_ALONE not in lat:
        lines += ["", "The encoder policies were not run (--no-encoder); docs/quarantine.md keeps their last figures (and "
                  "tests/fleet/quarantine/data/heldout_report.json at commit 9e8c2bd)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--no-encoder", action="store_true", help="leave out the ungated torch policies")
    ap.add_argument("--no-gated", action="store_true", help="leave out the gated policies (they need the encoder extra)")
    ap.add_argument("--json", type=Path, help="also write the figures here (with --no-doc: only here)")
    a = ap.parse_args()
    gated = not a.no_gated
    if gated and missing_modules():
        print(f"the gated policies need {', '.join(missing_modules())}; left out", file=sys.stderr)
        gated = False
    t0 = time.perf_counter()
    ev = evaluate(not a.no_encoder, gated)
    before = os.getloadavg()[0]
    lat = latency(not a.no_encoder, gated)
    ev["cost"], ev["load"] = lat, [before, os.getloadavg()[0]]
    body = render(ev, lat, time.perf_counter() - t0)
    print(body)
    if a.json:
        a.json.write_text(json.dumps(ev, indent=1, sort_keys=True) + "\n")
    if not a.no_doc:
        (DATA / "heldout_report.json").write_text(json.dumps(ev, indent=1, sort_keys=True) + "\n")
        write_section("detector-eval", body)


if __name__ == "__main__":
    main()
