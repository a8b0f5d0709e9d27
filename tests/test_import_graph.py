"""The package graph: no import circle, and the on-device runner reaches neither JAX nor the API.

A circle between modules imports only while function-local imports keep its edges apart, and
breaks (a partially initialised module, an `ImportError` naming a half-made name) the day one
of them moves to the top. So every import counts here, function-local ones included; only
`if TYPE_CHECKING:` blocks are skipped (they never run). A name a package exports lazily
(`dlm_jax.load` through `dlm_jax/__init__`'s table) counts as an import of the module that
defines it, both as `from dlm_jax import load` and as `import dlm_jax` ... `dlm_jax.load(...)`:
that is the module the access imports.
"""

from __future__ import annotations

import ast
import re
import importlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every package of the tree by its import name, and the folder that holds it (the mission's
# top-level folders are subpackages of dlm_jax: `dlm_jax.lowering` is lowering/).
PACKAGES = {"dlm_jax": "dlm_jax", "dlm_jax.tflite_export": "tflite_export", "dlm_jax.lowering": "lowering",
            "dlm_jax.buckets": "buckets", "dlm_jax.training": "training"}
JAX = ("jax", "jaxlib", "flax", "optax", "orbax")  # external packages that are, or load, JAX


class Graph:
    """The import graph of `packages` under `root`: `edges[m]` are the modules of those
    packages that module `m` imports (written imports, any scope); `external[m]` the top-level
    names of the other packages it imports."""

    def __init__(self, root: Path, packages: Mapping[str, str] | Iterable[str],
                 lazy: Mapping[str, Mapping[str, str]] | None = None):
        folders = dict(packages) if isinstance(packages, Mapping) else {p: p for p in packages}
        self.packages = tuple(sorted({name.partition(".")[0] for name in folders}))
        self.paths: dict[str, Path] = {}
        for package, folder in folders.items():
            for path in sorted((root / folder).rglob("*.py")):
                parts = (*package.split("."), *path.relative_to(root / folder).with_suffix("").parts)
                self.paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.lazy = lazy if lazy is not None else _lazy_tables(p for p in self.paths if self._is_package(p))
        self.edges: dict[str, set[str]] = {}
        self.external: dict[str, set[str]] = {}
        for name in self.paths:
            self.edges[name], self.external[name] = self._scan(name)

    def _is_package(self, name: str) -> bool:
        return self.paths[name].name == "__init__.py"

    def _resolve(self, module: str, names: Iterable[str]) -> set[str]:
        """The modules `from module import names` imports: a submodule by its name, a lazily
        exported name by the module defining it, else `module` itself."""
        out = set()
        for name in names:
            if f"{module}.{name}" in self.paths:
                out.add(f"{module}.{name}")
            elif name in self.lazy.get(module, {}):
                out.add(self.lazy[module][name])
            else:
                out.add(module)
        return out or {module}

    def _scan(self, name: str) -> tuple[set[str], set[str]]:
        tree = ast.parse(self.paths[name].read_text(encoding="utf-8"), filename=str(self.paths[name]))
        package = name if self._is_package(name) else name.rpartition(".")[0]
        edges: set[str] = set()
        external: set[str] = set()
        bound: dict[str, str] = {}  # a name an `import` statement binds -> the internal module it names
        for node in _run_time_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in self.paths:
                        edges.add(alias.name)
                        bound[alias.asname or alias.name.partition(".")[0]] = (
                            alias.name if alias.asname else alias.name.partition(".")[0])
                    elif alias.name.partition(".")[0] not in self.packages:
                        external.add(alias.name.partition(".")[0])
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if module in self.paths:
                    edges |= self._resolve(module, [a.name for a in node.names if a.name != "*"])
                elif module.partition(".")[0] not in self.packages:
                    external.add(module.partition(".")[0])
        for node in ast.walk(tree):  # `pkg.name` after `import pkg`: the module that defines `name`
            chain = _attribute_chain(node)
            if chain and chain[0] in bound:
                module = bound[chain[0]]
                for part in chain[1:]:
                    if f"{module}.{part}" in self.paths:
                        module = f"{module}.{part}"
                        continue
                    module = self.lazy.get(module, {}).get(part, module)
                    break
                edges.add(module)
        edges.discard(name)
        return edges, external

    def cycles(self) -> list[list[str]]:
        """One import circle, as [a, b, ..., a], for each group of modules that import each
        other (a strongly connected component, by Tarjan's depth-first search)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        groups: list[set[str]] = []

        def visit(node: str) -> None:
            index[node] = low[node] = len(index)
            stack.append(node)
            for nxt in sorted(self.edges[node]):
                if nxt not in index:
                    visit(nxt)
                    low[node] = min(low[node], low[nxt])
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
            if low[node] == index[node]:
                group = set()
                while not group or member != node:
                    member = stack.pop()
                    group.add(member)
                if len(group) > 1:
                    groups.append(group)

        for start in sorted(self.edges):
            if start not in index:
                visit(start)
        return [self._circle(min(group), group) for group in groups]

    def _circle(self, start: str, group: set[str]) -> list[str]:
        """A shortest circle through `start` inside `group` (breadth-first)."""
        chains = {start: [start]}
        todo = [start]
        while todo:
            node = todo.pop(0)
            for nxt in sorted(self.edges[node] & group):
                if nxt == start:
                    return chains[node] + [start]
                if nxt not in chains:
                    chains[nxt] = chains[node] + [nxt]
                    todo.append(nxt)
        raise AssertionError(f"{sorted(group)} is not a circle")

    def reach(self, start: str) -> dict[str, list[str]]:
        """Every module importing `start` imports, with the chain that leads to it. Importing a
        module imports its parent packages first, so they count here (not as circles)."""
        chains = {start: [start]}
        todo = [start]
        while todo:
            node = todo.pop()
            parents = [".".join(node.split(".")[:i]) for i in range(1, node.count(".") + 1)]
            for nxt in sorted(self.edges[node] | {p for p in parents if p in self.paths}):
                if nxt not in chains:
                    chains[nxt] = chains[node] + [nxt]
                    todo.append(nxt)
        return chains


def _lazy_tables(packages: Iterable[str]) -> dict[str, dict[str, str]]:
    """Each package's lazy export table (`_EXPORTS`: name -> defining module). A package
    `__init__` imports only `dlm_jax._lazy`, so reading them loads nothing else."""
    return {p: dict(getattr(importlib.import_module(p), "_EXPORTS", {})) for p in packages}


def _run_time_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of `tree` but those only a type checker sees (`if TYPE_CHECKING:` bodies)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _attribute_chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"] for an attribute access on a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not parts or not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return Graph(ROOT, PACKAGES)


def test_the_packages_import_no_circle(graph):
    circles = graph.cycles()
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("module, forbidden", [
    # The on-device runner ships without JAX and sits below the API that chooses it.
    ("dlm_jax.executors.runner", ("dlm_jax.api",)),
    # `Model` sits below both the API and every executor.
    ("dlm_jax._model", ("dlm_jax.api", "dlm_jax.executors.runner", "dlm_jax.executors.jax_executor", "tflite_export")),
])
def test_module_reaches_no_jax_and_no_layer_above_it(graph, module, forbidden):
    assert module in graph.paths, f"no module {module}"
    chains = graph.reach(module)
    bad = {m: chain for m, chain in chains.items() if any(m == f or m.startswith(f + ".") for f in forbidden)}
    bad.update({m: chain + [f"<{', '.join(sorted(set(JAX) & graph.external[m]))}>"]
                for m, chain in chains.items() if set(JAX) & graph.external[m]})
    assert not bad, f"{module} imports " + "; ".join(" -> ".join(c) for c in bad.values())


def test_the_graph_sees_function_local_and_lazy_imports(tmp_path):
    """The checker itself: a circle closed only by a function-local import, or by a lazily
    exported name, is still a circle; `if TYPE_CHECKING:` imports are not edges."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('_EXPORTS = {"run": "pkg.b"}\n')
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                              "import pkg\n\ndef f():\n    return pkg.run()\n")
    (pkg / "b.py").write_text("def run():\n    from .a import f\n    import numpy\n")
    (pkg / "c.py").write_text("from pkg.a import f\n")
    g = Graph(tmp_path, ["pkg"], lazy={"pkg": {"run": "pkg.b"}})
    assert g.edges["pkg.a"] == {"pkg", "pkg.b"} and g.edges["pkg.b"] == {"pkg.a"}
    assert g.external["pkg.b"] == {"numpy"}
    assert g.cycles() == [["pkg.a", "pkg.b", "pkg.a"]]
    assert set(g.reach("pkg.c")) == {"pkg.c", "pkg.a", "pkg.b", "pkg"}


CORE = "dlm_jax.runtime"
TECHNIQUES = "dlm_jax.techniques"


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_loop_core_names_no_technique(graph):
    """The rooms: no module of the loop core but the registry (the one table of strategy
    names) reaches a technique, whatever the chain; what a core module imports stays in the
    core or below it (no executor, front end, model or API)."""
    core = [m for m in graph.paths if _inside(m, CORE) and m not in (f"{CORE}.registry", CORE)]
    assert f"{CORE}.decoder" in core and f"{CORE}.step" in core
    below = ("dlm_jax._config", "dlm_jax._errors", "dlm_jax._masks", "dlm_jax._integrity", "dlm_jax._lazy")
    for module in core:
        chains = graph.reach(module)
        bad = [chain for m, chain in chains.items()
               if not (_inside(m, CORE) and m != f"{CORE}.registry") and m not in below and m != "dlm_jax"]
        assert not bad, f"{module} imports " + "; ".join(" -> ".join(c) for c in bad)
        assert not set(JAX) & set().union(*(graph.external[m] for m in chains)), f"{module} reaches JAX"


def test_no_technique_imports_another(graph):
    """Each paper's technique is one package: it may use the core and the layers beside it,
    never another technique's package (a shared piece belongs in the core)."""
    rooms = sorted({m.split(".")[2] for m in graph.paths if _inside(m, TECHNIQUES) and m.count(".") >= 2})
    assert {"lladacpp", "isd", "tide", "powerinfer"} <= set(rooms)
    for room in rooms:
        mine = f"{TECHNIQUES}.{room}"
        for module in (m for m in graph.paths if _inside(m, mine)):
            other = {e for e in graph.edges[module] if _inside(e, TECHNIQUES) and e != TECHNIQUES and not _inside(e, mine)}
            assert not other, f"{module} imports {sorted(other)}"


def test_only_the_registry_and_the_layers_above_the_core_import_techniques(graph):
    """Below the API, a technique is reached through the registry or by the executor and
    exporter that run it, never from the shared model, tokenizer or checkpoint code."""
    lower = [m for m in graph.paths if _inside(m, "dlm_jax.models") or _inside(m, "dlm_jax.checkpoint")
             or m in ("dlm_jax._config", "dlm_jax._masks", "dlm_jax._tokenizer", "dlm_jax._model")]
    for module in lower:
        hits = {e for e in graph.edges[module] if _inside(e, TECHNIQUES)}
        assert not hits, f"{module} imports {sorted(hits)}"


@pytest.mark.parametrize("package", ["dlm_jax.runtime", "dlm_jax.executors", "dlm_jax.techniques.lladacpp",
                                     "dlm_jax.techniques.isd", "dlm_jax.techniques.tide",
                                     "dlm_jax.techniques.powerinfer"])
def test_a_package_docstring_names_every_module(graph, package):
    """Each room's `__init__` reads as its table of contents: it names every module it holds."""
    doc = importlib.import_module(package).__doc__
    modules = sorted(m.rpartition(".")[2] for m in graph.paths if m.rpartition(".")[0] == package)
    missing = [m for m in modules if not re.search(rf"(?<![\w.]){re.escape(m)}\b", doc)]
    assert not missing, f"{package}'s docstring does not name {missing}"
