"""AgentDojo: its tool environments (benign items) and its attack templates x goals placed in its injection vectors."""

from __future__ import annotations

import ast
import json
import random
import re
import zipfile
from collections.abc import Iterator
from typing import Any

import yaml

from injection_corpus.sources import OMITTED_TEMPLATES, Example, split_of


# ---- agentdojo ----------------------------------------------------------------------------------------
class LiteralEval(ast.NodeVisitor):
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
                out[st.targets[0].id] = LiteralEval(out).eval(st.value)
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
                    s = LiteralEval({}).eval(node.value)
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


def render_items(items: list[Any], style: int) -> str:
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
                render_items(_with_neighbours(_fill(it, vectors), coll[path, split], rng), rng.randrange(4)),
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
                Example(render_items(poisoned, style), 1, "agentdojo", f"goal:{g or fam}", split, f"attack:{fam}")
            )
            out.append(Example(render_items(around, style), 0, "agentdojo", f"goal:{g or fam}", split, "twin"))
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
