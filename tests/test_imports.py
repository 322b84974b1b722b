"""The packages' modules import each other one way: no import circles.

A circle (a imports b, b imports a, perhaps inside a function so that Python does not fail at
once) means two modules cannot be read, tested or changed one without the other. The graph is
built from each module's own import statements, read with `ast` and not run: relative and
absolute imports within the packages, at the top of a module or inside a function.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGES = ("tiny_llm_ref", "tiny_llm", "tiny_llm_support")


def module_name(path: Path, src: Path) -> str:
    """src/pkg/mod.py -> "pkg.mod"; src/pkg/__init__.py -> "pkg"."""
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Every dotted name the module imports, relative imports made absolute. For `from X
    import y` both X and X.y are named: y may be a module of the package X."""
    names = set()
    for node in ast.walk(tree):  # walks into functions and classes too
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from ..x import y`: count the levels up from this module's package
                package = module.split(".")
                if not is_package:
                    package = package[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(src: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of the same packages that it imports."""
    files = {}
    for package in packages:
        for path in sorted((src / package).rglob("*.py")):
            files[module_name(path, src)] = path
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = imported_names(tree, module, path.name == "__init__.py")
        graph[module] = {name for name in names if name in files and name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports as [a, b, ..., a], or None when the graph has none."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:  # back on the path we came by: that stretch is a circle
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph(SRC, PACKAGES)
    assert "tiny_llm_ref.attention" in graph["tiny_llm_ref.qwen3"], "the graph misses an import"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "statement",
    ["from .a import f", "from . import a", "from pkg.a import f", "import pkg.a"],
)
def test_a_circle_is_found(tmp_path, statement):
    """The checker itself: b imports a inside a function, a imports b at the top."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from .b import g\n")
    (tmp_path / "pkg" / "b.py").write_text(f"def g():\n    {statement}\n")
    cycle = find_cycle(import_graph(tmp_path, ("pkg",)))
    assert cycle in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])
