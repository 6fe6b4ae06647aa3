"""No import cycles in specserve/: the modules form layers that import one way.

The graph is read from the source with ``ast``, without importing anything.  Every
import counts wherever it is written: at module level (it fixes the load order), inside
a function (a lazy import is still a dependency of the design) and under
``if TYPE_CHECKING:`` (an annotation that names a module above is one too).

Edges: ``import a.b.c`` depends on ``a.b.c``; ``from a.b import c`` on ``a.b`` (its
namespace is read) and on ``a.b.c`` when that is a module.  The packages that Python
runs on the way to a submodule (``a`` and ``a.b`` for ``a.b.c``) are not edges: a
package's ``__init__`` importing its own submodules is the normal shape, and a cycle
through it shows up as a submodule importing names from its package.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specserve"

Graph = dict[str, dict[str, list[int]]]  # module -> {imported module: [line numbers]}


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file, for every module of ``package`` under ``root``."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (``a.b.func`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, modules: dict[str, Path]) -> dict[str, list[int]]:
    """The modules of the package that module ``name`` imports, with the lines that do."""
    path = modules[name]
    is_package = path.name == "__init__.py"
    out: dict[str, list[int]] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != name:
            out.setdefault(target, []).append(line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds this module
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            add(_known(base, modules), node.lineno)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    add(f"{base}.{alias.name}", node.lineno)
    return out


def import_graph(root: Path, package: str) -> Graph:
    modules = module_files(root, package)
    return {name: imports_of(name, modules) for name in modules}


def components(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's
    algorithm, iterative): every module of one reaches every other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            nxt = next((t for t in targets if t in graph), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
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
    return sorted(found)


def cycles(graph: Graph) -> list[list[str]]:
    """One shortest cycle (the first module repeated at the end) per component."""
    return [_one_cycle(graph, set(c)) for c in components(graph)]


def _one_cycle(graph: Graph, component: set[str]) -> list[str]:
    """A shortest cycle through the first module (by name) of a strongly connected component."""
    first = min(component)
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == first:
                    return paths[node] + [first]
                if target in component and target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def describe(graph: Graph, cycle: list[str]) -> str:
    """``a -> b (line 12) -> a (line 40, 41)``: where each step of the cycle is written."""
    text = cycle[0]
    for source, target in zip(cycle, cycle[1:]):
        lines = ", ".join(str(n) for n in sorted(set(graph[source][target])))
        text += f" -> {target} (line {lines} of {source})"
    return text


def test_specserve_has_no_import_cycles():
    graph = import_graph(ROOT, PACKAGE)
    found = components(graph)
    assert not found, "import cycles in specserve/:\n" + "\n".join(
        f"{len(c)} modules ({', '.join(c)}), for example {describe(graph, _one_cycle(graph, set(c)))}" for c in found
    )


def test_the_graph_sees_module_level_lazy_and_type_checking_imports():
    graph = import_graph(ROOT, PACKAGE)
    assert "specserve.compose" in graph["specserve.cli"]  # module level
    assert "specserve.serve_compat" in graph["specserve.cli"]  # inside serve_main
    assert "specserve.executor.static_runner" in graph["specserve.executor.runner"]  # under TYPE_CHECKING
    assert "specserve.sampling.rejection" in graph["specserve.sampling.sampler"]  # import a.b.c as x
    assert "specserve.sampling.filters" in graph["specserve.sampling"]  # a package's own re-exports


def test_request_types_import_only_the_standard_library_and_errors():
    """request.py is the bottom floor: plain data that every layer may import."""
    tree = ast.parse((ROOT / "specserve" / "request.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    outside = {n for n in names if n.split(".")[0] not in sys.stdlib_module_names}
    assert outside == {"specserve.errors"}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_is_found_and_each_step_named_with_its_line(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "import os\n\n\ndef late():\n    from pkg.high import thing\n",
        "pkg/mid.py": "from pkg import low\n",
        "pkg/high.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.mid import x\n",
        "pkg/sub/__init__.py": "from .leaf import y\n",
        "pkg/sub/leaf.py": "from .. import low\n",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub"] == {"pkg.sub.leaf": [1]} and graph["pkg.sub.leaf"] == {"pkg": [1], "pkg.low": [1]}
    assert cycles(graph) == [["pkg.high", "pkg.mid", "pkg.low", "pkg.high"]]
    assert describe(graph, cycles(graph)[0]) == (
        "pkg.high -> pkg.mid (line 3 of pkg.high) -> pkg.low (line 1 of pkg.mid) -> pkg.high (line 5 of pkg.low)"
    )


def test_a_submodule_importing_from_its_own_package_is_a_cycle(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "import os\n",
    })  # fmt: skip
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg", "pkg.a", "pkg"]]
    (tmp_path / "pkg/a.py").write_text("import pkg.b as b\n")  # the submodule itself, not the package
    assert cycles(import_graph(tmp_path, "pkg")) == []
