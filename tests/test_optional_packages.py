"""Optional packages: a missing one named, a torchvision that cannot load hidden.

The torchvision tests run in a fresh interpreter beside a stand-in torchvision
(tests/fixtures/optional_packages.py).
"""

from __future__ import annotations

import pytest

from tests.fixtures.optional_packages import BROKEN, run_beside
from vivit import MissingPackageError
from vivit.optional_packages import import_optional


def test_a_missing_package_is_named():
    with pytest.raises(MissingPackageError, match="The thing needs the package 'no-"):
        import_optional("no_such_module_here", "no-such-package", "The thing")
    assert import_optional("json", "json", "The thing").__name__ == "json"


def test_a_torchvision_that_cannot_load_is_hidden_from_imports_and_metadata(tmp_path):
    output = run_beside(
        tmp_path,
        BROKEN,
        """
        import importlib.metadata as metadata
        import importlib.util
        from vivit.huggingface import hide_broken_torchvision

        assert hide_broken_torchvision() is True
        assert hide_broken_torchvision() is False  # hidden already
        try:
            import torchvision
        except ImportError:
            pass
        else:
            raise AssertionError("torchvision still imports")
        assert importlib.util.find_spec("torchvision") is None
        try:
            metadata.version("torchvision")
        except metadata.PackageNotFoundError:
            pass
        else:
            raise AssertionError("torchvision's metadata is still found")
        assert metadata.version("torch")  # other packages are found as before
        assert "torch" in {d.metadata["Name"] for d in metadata.distributions()}
        """,
    )
    assert "torchvision does not load beside this torch" in output


def test_a_torchvision_that_loads_is_left_alone(tmp_path):
    run_beside(
        tmp_path,
        "LOADED = True\n",
        """
        import importlib.metadata as metadata
        import sys
        from vivit.huggingface import hide_broken_torchvision

        assert hide_broken_torchvision() is False
        assert sys.modules["torchvision"].LOADED
        assert metadata.version("torchvision") == "0.28.0"
        """,
    )
