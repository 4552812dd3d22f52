"""Optional packages imported when asked for, named when missing; torchvision hidden."""

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
    """Import ``module`` (``"lightning.pytorch"``) of the optional ``package``.

    ``what`` needs it: the subject of the message that says how to install it.

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
    """A ``sys.meta_path`` finder hiding ``name``'s metadata from importlib.metadata."""

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
    PyTorch's CPU build, and both packages import it when installed. Call this
    before importing them: a broken torchvision is hidden in this process as if
    not installed (the guide, "Hugging Face models"); one that loads is left alone.

    Returns:
        Whether torchvision was hidden by this call (``False`` when called again).
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
