"""The studies sit beside the library: `vit` never imports them (nor submitit, which only they need), no module of
either imports itself back through another, no study imports another (what they share is `studies.runner`), and
each study module reads in one sitting."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ``vit`` and ``studies`` (a package by its ``__init__.py``)."""
    out = {}
    for top in ("vit", "studies"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    """Every name ``path`` imports, at module level or inside a function, made absolute (``from a import b``
    gives ``a`` and ``a.b``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.update([base] + [f"{base}.{alias.name}" for alias in node.names])
    return names


def _graph() -> dict[str, set[str]]:
    """``{module: the modules of vit and studies it imports}`` (a name resolves to its longest module prefix)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {
        name: {m for n in _imports(path, name) if (m := resolve(n)) and m != name} for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan 1972): each holds an import cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_library_or_the_studies():
    graph = _graph()
    assert len(graph) > 50 and any(m.startswith("studies.") for m in graph)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    # report imported visibility at module level and visibility imported report inside a function, before the studies
    # left the package; a third module breaks that cycle now.
    graph = {"report": {"visibility", "cells"}, "visibility": {"report", "cells"}, "cells": set(), "grid": {"cells"}}
    assert _cycles(graph) == [["report", "visibility"]]
    assert _cycles({**graph, "visibility": {"cells"}}) == []
    source = ROOT / "studies/runner/visibility.py"
    assert "studies.runner.cells.distance_edges" in _imports(source, "studies.runner.visibility")


def test_the_library_imports_no_study_and_no_submitit():
    modules = _modules()
    for name, path in modules.items():
        if name.split(".")[0] == "vit":
            imported = _imports(path, name)
            assert not {n for n in imported if n.split(".")[0] in ("studies", "submitit")}, name


def _other_studies(name: str, path: Path) -> set[str]:
    """The names ``path`` (module ``name`` of ``studies``) imports from a study other than its own, the shared
    ``studies.runner`` allowed."""
    allowed = (".".join(name.split(".")[:2]), "studies.runner")
    return {
        n
        for n in _imports(path, name)
        if n.startswith("studies.") and not any(n == a or n.startswith(a + ".") for a in allowed)
    }


def test_no_study_imports_another_study_and_the_runner_imports_none():
    # A study is its README, configs, command and results, with its own code; what two studies share is in
    # studies.runner, which no study owns, and which imports no study itself.
    studies = {name: path for name, path in _modules().items() if name.startswith("studies.")}
    assert {"studies.runner", "studies.relation", "studies.arrangement", "studies.recipe"} <= set(studies)
    assert {name: found for name, path in studies.items() if (found := _other_studies(name, path))} == {}
    runner = {name: path for name, path in studies.items() if name.startswith("studies.runner")}
    assert all(
        not {n for n in _imports(path, name) if n.startswith("studies.") and not n.startswith("studies.runner")}
        for name, path in runner.items()
    )
    # The check sees a cross-study import, at module level or in a function.
    probe = ROOT / "studies/arrangement/settings.py"  # a study module that imports the shared runner only
    assert "studies.runner.grid.plan" in _imports(probe, "studies.arrangement.settings")
    assert _other_studies("studies.arrangement.x", probe) == set()
    assert _other_studies("studies.recipe.x", probe) == set()  # studies.runner is shared
    assert _other_studies("studies.explain.x", ROOT / "studies/arrangement/__main__.py") == {
        "studies.arrangement",
        "studies.arrangement.report",
        "studies.arrangement.shortcuts",
    }


def test_every_study_module_is_at_most_450_lines():
    sizes = {
        name: len(path.read_text().splitlines()) for name, path in _modules().items() if name.startswith("studies")
    }
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_checkpoint_package_is_at_most_500_lines():
    # The model folder's reader and writer, Lightning's one CheckpointIO and the download: all lines of its files,
    # so that what a hostile checkpoint meets stays small enough to review whole.
    files = sorted((ROOT / "vit" / "artifact").rglob("*.py"))
    sizes = {path.name: len(path.read_text().splitlines()) for path in files}
    assert len(files) >= 3 and sum(sizes.values()) <= 500, sizes


def test_no_module_over_400_lines_and_no_function_over_60():
    # The formatter owns the layout, so these are sizes of formatted code: a module reads in one sitting, a function
    # on one screen. A function's size runs from its `def` to its last line (docstring and comments included).
    modules, functions = {}, {}
    files = [*(ROOT / "vit").rglob("*.py"), *(ROOT / "studies").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    for path in [*files, ROOT / "train.py"]:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if len(text.splitlines()) > 400:
            modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                functions[f"{name}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert (modules, functions) == ({}, {})
