"""The modules of difflm import each other without circles.

Every ``difflm/**/*.py`` is parsed with :mod:`ast` (nothing is imported); an edge ``a -> b`` is any ``import`` or
``from ... import`` of ``b`` anywhere in ``a``, including imports inside functions (a lazy import that closes a
circle is still a circle: the two modules cannot be read or tested apart). ``from pkg import name`` is an edge to
the module ``pkg.name`` when that is a module, else to ``pkg``. The strongly connected components of the graph
(Tarjan 1972) must all be single modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the ``difflm`` package (a package is its ``__init__``)."""
    out = {}
    for path in sorted((root / "difflm").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the difflm modules it imports (module level and inside functions)."""
    def known(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else known(base)
                           for alias in node.names]
            edges[name].update(t for t in targets if t and t != name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"} - {"e"}}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "difflm" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "difflm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .low import x\n")
    (pkg / "low.py").write_text("def f():\n    from difflm.sub import high\n")
    (pkg / "high.py").write_text("import difflm.sub.low\n")
    edges = import_graph(module_files(tmp_path))
    assert edges["difflm.sub"] == {"difflm.sub.low"}
    assert edges["difflm.sub.low"] == {"difflm.sub.high"}
    assert circles(edges) == [["difflm.sub.high", "difflm.sub.low"]]


def test_difflm_has_no_import_circles():
    found = circles(import_graph(module_files()))
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)
