"""No import cycle at run time between kvfleet's modules (issue #30: edge <-> servicers.common, exactness <->
hf_check, sdk base <-> table, the stand-in's main.py were four). Type-only imports (under TYPE_CHECKING) may
still point both ways: they break cycles for the type checker and never run (CONTRIBUTING §9)."""

from __future__ import annotations

import grimp


def cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (each one an import cycle)."""
    adj = {m: sorted(d for d in graph.find_modules_directly_imported_by(m) if d in modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return out


def test_no_runtime_import_cycle() -> None:
    g = grimp.build_graph("fleet", "controller", "workers", exclude_type_checking_imports=True)
    assert cycles(g, {m for m in g.modules if not m.startswith("fleet.api")}) == []


def test_the_check_finds_a_cycle() -> None:
    """Control: a cycle of three modules beside an acyclic pair is found, and only it."""
    g = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a")):
        g.add_import(importer=a, imported=b)
    assert cycles(g, set(g.modules)) == [["p.a", "p.b", "p.c"]]
