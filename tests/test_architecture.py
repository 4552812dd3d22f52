"""The import layering ``docs/architecture.rst`` states holds for every module.

Each module of ``vivit`` belongs to one layer; it may import from its own layer and
the layers above it, never from a layer below. BackPACK is imported only inside
``vivit/engines/backpack``. The studies (``exp/``) and the benchmarks
(``benchmarks/``) import only the public API that ``docs/api.rst`` documents.
"""

from __future__ import annotations

import ast
import re
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
    ("options", ["vivit.options", "vivit.distributed.group"]),
    ("memory", ["vivit.memory"]),
    ("computations", ["vivit.directional", "vivit.optim.damping"]),
    (
        "group pipeline",
        [
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


#: The page that defines the public API ("what this page documents").
API_PAGE = ROOT / "docs" / "api.rst"
#: ``.. automodule:: vivit.x`` documents a module, ``.. autoclass:: vivit.x.Name``
#: (``autofunction``, ``autoexception``, ...) a name of module ``vivit.x``.
_DIRECTIVE = re.compile(r"^\.\. auto(\w+):: (vivit[\w.]*)", re.MULTILINE)
#: ``vivit.x.y`` in the prose: an import path the page promises (the ViViT paths).
_IMPORT_PATH = re.compile(r"``(vivit(?:\.\w+)+)``")


def public_modules(page: str) -> set[str]:
    """``vivit`` and the modules ``page`` (reStructuredText) documents."""
    modules = {"vivit"}
    for kind, target in _DIRECTIVE.findall(page):
        modules.add(target if kind == "module" else target.rpartition(".")[0])
    modules.update(_IMPORT_PATH.findall(page))
    return modules


PUBLIC = public_modules(API_PAGE.read_text())


def private_imports(source: str, public: set[str]) -> list[str]:
    """What ``source`` imports from ``vivit`` outside the modules ``public``.

    ``import vivit.x`` needs ``vivit.x`` public; ``from vivit.x import y`` needs
    ``vivit.x`` or the submodule ``vivit.x.y`` public. No component of the path may
    start with ``_``.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            paths = [(alias.name, {alias.name}) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            paths = [
                (
                    f"{node.module}.{alias.name}",
                    {node.module, f"{node.module}.{alias.name}"},
                )
                for alias in node.names
            ]
        else:
            continue
        for path, allowed_by in paths:
            if path.split(".")[0] != "vivit":
                continue
            if any(part.startswith("_") for part in path.split(".")) or not (
                allowed_by & public
            ):
                found.append(path)
    return found


CLIENTS = sorted(
    path
    for folder in ("exp", "benchmarks")
    for path in (ROOT / folder).rglob("*.py")
    if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
)


@pytest.mark.parametrize("path", CLIENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_studies_and_benchmarks_import_only_the_public_api(path):
    private = private_imports(path.read_text(), PUBLIC)
    assert not private, (
        f"{path.relative_to(ROOT)} imports {', '.join(private)}: not in the public "
        "API (docs/api.rst)"
    )


def test_the_public_api_check_can_fail():
    """The page's modules are found, and imports past them are caught."""
    page = """
.. automodule:: vivit.linalg.top_k
.. autoclass:: vivit.linalg.iterative.SolverReport
.. autoexception:: vivit.VivitError
Also importable from ``vivit.linalg.eigh``.
"""
    public = public_modules(page)
    assert public == {
        "vivit",
        "vivit.linalg.top_k",
        "vivit.linalg.iterative",
        "vivit.linalg.eigh",
    }
    assert {"vivit", "vivit.memory", "vivit.linalg.top_k"} <= PUBLIC
    source = """
import vivit._memory
from vivit.linalg.solvers import numerical_zero_tolerance
from vivit.linalg.top_k import _private_helper
import vivit.linalg
from vivit import LowRankGGN
from vivit.linalg import top_k
from vivit.linalg.eigh import EighComputation
import torch
"""
    assert private_imports(source, public) == [
        "vivit._memory",
        "vivit.linalg.solvers.numerical_zero_tolerance",
        "vivit.linalg.top_k._private_helper",
        "vivit.linalg",
    ]
