"""The package's modules import each other without circles, and each layer only reaches down: the
run time never imports the offline tools (``lserve.calibration``) or the eval harness, and the model
layer names attention and sparsity types only for the type checker."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "lserve"


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks (never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def module_graph(runtime_only: bool = False) -> dict[str, set[str]]:
    """Module -> the lserve modules it imports (any import statement, lazy ones included; with
    ``runtime_only``, without those under ``if TYPE_CHECKING:``)."""
    files = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        tree = ast.parse(f.read_text())
        skip = _type_checking_only(tree) if runtime_only else set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]  # a submodule, else resolves to base
            for n in names:
                target = resolve(n) if n.startswith("lserve") else None
                if target and target != mod:
                    deps.add(target)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_in_lserve():
    graph = module_graph()
    assert "lserve.engine.llm_engine" in graph and graph["lserve.engine.llm_engine"]
    assert cycles(graph) == []


RUNTIME = ("lserve.engine", "lserve.attention", "lserve.sparsity", "lserve.models", "lserve.cache", "lserve.serve",
           "lserve.kernels", "lserve.config", "lserve.identity", "lserve.paths")


def _in(mod: str, packages) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def reaches(graph: dict[str, set[str]], src, dst) -> list[tuple[str, str]]:
    """(a, b) import edges from a module under ``src`` to one under ``dst`` (package prefixes)."""
    return sorted((a, b) for a, deps in graph.items() if _in(a, src) for b in deps if _in(b, dst))


def test_reaches_sees_lazy_imports_and_skips_type_checking_ones(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\ndef f():\n    import b\n")
    skipped = _type_checking_only(tree)
    imported = [n.names[0].name for n in ast.walk(tree) if isinstance(n, ast.Import) and id(n) not in skipped]
    assert imported == ["b"]
    assert reaches({"x.y": {"z"}, "w": {"z"}}, ("x",), ("z",)) == [("x.y", "z")]


def test_runtime_never_imports_the_offline_tools_or_the_harness():
    graph = module_graph()  # type-only imports count too: the run time has no business naming them
    assert "lserve.calibration.selection" in graph and "lserve.engine.llm_engine" in graph
    assert reaches(graph, RUNTIME, ("lserve.calibration", "lserve.eval", "lserve.bench", "lserve.cli")) == []
    # the harness is below the offline tools that drive it
    assert reaches(graph, ("lserve.eval",), ("lserve.calibration", "lserve.bench", "lserve.cli")) == []


def test_layers_reach_down_at_run_time():
    graph = module_graph(runtime_only=True)
    assert reaches(graph, ("lserve.models",), ("lserve.attention", "lserve.sparsity", "lserve.engine")) == []
    assert reaches(graph, ("lserve.sparsity",), ("lserve.attention", "lserve.engine", "lserve.models")) == []
    assert reaches(graph, ("lserve.attention",), ("lserve.engine", "lserve.serve")) == []
    assert reaches(graph, ("lserve.engine",), ("lserve.serve",)) == []
    # ... while the type checker still sees the forward's argument types
    assert {"lserve.attention.base", "lserve.sparsity.plan"} <= module_graph()["lserve.models.llama"]
