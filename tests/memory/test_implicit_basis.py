"""The implicit route's estimate with a Krylov basis cut to the memory available
(``docs/math.rst``, "Memory of a request", "Implicit products")."""

import pytest
import torch

from benchmarks.problems import PROBLEMS
from tests.fixtures.problems import mlp
from vivit.errors import ProductsTooLargeError
from vivit.linalg.iterative import basis_capacity, minimum_capacity
from vivit.linalg.top_k import (
    fitting_basis_columns,
    iterative_workspace_bytes,
    solver_block_size,
)
from vivit.memory.plan import ESTIMATE_FACTOR, Plan, Sizes
from vivit.memory.request import sized_plan
from vivit.options import CurvatureOptions

GIB = 2**30


def _plan(model, X, top_k, bytes_):
    """The plan of the implicit route for 8 samples like ``X``."""
    groups = [list(model.parameters())]
    options = CurvatureOptions(route="implicit", process_group=False)
    return sized_plan(model, X, None, groups, options, Sizes.of([8], None, None),
                      available=bytes_)  # fmt: skip


@pytest.mark.parametrize("top_k", [1, 10])
def test_the_estimate_states_the_basis_that_fits(top_k):
    """``m = min(default, the most columns whose workspace fits what is available
    besides the products)``, at least ``k + 2·b``; below that the request is
    refused with the estimate's factor 1.5."""
    model, X = mlp(300, 200, 10), torch.randn(8, 300)
    size = sum(p.numel() for p in model.parameters())
    width = solver_block_size("ggn_krylov", top_k, size)
    full = basis_capacity(width, size, top_k=top_k)
    least = minimum_capacity(top_k, width, size)
    default = _plan(model, X, top_k, 2**50).implicit_estimate(top_k)
    assert default.basis_columns == default.default_columns == full
    products = default.passes

    def workspace(columns=None):
        return iterative_workspace_bytes(
            size, top_k, torch.float32, 0, columns, "ggn_krylov"
        )

    assert default.solve == workspace(full)
    middle = (least + full) // 2
    for bytes_, columns in [
        (products + workspace(full), full),
        (products + workspace(middle), middle),
        (products + workspace(middle) - 1, middle - 1),
        (products + workspace(least), least),
    ]:
        plan = _plan(model, X, top_k, bytes_)
        estimate = plan.implicit_estimate(top_k)
        assert estimate.basis_columns == columns == plan.basis_columns(top_k)
        assert estimate.solve == workspace(columns) and estimate.total <= bytes_
    plan = _plan(
        model, X, top_k, int((products + workspace(least)) / ESTIMATE_FACTOR) - 1
    )
    assert plan.implicit_estimate(top_k).basis_columns == least
    with pytest.raises(ProductsTooLargeError) as error:
        plan.basis_columns(top_k)
    assert f"{least} columns (cut from {full} by memory)" in str(error.value)


def test_gpt2_with_the_full_vocabulary_fits_into_24_gib():
    """``gpt2-4l-128-v50257`` (``benchmarks/problems.py``, ``N = 8``, top 10):
    the narrow blocks' default basis of 64 columns fits into 24 GiB uncut (the
    basis and its images in float32), and into 4 GiB a basis cut to at least
    ``k + 2·b``."""
    problem = PROBLEMS["gpt2-4l-128-v50257"]
    torch.manual_seed(0)
    model = problem.build()
    X = torch.randint(0, problem.num_classes, (1, *problem.input_shape))
    size = sum(p.numel() for p in model.parameters())
    plan = _plan(model, X, 10, 24 * GIB)
    estimate = plan.implicit_estimate(10)
    assert estimate.basis_columns == estimate.default_columns == 64
    assert estimate.total <= 24 * GIB and plan.basis_columns(10) == 64
    uncut = estimate.passes + iterative_workspace_bytes(size, 10, torch.float32, 0)
    cut = fitting_basis_columns(size, 10, torch.float32, 8 * GIB - estimate.passes, 0)
    assert uncut > 8 * GIB and 30 < cut < 210  # blocks of k: cut in 8 GiB
    small = _plan(model, X, 10, 4 * GIB).implicit_estimate(10)
    assert 16 <= small.basis_columns < 64 and small.total <= 4 * GIB
    assert isinstance(plan, Plan)
