"""Optional packages: imported when asked for, named when missing.

``transformers`` and ``lightning`` import ``torchvision`` (Lightning through
``torchmetrics``) whenever it is installed, and PyPI's torchvision wheel, which
BackPACK requires, does not load beside PyTorch's CPU build.
:func:`hide_broken_torchvision` lets both import without it.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator
from importlib.metadata import DistributionFinder, PackageNotFoundError
from types import ModuleType

from vivit.errors import MissingPackageError

logger = logging.getLogger("vivit")


def import_optional(module: str, package: str, what: str) -> ModuleType:
    """Import ``module`` of the optional ``package``, or say how to install it.

    Args:
        module: The module to import, e.g. ``"lightning.pytorch"``.
        package: The package to install for it, e.g. ``"lightning"``.
        what: What needs it, the error message's subject.

    Returns:
        The module.

    Raises:
        MissingPackageError: If ``module`` cannot be imported.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingPackageError(
            f"{what} needs the package {package!r}, which cannot be imported "
            f"({error}): install it with `pip install {package}`."
        ) from None


class _HiddenDistribution(DistributionFinder):
    """A ``sys.meta_path`` finder under which a package's metadata is not found.

    Libraries that ask whether torchvision is installed through its metadata
    (``importlib.metadata.version``, as Lightning's ``RequirementCache`` does)
    get ``PackageNotFoundError``, as if it were not installed; it finds no
    modules (``find_spec`` is ``None``, so the import system goes on).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, *_: object) -> None:
        return None

    def find_distributions(
        self, context: DistributionFinder.Context | None = None
    ) -> Iterator:
        name = None if context is None else context.name
        if name is not None and name.lower() == self.name:
            raise PackageNotFoundError(name)
        return iter(())


def hide_broken_torchvision() -> bool:
    """Let ``transformers`` and ``lightning`` import beside a broken torchvision.

    PyPI's torchvision wheel (which BackPACK requires) does not load beside
    PyTorch's CPU build (``RuntimeError: operator torchvision::nms does not
    exist``), and ``transformers`` and ``lightning`` (through ``torchmetrics``)
    import torchvision whenever it is installed. Call this before importing
    them: if torchvision loads, nothing changes; if it fails with that error,
    torchvision is hidden in this process, as if it were not installed: its
    import fails with ``ImportError`` (``sys.modules["torchvision"] = None``)
    and its metadata is not found (``importlib.metadata.version("torchvision")``
    raises ``PackageNotFoundError``). Both packages then run without it (text
    and vision models, trainers and callbacks do; only torchvision-backed image
    processors and metrics are missing). The clean alternative is a torchvision
    built for the installed torch (e.g. from PyTorch's CPU wheel index).
    Calling it again changes nothing.

    Returns:
        Whether torchvision was hidden by this call.
    """
    try:
        import torchvision  # noqa: F401
    except RuntimeError as error:
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        sys.meta_path.insert(0, _HiddenDistribution("torchvision"))
        logger.warning(
            "torchvision does not load beside this torch (%s): hidden from "
            "transformers and lightning in this process.",
            error,
        )
        return True
    except ImportError:
        return False
    return False
