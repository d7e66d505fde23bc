"""bastioncorpus, agent-injection-bench and spikee (spikee's attacks placed into AgentDojo items)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import zipfile
from typing import Any

from injection_corpus.agentdojo import render_items
from injection_corpus.sources import Example, split_of


# ---- bastioncorpus ------------------------------------------------------------------------------------
def load_bastion(z: zipfile.ZipFile, rng: random.Random) -> list[Example]:
    rows = [
        json.loads(line)
        for line in z.read("bastioncorpus/corpus/injections.jsonl").decode().splitlines()
        if line
    ]
    out = []
    for label in ("malicious", "benign"):
        part = [r for r in rows if r["label"] == label]
        groups = {r["id"]: (r.get("intent") or r["id"]) for r in part}  # rows sharing an intent: one group
        splits = split_of(list(groups.values()), rng)
        for r in part:
            canary = "BC-" + hashlib.sha256(r["id"].encode()).hexdigest()[:8].upper()
            out.append(
                Example(
                    r["text"].replace("{canary}", canary),
                    int(label == "malicious"),
                    "bastioncorpus",
                    groups[r["id"]],
                    splits[groups[r["id"]]],
                    r["category"],
                )
            )
    return out


# ---- agent-injection-bench ----------------------------------------------------------------------------
def load_aib(z: zipfile.ZipFile, rng: random.Random) -> list[Example]:
    rows = [json.loads(line) for line in z.read("aib/data/attacks.jsonl").decode().splitlines() if line]
    out = []
    for label in (1, 0):
        part = [r for r in rows if (r["family"] != "control") == bool(label)]
        splits = split_of([r["id"] for r in part], rng)
        out += [
            Example(r["injected"], label, "agent-injection-bench", r["id"], splits[r["id"]], r["family"])
            for r in part
        ]
    return out



# ---- spikee ------------------------------------------------------------------------------------------
SPIKEE_SEEDS = (
    "seeds-cybersec-2026-01",
    "seeds-llm-mailbox",
    "seeds-mini-test",
    "seeds-sysmsg-extraction-2025-04",
)


def read_jsonl(z: zipfile.ZipFile, name: str) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in z.read(name).decode().splitlines() if line.strip()]
        if name in z.namelist()
        else []
    )


def load_spikee(z: zipfile.ZipFile, pool: dict[str, list[Any]], rng: random.Random) -> list[Example]:
    """Spikee's jailbreak templates x its instructions, placed into a benign AgentDojo item of the same split.

    Split by jailbreak *type* (so test attacks use template families never trained on) and by instruction.
    The topical seed sets (investment advice, harmful requests) are left out: they are not injections.
    """
    base = "spikee/data/workspace/datasets/"
    jbs = {
        r["text"]: r
        for s in SPIKEE_SEEDS
        for r in read_jsonl(z, f"{base}{s}/jailbreaks.jsonl")
        if "<INSTRUCTION>" in r["text"]
    }
    ins = {r["instruction"]: r for s in SPIKEE_SEEDS for r in read_jsonl(z, f"{base}{s}/instructions.jsonl")}
    tsplit = split_of([r["jailbreak_type"] for r in jbs.values()], rng)
    isplit = split_of(list(ins), rng)
    out = []
    for text, jb in sorted(jbs.items()):
        split = tsplit[jb["jailbreak_type"]]
        mine = sorted(i for i in ins if isplit[i] == split)
        for instruction in rng.sample(mine, min(3, len(mine))):
            attack = text.replace("<INSTRUCTION>", instruction)
            kind = f"jailbreak:{jb['jailbreak_type']}"  # with its clean twin, as for AgentDojo
            out += placed_examples(attack, 1, "spikee", f"type:{jb['jailbreak_type']}", split, kind, pool, rng)
    return out


def placed_examples(
    text: str, label: int, source: str, group: str, split: str, kind: str, pool: dict[str, list[Any]], rng: random.Random
) -> list[Example]:
    """`text` placed into a benign item of `split`'s pool (`place_attack`), then, for an attack placed inside
    an item, its clean twin, right after it (train_encoder's span labels pair the two by that order)."""
    poisoned, clean = place_attack(text, rng.choice(pool[split]), rng)
    twin = [Example(clean, 0, source, group, split, "twin")] if label and clean is not None else []
    return [Example(poisoned, label, source, group, split, kind), *twin]


def place_attack(attack: str, item: Any, rng: random.Random) -> tuple[str, str | None]:
    """(poisoned, clean twin): `attack` alone (one time in four, no twin) or inside a string field of `item`."""
    fields = [k for k, v in item.items() if isinstance(v, str) and len(v) > 20]
    if not fields or rng.random() < 0.25:
        return attack, None
    k, style = rng.choice(fields), rng.randrange(4)
    cut = [m.end() for m in re.finditer(r"[.!?]\s", item[k])] + [len(item[k])]
    at = rng.choice(cut)
    return render_items([item | {k: f"{item[k][:at]} {attack} {item[k][at:]}".strip()}], style), render_items(
        [item], style
    )
