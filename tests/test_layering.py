"""The package's layers, named here once, and the imports between its modules.

A module may import modules of its own layer or of a lower one, never a higher one, and no two
modules may import each other, directly or through others. Every import counts, those inside
functions too (they hide a cycle, they do not remove it); imports under ``if TYPE_CHECKING:`` do
not run and are left out. A submodule's import of its own package's ``__init__`` is left out as
well: Python initialises a package before any of its submodules, so that edge is no dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "omnibal_compile"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("errors", "_utils", "progress")),
    ("intermediate results and settings", ("ir", "costs.devices", "data", "config")),
    ("planning and simulation", ("planning", "sim", "costs.analytic", "costs.mix", "costs._cache",
                                 "costs.tensor_parallel")),
    ("compiler", ("compile", "kernels", "costs", "models", "integrations")),
    ("optimize", ("api", "")),
    ("runtime", ("runtime", "calibrate")),
    ("command line", ("cli",)),
)
"""Lowest first: (name, module prefixes under ``omnibal_compile``). A module belongs to the layer of
its longest matching prefix; ``""`` is the package's own ``__init__`` (the public surface)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The package module that ``import name`` loads last (``pkg.mod.Class`` -> ``pkg.mod``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return skipped


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports at run time."""
    tree = ast.parse(MODULES[module].read_text())
    skipped = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            target = _resolve(name) if name.startswith("omnibal_compile") else None
            if target is None or target == module or module.startswith(target + "."):
                continue  # outside the package, itself, or its own package's __init__
            found.add(target)
    return found


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of ``module``'s layer; None when no prefix matches."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            full = f"omnibal_compile.{prefix}".rstrip(".")
            if (module == full or module.startswith(full + ".")) and (best is None or len(full) > best[1]):
                best = (index, len(full))
    return None if best is None else best[0]


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for module in MODULES:
        graph.add_node(module)
        graph.add_edges_from((module, target) for target in imports_of(module))
    return graph


def test_every_module_has_a_layer() -> None:
    missing = [m for m in MODULES if layer_of(m) is None]
    assert not missing, f"name the layer of {missing} in LAYERS"


def test_no_module_imports_a_higher_layer() -> None:
    breaks = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"  # type: ignore[index]
        for a, b in sorted(import_graph().edges)
        if layer_of(b) > layer_of(a)  # type: ignore[operator]
    ]
    assert not breaks, "\n".join(breaks)


def test_no_import_cycles() -> None:
    cycles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_import_reader_sees_function_level_and_skips_type_checking_imports(tmp_path: Path) -> None:
    # The checks above are only as good as the reader: plant each kind of import and read it back.
    source = (
        "from typing import TYPE_CHECKING\n"
        "from omnibal_compile.errors import InputError\n"
        "import omnibal_compile.ir.plan\n"
        "if TYPE_CHECKING:\n    from omnibal_compile.api import optimize\n"
        "def f():\n    from omnibal_compile.planning.dp import solve_dp\n"
    )
    fake = PACKAGE / "_utils" / "tables.py"
    original = MODULES["omnibal_compile._utils.tables"]
    planted = tmp_path / "tables.py"
    planted.write_text(source)
    MODULES["omnibal_compile._utils.tables"] = planted
    try:
        found = imports_of("omnibal_compile._utils.tables")
    finally:
        MODULES["omnibal_compile._utils.tables"] = original
    assert fake.is_file()
    assert found == {"omnibal_compile.errors", "omnibal_compile.ir.plan", "omnibal_compile.planning.dp"}


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("omnibal_compile.costs.devices", "intermediate results and settings"),
        ("omnibal_compile.costs.annotate", "compiler"),
        ("omnibal_compile", "optimize"),
        ("omnibal_compile.cli.run", "command line"),
        ("omnibal_compile._utils.validate", "base"),
    ],
)
def test_a_module_takes_the_layer_of_its_longest_prefix(module: str, expected: str) -> None:
    assert LAYERS[layer_of(module)][0] == expected  # type: ignore[index]
