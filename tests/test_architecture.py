"""The layer contract (pyproject's [tool.importlinter]), no import cycles, no private names across modules."""

import ast
from pathlib import Path

import grimp
import pytest

PACKAGE = Path(__file__).parents[1] / "src" / "retrofitter"


def test_layer_contract_holds():
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(PACKAGE.parents[1] / "pyproject.toml"), no_cache=True) == 0


def test_no_import_cycles_even_through_function_level_imports():
    graph = grimp.build_graph("retrofitter", cache_dir=None)  # grimp sees imports inside functions too
    cycles = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported != module and graph.chain_exists(importer=imported, imported=module):
                cycles.add(tuple(sorted((module, imported))))
    # a package importing its own submodule (__init__ re-exports) is not a cycle of code
    cycles = {pair for pair in cycles if not any(b.startswith(a + ".") or a.startswith(b + ".") for a, b in [pair])}
    assert not cycles, f"import cycles: {sorted(cycles)}"


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("retrofitter")):
            found += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


@pytest.mark.parametrize("tree", ["src", "benchmarks"])
def test_no_private_names_imported_across_modules(tree):
    root = PACKAGE if tree == "src" else PACKAGE.parents[1] / "benchmarks"
    found = [hit for path in sorted(root.rglob("*.py")) for hit in _private_imports(path)]
    assert not found, found
