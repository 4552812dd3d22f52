"""How much memory a curvature request needs, before the backward pass runs.

:func:`estimate_memory` adds what is alive at the peak of ``LowRankGGN(...)``
followed by ``eigh(top_k)`` (shapes as in ``docs/math.rst``):

- **activations**: the forward pass's layer outputs, ``N · Σ_layers out`` entries
  (autograd keeps them for the backward pass, the factors keep layer inputs after);
- **factors**: per Linear or convolution weight the backpropagated vectors
  ``s̃`` (``N_S · C · out`` entries, ``C`` → ``M`` with Monte-Carlo sampling) and
  the per-sample gradients at the layer output (``N · out``), for convolutions also
  the unfolded input (``N · T · P``); every other parameter keeps its columns of
  ``V`` and per-sample gradients (``(N_S · C + N) · numel``);
- the larger of the **backward pass's transient** (the backpropagated
  ``[C, N_S, *shape]`` quantities at a layer's input and output) and the
  **eigensolver's** share: the Gram matrices it forms (``(N_S·C)²`` entries each,
  none for ``"matrix_free"``) and its workspace.

``N_S`` is the number of curvature samples (the subsampling), ``N`` the
mini-batch size. Entries are counted in the parameters' data type, the iterative
solvers' Krylov bases in float64. The estimate leaves out the model, the data and
the loaded libraries; ``tests/test_memory.py`` checks it against the measured
increase of resident memory within a factor of 2.

:func:`largest_batch` searches the largest mini-batch whose estimate fits a budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, no_grad
from torch.nn import Conv1d, Conv2d, Conv3d, Linear, Module, Parameter

from vivit._memory import dense_workspace_bytes, gram_bytes, itemsize
from vivit._validation import check_mc_samples
from vivit.errors import InvalidArgumentError
from vivit.linalg.top_k import check_solver, choose_solver, iterative_workspace_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory a :class:`~vivit.LowRankGGN` request needs, in bytes.

    Attributes:
        activations: Layer outputs of the forward pass.
        factors: Factors of ``V`` and of the per-sample gradients kept for products.
        backward: Transient backpropagated quantities of the backward pass.
        grams: Gram matrices the eigensolver forms.
        solver_workspace: The eigensolver's workspace, or the temporaries of
            forming a Gram matrix where those are larger.
        solver: The solver the estimate is for (``"auto"`` resolved).
        num_rows: Side length ``N·C`` of the Gram matrix.
    """

    activations: int
    factors: int
    backward: int
    grams: int
    solver_workspace: int
    solver: str
    num_rows: int

    @property
    def total(self) -> int:
        """Peak bytes: activations, factors and the larger of the two phases."""
        return (
            self.activations
            + self.factors
            + max(self.backward, self.grams + self.solver_workspace)
        )


@dataclass(frozen=True)
class _Layer:
    """Per-sample sizes of a layer with parameters, from a probe forward pass."""

    module: Module
    inputs: int
    outputs: int
    unfolded: int


def estimate_memory(
    model: Module,
    example_inputs: Tensor,
    batch_size: int,
    *,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
    mc_samples: int = 0,
    num_curvature_samples: int | None = None,
    top_k: int | None = 10,
    solver: str = "auto",
) -> MemoryEstimate:
    """Estimate the peak memory of ``LowRankGGN(...)`` followed by ``eigh(top_k)``.

    Runs the model on ``example_inputs`` (one or a few samples, without gradients
    and with the modules' hooks switched off, so BackPACK's stored inputs are left
    alone) to learn the layer shapes; nothing of size ``batch_size`` is allocated.
    The estimate is for the model's parameter data type and device.

    Example::

        estimate = estimate_memory(model, X[:1], batch_size=512, top_k=10)
        print(estimate.total / 2**20, "MiB with the", estimate.solver, "solver")

    Args:
        model: The network (BatchNorm in eval mode).
        example_inputs: A few input samples, ``[n, *input_shape]``.
        batch_size: Mini-batch size ``N`` of the request.
        param_groups: As for :class:`~vivit.LowRankGGN` (``None``: one group).
        mc_samples: As for :class:`~vivit.LowRankGGN`.
        num_curvature_samples: Size of the subsampling (``None``: ``N``).
        top_k: Number of leading eigenpairs asked for (``None``: all).
        solver: As for :class:`~vivit.LowRankGGN`; ``"auto"`` is resolved with the
            same cost model and memory budget the request would use.

    Returns:
        The estimate; ``.total`` is the peak in bytes.

    Raises:
        ValueError: For a ``batch_size``, ``top_k``, ``mc_samples`` or ``solver``
            that a request would refuse.
    """
    check_solver(solver, top_k)
    check_mc_samples(mc_samples)
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or batch_size < 1
    ):
        raise InvalidArgumentError(
            f"batch_size must be a positive integer, got {batch_size!r}."
        )
    params = [p for p in model.parameters() if p.requires_grad]
    if param_groups is None:
        param_groups = [params]
    dtype, device = params[0].dtype, params[0].device
    entry = itemsize(dtype)
    layers, outputs_per_sample, columns = _probe(model, example_inputs)
    columns = mc_samples or columns
    curvature = batch_size if num_curvature_samples is None else num_curvature_samples
    size = curvature * columns

    factors = 0
    backward = 0
    for layer in layers:
        backward = max(backward, columns * curvature * (layer.inputs + layer.outputs))
        for name, param in layer.module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if name == "weight" and isinstance(layer.module, _OUTER_PRODUCT_LAYERS):
                factors += (columns * curvature + batch_size) * layer.outputs
                factors += batch_size * layer.unfolded
            else:
                factors += (columns * curvature + batch_size) * param.numel()

    largest_group = max(sum(p.numel() for p in group) for group in param_groups)
    if solver == "auto":
        solver = choose_solver(
            size, top_k, num_params=largest_group, dtype=dtype, device=device
        )
    if solver == "dense":
        workspace = dense_workspace_bytes(size, top_k, dtype, device)
    else:
        products = largest_group if solver == "matrix_free" else None
        workspace = iterative_workspace_bytes(size, top_k, dtype, products)
    if solver == "matrix_free":
        grams, workspace = 0, workspace
    else:
        grams = len(param_groups) * size**2 * entry
        workspace = gram_bytes(size, len(param_groups), workspace, dtype) - grams
    return MemoryEstimate(
        activations=batch_size * outputs_per_sample * entry,
        factors=factors * entry,
        backward=backward * entry,
        grams=grams,
        solver_workspace=workspace,
        solver=solver,
        num_rows=size,
    )


def largest_batch(
    model: Module,
    example_inputs: Tensor,
    budget_bytes: int,
    *,
    max_batch_size: int = 2**20,
    **request,
) -> int:
    """The largest mini-batch whose estimated peak memory fits a budget.

    Args:
        model: The network.
        example_inputs: A few input samples (see :func:`estimate_memory`).
        budget_bytes: Memory available for the request.
        max_batch_size: Upper end of the search.
        **request: Keywords of :func:`estimate_memory` (``top_k``, ``solver``,
            ``mc_samples``, ``param_groups``); ``num_curvature_samples`` is not
            allowed (it would not grow with the batch).

    Returns:
        The batch size (``0`` if not even one sample fits).

    Raises:
        ValueError: If the budget is not positive or a keyword is not allowed.
    """
    if not budget_bytes > 0:
        raise InvalidArgumentError(
            f"budget_bytes must be positive, got {budget_bytes!r}."
        )
    if "num_curvature_samples" in request:
        raise InvalidArgumentError(
            "largest_batch searches the mini-batch size; num_curvature_samples "
            "would stay fixed. Leave it out."
        )

    def fits(batch_size: int) -> bool:
        estimate = estimate_memory(model, example_inputs, batch_size, **request)
        return estimate.total <= budget_bytes

    low, high = 0, 1
    while high <= max_batch_size and fits(high):
        low, high = high, 2 * high
    high = min(high, max_batch_size + 1)
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


_OUTER_PRODUCT_LAYERS = (Linear, Conv1d, Conv2d, Conv3d)


def _probe(model: Module, inputs: Tensor) -> tuple[list[_Layer], int, int]:
    """Per-sample layer sizes from a forward pass on a few samples.

    Returns:
        Layers with parameters, the summed output size of every leaf module per
        sample, and the model's outputs per sample ``C``.
    """
    layers: list[_Layer] = []
    outputs = 0
    num = inputs.shape[0]

    def record(module: Module, args: tuple, output: Tensor) -> None:
        nonlocal outputs
        if not isinstance(output, Tensor):
            return
        outputs += output.numel() // num
        if not any(True for _ in module.parameters(recurse=False)):
            return
        unfolded = 0
        if isinstance(module, (Conv1d, Conv2d, Conv3d)):
            positions = math.prod(output.shape[2:])
            unfolded = module.weight[0].numel() * module.groups * positions
        layers.append(
            _Layer(module, args[0].numel() // num, output.numel() // num, unfolded)
        )

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    with _hooks_replaced(model), no_grad():
        handles = [m.register_forward_hook(record) for m in leaves]
        try:
            result = model(inputs)
        finally:
            for handle in handles:
                handle.remove()
    return layers, outputs, result[0].numel()


@contextmanager
def _hooks_replaced(model: Module) -> Iterator[None]:
    """Switch off every module's forward hooks (BackPACK's store layer inputs)."""
    saved = []
    for module in model.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, type(getattr(module, attr))())
    try:
        yield
    finally:
        for module, attr, hooks in saved:
            setattr(module, attr, hooks)
