"""The direction of the house (docs/architecture.md, "Layout"), checked over the whole tree: no import cycles between
files, and no import across roles — router/, worker/ and operator/ never import each other, kernels/ imports only
kernels/, and the core imports a role only from its composition roots (expertmesh/entry/). Every import counts, at
module level or inside a function. Also: no hand-written module over 700 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "expertmesh": "expertmesh",
    "kernels": "expertmesh.kernels",
    "operator": "expertmesh.operator",
    "worker": "expertmesh.worker",
    "router": "expertmesh.router",
    "protos": "expertmesh.protos",
}
ROLES = ("router", "worker", "operator")
MAX_LINES = 700


def modules(root: Path) -> dict[str, str]:
    """Module name -> file path (relative to root) for every hand-written .py under the mapped folders."""
    out = {}
    for folder, ns in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([ns, *parts])] = path.relative_to(root).as_posix()
    return out


def import_edges(root: Path) -> set[tuple[str, str]]:
    """(importing file, imported file) for every import statement that resolves to a project file."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name:
            if name in mods:
                return mods[name]
            name = name.rpartition(".")[0]
        return None

    edges = set()
    for name, path in mods.items():
        pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse((root / path).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                dest = resolve(target)
                if dest and dest != path:
                    edges.add((path, dest))
    return edges


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def wrong_way(edges: set[tuple[str, str]]) -> list[str]:
    out = []
    for a, b in sorted(edges):
        ra, rb = a.split("/")[0], b.split("/")[0]
        if ra in ROLES and rb in ROLES and ra != rb:
            out.append(f"{a} -> {b}: roles never import each other")
        elif ra == "kernels" and rb != "kernels":
            out.append(f"{a} -> {b}: kernels import only kernels")
        elif ra == "expertmesh" and rb in ROLES and not a.startswith("expertmesh/entry/"):
            out.append(f"{a} -> {b}: only expertmesh/entry/ imports a role")
    return out


def test_no_import_cycles_and_none_across_roles():
    edges = import_edges(ROOT)
    assert len(edges) > 200  # the walk saw the project, not an empty tree
    assert cycles(edges) == []
    assert wrong_way(edges) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """The same walk over a made-up tree with one cycle and one import across roles finds both."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "router" / "a.py").write_text("from expertmesh.router import b\n")
    (tmp_path / "router" / "b.py").write_text("def f():\n    from expertmesh.router.a import x\n")
    (tmp_path / "worker" / "c.py").write_text("import expertmesh.router.a\n")
    (tmp_path / "expertmesh" / "d.py").write_text("from expertmesh.worker import c\n")
    (tmp_path / "expertmesh" / "entry").mkdir()
    (tmp_path / "expertmesh" / "entry" / "e.py").write_text("from expertmesh.worker import c\n")
    edges = import_edges(tmp_path)
    assert cycles(edges) == [["router/a.py", "router/b.py"]]
    assert wrong_way(edges) == [
        "expertmesh/d.py -> worker/c.py: only expertmesh/entry/ imports a role",
        "worker/c.py -> router/a.py: roles never import each other",
    ]


@pytest.mark.parametrize("folder", [*FOLDERS, "tests", "bench", "scripts"])
def test_no_hand_written_module_over_700_lines(folder):
    too_long = {
        p.relative_to(ROOT).as_posix(): n
        for p in sorted((ROOT / folder).rglob("*.py"))
        if "_pb2" not in p.name and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert too_long == {}
