"""Held-out evaluation of the quarantine detector: each layer alone, rules + learned, round seven's layered
policy (one encoder) and the shipped layered policy (rules + learned + the two-member encoder committee).

    python bench/detector_eval.py            # prints the tables, rewrites the `detector-eval` section
    python bench/detector_eval.py --no-doc   # prints only

Reads the shipped models and the test split that `scripts/train_detector.py` wrote (never used while
tuning), two benign tool-output sets -- real files from PyPI wheels whose *packages* are in the test split
(source "pypi-files"), and the generated set (scripts/injection_corpus/tool_outputs.py, seed 0) -- and the repo's
own corpus (tests/fleet/quarantine/quarantine_corpus.py). Writes the figures to
tests/fleet/quarantine/data/heldout_report.json, which the tests recompute and compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchdoc import write_section

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fleet" / "quarantine"))

import quarantine_corpus as C  # noqa: E402

from bench.detector_heldout import HELDOUT_FILE, REAL_BENIGN_SOURCE, load_heldout, score, tool_outputs  # noqa: E402
from fleet.quarantine import DetectorConfig, make_detector  # noqa: E402
from fleet.quarantine.encoder import ENCODER_MODELS, ENCODER_NAME, load_encoder  # noqa: E402
from fleet.quarantine.learned import load_model  # noqa: E402

DATA = ROOT / "tests" / "fleet" / "quarantine" / "data"
CONFIGS = {
    "rules alone": DetectorConfig(layers=("rules",)),
    "learned alone": DetectorConfig(layers=("learned",)),
    "encoder alone": DetectorConfig(layers=("encoder",)),
    "rules + learned": DetectorConfig(layers=("rules", "learned")),
    # round seven's policy (shipped until round ten): the first member alone, at the threshold chosen for it alone
    "layered, one encoder (round seven)": DetectorConfig(
        encoder_models=(ENCODER_NAME,), encoder_threshold=load_encoder(ENCODER_NAME).meta["threshold_alone"]
    ),
    "layered": DetectorConfig(),
}


def evaluate() -> dict[str, Any]:
    rows = load_heldout(DATA / HELDOUT_FILE)
    labels = [r["label"] for r in rows]
    tools = [t for _, t in tool_outputs()]
    real = [r["text"] for r in rows if r["source"] == REAL_BENIGN_SOURCE]
    out: dict[str, Any] = {
        "num_test": len(rows),
        "num_test_injections": sum(labels),
        "num_tool_outputs": len(tools),
        "num_real_benign": len(real),
        "real_benign_packages": sorted({r["group"].split(":")[0] for r in rows if r["source"] == REAL_BENIGN_SOURCE}),
        "detectors": {},
    }
    for name, cfg in CONFIGS.items():
        det = make_detector(cfg)
        verdicts = [det.inspect(r["text"]) for r in rows]
        test = score(verdicts, labels)
        tool = score([det.inspect(t) for t in tools], [0] * len(tools))
        real_scores = score([det.inspect(t) for t in real], [0] * len(real))
        corpus = score(
            [det.inspect(t) for t in C.POISONED + C.BENIGN], [1] * len(C.POISONED) + [0] * len(C.BENIGN)
        )
        held = score(
            [det.inspect(t) for t in C.HELDOUT_POISONED + C.HELDOUT_BENIGN],
            [1] * len(C.HELDOUT_POISONED) + [0] * len(C.HELDOUT_BENIGN),
        )
        by_source = {}
        for src in sorted({r["source"] for r in rows}):
            idx = [i for i, r in enumerate(rows) if r["source"] == src]
            by_source[src] = score([verdicts[i] for i in idx], [labels[i] for i in idx]).to_dict()
        out["detectors"][name] = {
            "test": test.to_dict(),
            "tool_outputs": tool.to_dict(),
            "real_benign": real_scores.to_dict(),
            "repo_corpus": corpus.to_dict(),
            "repo_heldout": held.to_dict(),
            "test_by_source": by_source,
        }
    return out


def latency() -> dict[str, dict[str, float]]:
    """Median CPU ms per KiB over the tool-output set, concatenated into inputs of 1, 16 and 256 KiB.

    NOTE: process CPU time, not wall time: on a shared machine, other processes' load does not count.
    """
    blob = "\n".join(t for _, t in tool_outputs())
    out: dict[str, dict[str, float]] = {}
    for name, cfg in CONFIGS.items():
        det = make_detector(cfg)
        out[name] = {}
        for kib in (1, 16, 256):
            text = (blob * (1 + (kib << 10) // len(blob)))[: kib << 10]
            times = []
            for _ in range(max(3, 48 // kib)):
                t0 = time.process_time()
                det.inspect(text)
                times.append(time.process_time() - t0)
            out[name][f"{kib} KiB"] = round(statistics.median(times) * 1000 / kib, 3)
    return out


def render(ev: dict[str, Any], lat: dict[str, dict[str, float]]) -> str:
    model, enc = load_model(), load_encoder()
    meta, val, com = model.meta, model.meta["validation"], enc.meta["committee"]
    members = ", ".join(f"{m} >= {t:.4f}" for m, t in zip(ENCODER_MODELS, com["thresholds"], strict=True))
    lines = [
        "## Quarantine detector, held-out (bench/detector_eval.py)",
        "",
        f"Test split: {ev['num_test']} tool results ({ev['num_test_injections']} injections), never read while "
        f"tuning; learned threshold {model.threshold:.4f} chosen on the validation split only (validation, rules + "
        f"learned: precision {val['precision']:.3f}, recall {val['recall']:.3f}); the encoder layer is a committee "
        f"of {len(ENCODER_MODELS)} runs, either of which quarantines ({members}), thresholds chosen together on "
        f"the same validation split for the layered policy (validation, layered: precision "
        f"{com['validation']['precision']:.3f}, recall {com['validation']['recall']:.3f}). Each member: "
        f"{enc.meta['base']['model']} ({enc.meta['base']['model_licence']}; weights from the "
        f"{enc.meta['base']['package']} {enc.meta['base']['version']} wheel) with the project's LoRA adapter "
        f"(scripts/train_encoder.py). Real benign tool output: "
        f"{ev['num_real_benign']} chunks of files from {len(ev['real_benign_packages'])} PyPI wheels whose packages "
        f"are in the test split ({', '.join(ev['real_benign_packages'])}). Generated benign tool output: "
        f"{ev['num_tool_outputs']} items (seed 0).",
        "",
        "Labelled corpora (PyPI wheels, read as zip files; sha256 in fleet/quarantine/model/injection_lr.json):",
        "",
    ]
    lines += [
        f"- {c['package']} {c['version']} ({c['licence']})"
        + (f", relaying {c['dataset']} ({c['dataset_licence']}) as source {c['source']}" if "dataset" in c else "")
        + (" [added for issue #15]" if c.get("added") else "")
        + f": {c['num_examples']}"
        for c in meta["corpora"]
    ]
    files = meta["benign_files"]
    licences = sorted({f["licence"] for f in files})
    lines += [
        "",
        f"Real benign files: {len(files)} wheels ({sum(f['num_chunks'] for f in files)} chunks; licences: "
        f"{', '.join(licences)}), split by package.",
        "",
        "| detector | test precision | test recall | tp / fp / fn | real benign FPR | generated tool-output FPR "
        "| repo corpus P / R | repo held-out P / R |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, d in ev["detectors"].items():
        t, o, r, c, h = d["test"], d["tool_outputs"], d["real_benign"], d["repo_corpus"], d["repo_heldout"]
        lines.append(
            f"| {name} | {t['precision']:.3f} | {t['recall']:.3f} | {t['tp']} / {t['fp']} / {t['fn']} | "
            f"{r['fpr']:.4f} ({r['fp']}/{r['fp'] + r['tn']}) | {o['fpr']:.4f} ({o['fp']}/{o['fp'] + o['tn']}) | "
            f"{c['precision']:.3f} / {c['recall']:.3f} | {h['precision']:.3f} / {h['recall']:.3f} |"
        )
    lines += [
        "",
        "Layered detector on the test split, by source:",
        "",
        "| source | precision | recall | tp / fp / fn / tn |",
        "|---|---|---|---|",
    ]
    for src, s in ev["detectors"]["layered"]["test_by_source"].items():
        recall = f"{s['recall']:.3f}" if s["tp"] + s["fn"] else "n/a (benign only)"
        lines.append(
            f"| {src} | {s['precision']:.3f} | {recall} | {s['tp']} / {s['fp']} / {s['fn']} / {s['tn']} |"
        )
    lines += [
        "",
        "Latency, median CPU ms per KiB (process CPU time summed over torch's threads, tool-output text; past "
        f"{enc.max_windows} token windows the encoder reads only the {enc.max_windows} the learned layer ranks highest):",
        "",
        "| detector | 1 KiB | 16 KiB | 256 KiB | x rules + learned (1 / 16 / 256 KiB) |",
        "|---|---|---|---|---|",
    ]
    two = lat["rules + learned"]
    lines += [
        f"| {n} | {v['1 KiB']} | {v['16 KiB']} | {v['256 KiB']} | "
        + " / ".join(f"{v[k] / two[k]:.2f}" for k in ("1 KiB", "16 KiB", "256 KiB"))
        + " |"
        for n, v in lat.items()
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = ap.parse_args()
    ev, lat = evaluate(), latency()
    body = render(ev, lat)
    print(body)
    (DATA / "heldout_report.json").write_text(json.dumps(ev, indent=1, sort_keys=True) + "\n")
    if not a.no_doc:
        write_section("detector-eval", body)


if __name__ == "__main__":
    main()
