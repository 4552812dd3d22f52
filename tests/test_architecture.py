"""The import layering ``docs/architecture.rst`` states holds for every module.

Each module of ``vivit`` belongs to one layer; it may import from its own layer and
the layers above it, never from a layer below. BackPACK is imported only inside
``vivit/engines/backpack``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Layers from the top (imported by everything below) to the bottom, as module
#: prefixes; the longest matching prefix decides. Must match docs/architecture.rst.
LAYERS = [
    (
        "foundations",
        ["vivit.errors", "vivit._validation", "vivit.losses"],
    ),
    ("gram algebra", ["vivit.gram"]),
    (
        "Gram eigensolvers",
        [
            "vivit.linalg.solvers",
            "vivit.linalg.group_products",
            "vivit.linalg.iterative",
            "vivit.linalg.top_k",
            "vivit.linalg.operator",
            "vivit.linalg.__init__",
        ],
    ),
    ("engines", ["vivit.engines"]),
    ("memory", ["vivit.memory"]),
    ("computations", ["vivit.directional", "vivit.optim.damping"]),
    (
        "group pipeline",
        [
            "vivit.options",
            "vivit.sources",
            "vivit.distributed",
        ],
    ),
    ("results", ["vivit.results"]),
    (
        "front doors",
        [
            "vivit.lowrank",
            "vivit.streaming",
            "vivit.compat",
            "vivit.linalg.eigh",
            "vivit.linalg.eigvalsh",
            "vivit.optim",
            "vivit.__init__",
        ],
    ),
]


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer of docs/architecture.rst"
    return max(matches)[1]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


SOURCES = sorted((ROOT / "vivit").rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[module_name(p) for p in SOURCES])
def test_imports_go_up_the_layers(path):
    own = layer_of(module_name(path))
    for name in imports(path):
        if not name.startswith("vivit."):
            continue
        try:
            imported = layer_of(name)
        except AssertionError:
            continue  # ``from vivit.x import Name``: the module itself was checked
        assert imported <= own, (
            f"{module_name(path)} ({LAYERS[own][0]}) imports {name} "
            f"({LAYERS[imported][0]}), a layer below it"
        )


@pytest.mark.parametrize("path", SOURCES, ids=[module_name(p) for p in SOURCES])
def test_only_the_backpack_engine_imports_backpack(path):
    inside = path.is_relative_to(ROOT / "vivit" / "engines" / "backpack")
    uses_backpack = any(
        n == "backpack" or n.startswith("backpack.") for n in imports(path)
    )
    assert inside or not uses_backpack, f"{module_name(path)} imports BackPACK"


def test_the_check_can_fail():
    """A lower layer importing a higher one is caught."""
    assert layer_of("vivit.lowrank") > layer_of("vivit.engines.func.engine")
    assert layer_of("vivit.sources.collector") > layer_of("vivit.linalg.solvers")
