"""The picture of ``docs/architecture.rst`` is the layering, and the code follows it.

The page's first ``code-block:: text`` draws the layers from the top (imported by
every layer below) to the bottom, one line per module under its layer. This test
reads the layers from the page, so page and code cannot drift apart: every module
of ``vivit`` stands on the page exactly once, every path on the page exists, and
each module imports only from its own layer and the layers above it. BackPACK is
imported only inside ``vivit/engines/backpack``. The folders outside ``vivit/`` on
the page (the studies ``exp/``, the benchmarks ``benchmarks/``) import only the
public API that ``docs/api.rst`` documents.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The page whose picture defines the layers.
ARCHITECTURE_PAGE = ROOT / "docs" / "architecture.rst"
#: ``   name ────── what it does``: a layer.
_LAYER = re.compile(r"^   (\w[^─]*?) ─+ \S")
#: ``   │ path   its job``: a module (or a folder outside ``vivit/``) of the layer.
_ENTRY = re.compile(r"^   │ (\S+)  +\S")
#: ``   │``: the line between two layers.
_GAP = "   │"

Layers = list[tuple[str, list[str]]]


def parse_layers(page: str) -> Layers:
    """The layers of the page's first ``code-block:: text``, from the top.

    Args:
        page: reStructuredText.

    Returns:
        ``(name, paths)`` per layer; paths relative to the repository root.

    Raises:
        ValueError: If the page has no picture, or a line of it is neither a
            layer, an entry of one, nor the gap between two.
    """
    lines = page.splitlines()
    try:
        start = lines.index(".. code-block:: text") + 1
    except ValueError:
        raise ValueError("the page has no '.. code-block:: text' picture") from None
    layers: Layers = []
    for number, line in enumerate(lines[start:], start + 1):
        if not line.strip():
            continue
        if not line.startswith(" "):
            break  # the end of the literal block
        if layer := _LAYER.match(line):
            layers.append((layer[1], []))
        elif (entry := _ENTRY.match(line)) and layers:
            layers[-1][1].append(entry[1])
        elif line.rstrip() != _GAP:
            raise ValueError(
                f"line {number} of the page, {line!r}, is neither a layer "
                "('   name ─── what it does'), an entry of one ('   │ path  its "
                "job') nor the gap between two ('   │')"
            )
    if not layers:
        raise ValueError("the picture draws no layer")
    return layers


def coverage_problems(layers: Layers, root: Path) -> list[str]:
    """Where the page and the tree under ``root`` disagree on the modules.

    Every module file under ``root/vivit`` must stand on the page exactly once;
    every path on the page must exist (a ``.py`` file inside ``vivit/``).
    """
    listed = [path for _, paths in layers for path in paths]
    problems = [
        f"{path} stands {count} times on the page"
        for path, count in Counter(listed).items()
        if count > 1
    ]
    for path in dict.fromkeys(listed):
        inside = path.startswith("vivit/")
        if not (root / path).exists() or (inside and not path.endswith(".py")):
            problems.append(f"{path} is on the page but is no module or folder")
    problems += [
        f"{path} is missing from the page"
        for path in sorted(
            p.relative_to(root).as_posix() for p in (root / "vivit").rglob("*.py")
        )
        if path not in listed
    ]
    return problems


def layer_of(layers: Layers) -> dict[str, int]:
    """The position of each path's layer, from the top."""
    return {path: index for index, (_, paths) in enumerate(layers) for path in paths}


def module_file(name: str, root: Path) -> str | None:
    """The file of module ``name`` (``vivit.x.y``), or ``None`` for another name."""
    parts = name.split(".")
    for path in (Path(*parts).with_suffix(".py"), Path(*parts, "__init__.py")):
        if (root / path).is_file():
            return path.as_posix()
    return None


def imports(path: str, source: str) -> list[str]:
    """Every dotted name ``source`` (the module at ``path``) imports.

    ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (a module or a name in
    ``a.b``); relative imports are resolved against ``path``'s package.
    """
    package = Path(path).parent.parts
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def downward_imports(path: str, source: str, layers: Layers, root: Path) -> list[str]:
    """The imports of ``source`` (the module at ``path``) from a layer below its own."""
    where = layer_of(layers)
    found = []
    for name in imports(path, source):
        target = module_file(name, root) if name.split(".")[0] == "vivit" else None
        # a module missing from the page is reported by coverage_problems
        if target in where and where[target] > where[path]:
            found.append(
                f"{path} ({layers[where[path]][0]}) imports {name} "
                f"({layers[where[target]][0]}), a layer below it"
            )
    return found


LAYERS = parse_layers(ARCHITECTURE_PAGE.read_text())
SOURCES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "vivit").rglob("*.py"))


def test_every_module_stands_on_the_page_once():
    problems = coverage_problems(LAYERS, ROOT)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", SOURCES)
def test_imports_go_up_the_layers(path):
    assert path in layer_of(LAYERS), f"{path} is missing from docs/architecture.rst"
    found = downward_imports(path, (ROOT / path).read_text(), LAYERS, ROOT)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", SOURCES)
def test_only_the_backpack_engine_imports_backpack(path):
    inside = path.startswith("vivit/engines/backpack/")
    uses_backpack = any(
        n == "backpack" or n.startswith("backpack.")
        for n in imports(path, (ROOT / path).read_text())
    )
    assert inside or not uses_backpack, f"{path} imports BackPACK"


def test_the_page_draws_the_layers_in_the_order_of_the_data_flow():
    """The layers the page draws, in order; each holds what its name says."""
    assert [name for name, _ in LAYERS] == [
        "foundations",
        "Gram algebra",
        "Gram eigensolvers",
        "engines",
        "Gram-space formulas",
        "options",
        "sources",
        "memory and the plan",
        "results",
        "front doors",
        "analysis",
        "studies",
    ]
    where = layer_of(LAYERS)
    assert where["vivit/analysis/monitor.py"] > where["vivit/lowrank.py"]
    assert where["vivit/lowrank.py"] > where["vivit/results.py"]
    assert where["vivit/results.py"] > where["vivit/memory/plan.py"]
    assert where["vivit/memory/plan.py"] > where["vivit/sources/stored.py"]
    assert where["vivit/sources/stored.py"] > where["vivit/options.py"]
    assert where["vivit/options.py"] > where["vivit/engines/choice.py"]
    assert where["vivit/engines/base.py"] > where["vivit/gram/factors.py"]
    assert LAYERS[-1] == ("studies", ["exp/", "benchmarks/"])


def _tree(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_the_page_checks_can_fail(tmp_path):
    """A stray line, a module twice, a path that does not exist, a missing module,
    and an import from a layer below are all caught."""
    page = """
Title
=====

.. code-block:: text

   top ─────── imported by the rest
   │ vivit/top.py          one job
   │ vivit/top.py          twice
   │ vivit/gone.py         does not exist
   │ exp/                  a folder outside the package
   │
   bottom ──── imports the rest
   │ vivit/bottom.py       another job

Prose after the picture.
"""
    root = _tree(
        tmp_path,
        {
            "vivit/top.py": "",
            "vivit/bottom.py": "",
            "vivit/pkg/__init__.py": "",
            "exp/study.py": "",
        },
    )
    layers = parse_layers(page)
    assert layers == [
        ("top", ["vivit/top.py", "vivit/top.py", "vivit/gone.py", "exp/"]),
        ("bottom", ["vivit/bottom.py"]),
    ]
    assert coverage_problems(layers, root) == [
        "vivit/top.py stands 2 times on the page",
        "vivit/gone.py is on the page but is no module or folder",
        "vivit/pkg/__init__.py is missing from the page",
    ]
    with pytest.raises(ValueError, match="line 12 of the page"):
        parse_layers(page.replace("   │\n", "   | the gap, mistyped\n"))
    with pytest.raises(ValueError, match="no '.. code-block:: text'"):
        parse_layers("Title\n=====\n")

    layers = [("top", ["vivit/top.py"]), ("bottom", ["vivit/bottom.py"])]
    source = "import torch\nfrom vivit.top import x\nimport vivit.bottom\n"
    assert downward_imports("vivit/bottom.py", source, layers, root) == []
    assert downward_imports("vivit/top.py", source, layers, root) == [
        "vivit/top.py (top) imports vivit.bottom (bottom), a layer below it"
    ]
    for source in ("from vivit import bottom", "from . import bottom"):
        assert len(downward_imports("vivit/top.py", source, layers, root)) == 1


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


#: The Python files of the folders outside ``vivit/`` on the page.
CLIENTS = sorted(
    path
    for folder in layer_of(LAYERS)
    if not folder.startswith("vivit/")
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
