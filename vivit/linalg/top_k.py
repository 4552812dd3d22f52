"""Leading eigenpairs of a group's Gram matrix: which solver, and running it.

Three solvers compute the ``k`` leading eigenpairs of ``G̃ = Vᵀ V`` (``N·C = R``
rows, ``docs/math.rst``, "The Gram matrix and exact eigenpairs"):

``"dense"``
    LAPACK on the Gram matrix: ``O(R³)`` work (``4/3·R³`` multiply-adds for the
    reduction to tridiagonal form), 2–3 more ``R × R`` matrices of workspace.
``"iterative"``
    Restarted block Krylov iteration (:mod:`vivit.linalg.iterative`) on the Gram
    matrix: products with ``G̃`` (``R²`` each, as matrix products of ``b``
    columns, :func:`solver_block_size`) until the residuals are small enough, and
    ``O(m²·R)`` orthogonalization for a basis of ``m`` columns.
``"matrix_free"``
    The same iteration on ``G̃ U = Σ_p V_pᵀ (V_p U)``: the Gram matrix is never
    formed; a product costs the factors' two ``V``-products, at most ``2·R·D``.
``"implicit"``
    The same iteration on ``G`` itself in the group's parameter space (``D``
    rows), each product ``G v = Jᵀ H J v`` a JVP and a VJP through the model
    per block of samples (:mod:`vivit.sources.implicit`); neither ``V`` nor
    the Gram matrix exists. A route chosen at construction
    (``LowRankGGN(..., solver="implicit")``, or ``"auto"`` at construction
    when the Gram route's columns cost more or do not fit:
    :mod:`vivit.memory.route`).

The cost model behind ``"auto"`` (all quantities known before any work):

1. All eigenpairs, or more than ``PARTIAL_FRACTION·R`` of them: ``"dense"``.
2. The Gram matrix not formed yet and too large for the available memory (with
   the iterative workspace): ``"matrix_free"``.
3. Otherwise the solver of least expected work, in multiply-adds, where the
   iterative solvers multiply :data:`EXPECTED_BLOCKS` blocks of ``b`` vectors
   (:func:`iterative_work`):

   - ``"dense"``: forming the Gram matrix (if it is not formed), then
     ``4/3·R³``;
   - ``"iterative"``: forming the Gram matrix (if it is not formed), then per
     block ``b`` Gram products (``R²`` each, the block a pass over the Gram
     matrix), ``b = max(2·k, k + 8)``;
   - ``"matrix_free"``: per block ``V``-products with ``b = k`` columns, as the
     factors compute them (:meth:`ParamFactors.product_work
     <vivit.gram.ParamFactors.product_work>`: ``2·K·N·(C·out + out·in)`` for a
     Linear weight in factor form, ``2·K·R·numel`` for explicit columns),
     and per block two passes over the factors' entries
     (:func:`v_product_passes`): a product with ``b = k`` vectors is bound by
     reading the factors.

   Forming the Gram matrix costs what its factors' contractions do
   (:meth:`ParamFactors.gram_work <vivit.gram.ParamFactors.gram_work>`) plus
   :data:`GRAM_PASSES` passes over an ``R × R`` matrix per parameter. Where
   such a matrix does not fit into :data:`CACHE_BYTES`, a pass over one entry
   costs :data:`PASS_WORK` multiply-adds, else nothing. The iterative solver
   must be expected to do :data:`ITERATIVE_ADVANTAGE` times less work than the
   dense one to be chosen over it (both after forming the Gram matrix, which
   both need); ``"dense"`` whose workspace does not fit yields to the iterative
   solver that does.

The constants are measured on a 2-core CPU (``benchmarks/solver_costs.py``, CPU
time, one thread, float32, exact top-10 of an MLP 784-128-64-10 at ``N`` = 128 to
1024 and of the 3c3d CNN at ``N`` = 16 to 64; ``benchmarks/README.md``): at
``N = 512`` the matrix-free solver is the fastest (no Gram matrix of 100 MB to
form and to pass over), at ``N ≤ 256`` (a Gram matrix in the cache) the iterative
one, and on the CNN, whose convolutions make every ``V``-product cost a
backward pass, the dense or the iterative one. Before the backward pass,
:func:`vivit.memory.estimate_memory` passes factors of the request's shapes on
the meta device (no entries), so its ``"auto"`` is the request's.

An iterative solve that does not converge raises
:class:`~vivit.errors.SolverNotConvergedError` when it was asked for explicitly;
under ``"auto"`` it falls back to the dense solver with a warning (and the
:class:`~vivit.linalg.iterative.SolverReport` says why).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vivit.errors import InvalidArgumentError, SolverNotConvergedError
from vivit.gram import ParamFactors
from vivit.gram.memory import (
    PARTIAL_FRACTION,
    available_bytes,
    dense_workspace_bytes,
    itemsize,
)
from vivit.linalg.iterative import (
    SolverReport,
    basis_capacity,
    block_krylov_eigh,
    default_block_size,
    minimum_capacity,
    restart_size,
)
from vivit.linalg.solvers import check_top_k, gram_eigh_top

#: The accepted values of ``solver``.
SOLVERS = ("auto", "dense", "iterative", "matrix_free", "implicit")
#: Blocks the cost model expects an iterative solve to multiply: measured 6–17
#: (``b = k`` and ``b = 2·k``, top-10 and top-1 on the benchmarks' MLPs and CNN).
EXPECTED_BLOCKS = 15
#: Block size of the implicit route's products (at most ``top_k``): thinner
#: blocks reach the leading eigenpairs in fewer products (a higher Krylov degree
#: per product), a vmapped product of ``b`` vectors costs a fixed overhead plus
#: ``b`` times a vector's work. Top-10 in float32, one thread (CPU seconds of the
#: solve, products): ``gpt2-2l-64-v128`` N = 4 b = 10: 0.94 s, 100; b = 3: 0.75 s,
#: 61; ``gpt2-4l-128-v500`` N = 8: 17.8 s, 110; 10.4 s, 67; char-LSTM N = 32:
#: 0.76 s, 110; 0.53 s, 61 (``benchmarks/README.md``, "Narrow blocks").
IMPLICIT_BLOCK = 3
#: Extra columns of the block of Gram products beyond ``top_k``
#: (:func:`solver_block_size`).
GRAM_OVERSAMPLING = 8
#: The iterative solver is chosen over the dense one if it is expected to do this
#: many times less work.
ITERATIVE_ADVANTAGE = 2.0
#: Multiply-adds that one pass over an entry of an ``R × R`` matrix costs where the
#: matrix is larger than the cache: a product of the Gram matrix with a block of
#: ``b = 20`` columns runs at memory speed (measured 20–30 on the 2-core CPU).
PASS_WORK = 25
#: Passes over ``R × R`` matrices per parameter while a Gram matrix is formed (the
#: parameter's block, its lower triangle mirrored, the sum of the group; measured
#: 6–7 at ``R`` = 5120 and 10240).
GRAM_PASSES = 6
#: Matrices of at most this many bytes are taken to stay in the cache.
CACHE_BYTES = 32 * 2**20
#: Bytes per entry of the iterative solvers' Krylov blocks (float64).
_KRYLOV_ITEMSIZE = 8


def check_solver(solver: str, top_k: int | None = 1) -> None:
    """Check that ``solver`` is one of :data:`SOLVERS` and fits the request.

    Args:
        solver: The solver name.
        top_k: Number of leading eigenpairs requested (``None``: all).

    Raises:
        ValueError: If it is not a solver, if ``top_k`` is invalid, or if an
            iterative solver is asked for all eigenpairs.
    """
    if not isinstance(solver, str) or solver not in SOLVERS:
        raise InvalidArgumentError(f"solver must be one of {SOLVERS}, got {solver!r}.")
    check_top_k(top_k)
    if top_k is None and solver in ("iterative", "matrix_free", "implicit"):
        raise InvalidArgumentError(
            f"solver={solver!r} computes a few leading eigenpairs: pass top_k "
            "(e.g. top_k=10), or use solver='dense' for all of them."
        )


def solver_block_size(solver: str, top_k: int, size: int) -> int:
    """Block size ``b`` of an iterative solver (at most ``R``).

    ``"implicit"``: ``b = min(k,`` :data:`IMPLICIT_BLOCK` ``)``, certified by
    :func:`~vivit.linalg.iterative.narrow_block_doubt` (a cluster that could hide
    a copy of a multiple eigenvalue is solved again with ``b = k``).
    ``"matrix_free"``: ``b = k`` (:func:`~vivit.linalg.iterative.
    default_block_size`). ``"iterative"``:
    ``b = max(2·k, k + GRAM_OVERSAMPLING)``: a product with a Gram matrix larger
    than the cache costs a pass over it, so wider blocks (fewer passes) win
    although they need more products.

    Args:
        solver: ``"iterative"``, ``"matrix_free"`` or ``"implicit"``.
        top_k: Number of leading eigenpairs.
        size: Side length ``R`` of the Gram matrix (``D`` for ``"implicit"``).

    Returns:
        ``b``.
    """
    if solver == "implicit":
        return min(size, top_k, IMPLICIT_BLOCK)
    if solver == "matrix_free":
        return default_block_size(top_k, size)
    return min(size, max(2 * top_k, top_k + GRAM_OVERSAMPLING))


def iterative_workspace_bytes(
    size: int,
    top_k: int,
    dtype: torch.dtype,
    params: int | None = None,
    columns: int | None = None,
    solver: str | None = None,
) -> int:
    """Memory of the iterative solvers besides the Gram matrix.

    Args:
        size: Side length ``R`` of the Gram matrix.
        top_k: Number of leading eigenpairs.
        dtype: Data type of the products.
        params: ``D`` for the matrix-free solver (a block of ``D``-vectors
            between the two ``V``-products and the contraction's copy of it,
            measured); ``None`` for products with the Gram.
        columns: Columns ``m`` of the basis (``None``: its default,
            :func:`~vivit.linalg.iterative.basis_capacity`; a basis cut by
            memory: :func:`fitting_basis_columns`).
        solver: ``"iterative"``, ``"matrix_free"`` or ``"implicit"`` (``None``:
            ``"iterative"`` without ``params``, else ``"matrix_free"``); its
            block size :func:`solver_block_size`.

    Returns:
        Bytes: the float64 basis and its image in the products' type (``m``
        columns each), their projection (``m × m``), the Ritz vectors a restart
        keeps and their images (:func:`~vivit.linalg.iterative.restart_size`
        each), a block with its image and the next (``max(b, k)`` each, in
        float64: a confirmation multiplies the ``k`` Ritz vectors at once) and
        two blocks in the products' dtype.
    """
    if solver is None:
        solver = "iterative" if params is None else "matrix_free"
    width = solver_block_size(solver, top_k, size)
    wide = max(width, min(top_k, size))
    if columns is None:
        columns = basis_capacity(width, size, top_k=top_k)
    kept = restart_size(top_k, width, columns)
    workspace = ((columns + 2 * kept + 3 * wide) * size + columns**2) * (
        _KRYLOV_ITEMSIZE
    )
    workspace += columns * size * max(itemsize(dtype), 4)  # the images
    workspace += 2 * wide * size * itemsize(dtype)
    if params is not None:
        workspace += 2 * wide * params * itemsize(dtype)
    return workspace


def fitting_basis_columns(
    size: int,
    top_k: int,
    dtype: torch.dtype,
    budget_bytes: float,
    params: int | None = None,
    solver: str | None = None,
) -> int:
    """Columns ``m`` of the Krylov basis that the memory allows.

    ``m = min(m_default, the most columns whose workspace fits the budget)``,
    never below :func:`~vivit.linalg.iterative.minimum_capacity` (``k + 2·b``;
    the caller refuses where even that does not fit). A cut basis restarts more
    often; the iteration converges by its thick restart all the same
    (``docs/math.rst``, "The Gram matrix and exact eigenpairs", "A basis cut by
    memory").

    Args:
        size: Side length of the operator (``D`` on the implicit route).
        top_k: Number of leading eigenpairs.
        dtype: Data type of the products.
        budget_bytes: Memory the solver's workspace may take (what is available
            less the products' own memory).
        params: As for :func:`iterative_workspace_bytes`.
        solver: As for :func:`iterative_workspace_bytes`.

    Returns:
        ``m``, for :func:`iterative_workspace_bytes` and the solver's
        ``max_columns``.
    """
    if solver is None:
        solver = "iterative" if params is None else "matrix_free"
    width = solver_block_size(solver, top_k, size)
    top_k = min(top_k, size)
    low = minimum_capacity(top_k, width, size)  # returned where nothing fits
    high = max(low, basis_capacity(width, size, top_k=top_k))
    while low < high:  # the workspace grows with m: the largest m that fits
        middle = (low + high + 1) // 2
        workspace = iterative_workspace_bytes(
            size, top_k, dtype, params, middle, solver
        )
        if workspace <= budget_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def dense_work(size: int) -> float:
    """Multiply-adds of the dense solver, ``4/3·R³``.

    Args:
        size: Side length ``R`` of the Gram matrix.

    Returns:
        The work.
    """
    return 4 / 3 * size**3


def iterative_work(size: int, width: int, product: float, passes: float = 0.0) -> float:
    """Expected multiply-adds of an iterative solve.

    Args:
        size: Side length ``R`` of the Gram matrix.
        width: Block size ``b`` (:func:`solver_block_size`).
        product: Multiply-adds of one operator-vector product.
        passes: Multiply-adds of the memory passes of one operator-block product
            (the Gram matrix read once, or the factors twice:
            :func:`v_product_passes`).

    Returns:
        ``q · (b · product + passes) + 2·m²·R`` for :data:`EXPECTED_BLOCKS` blocks
        ``q`` and ``m = q·b`` basis columns (orthogonalization).
    """
    columns = min(size, EXPECTED_BLOCKS * width)
    return EXPECTED_BLOCKS * (width * product + passes) + 2 * columns**2 * size


def pass_work(size: int, dtype: torch.dtype) -> float:
    """Multiply-adds of one pass over an ``R × R`` matrix (:data:`PASS_WORK`).

    Args:
        size: ``R``.
        dtype: Data type of the matrix.

    Returns:
        ``PASS_WORK · R²`` where the matrix exceeds :data:`CACHE_BYTES`, else ``0``.
    """
    return _memory_pass_work(size**2, dtype)


def _memory_pass_work(entries: int, dtype: torch.dtype) -> float:
    """``PASS_WORK`` per entry of a tensor larger than :data:`CACHE_BYTES`, else 0."""
    if entries * itemsize(dtype) <= CACHE_BYTES:
        return 0.0
    return PASS_WORK * entries


def gram_work(factors: Sequence[ParamFactors], dtype: torch.dtype) -> float:
    """Expected multiply-adds of forming a group's Gram matrix.

    Args:
        factors: The group's factors of ``V``.
        dtype: Data type of the Gram matrix.

    Returns:
        The factors' contractions plus :data:`GRAM_PASSES` passes per parameter.
    """
    size = factors[0].num_rows
    passes = GRAM_PASSES * len(factors) * pass_work(size, dtype)
    return passes + sum(f.gram_work() for f in factors)


def v_product_work(factors: Sequence[ParamFactors], width: int) -> float:
    """Multiply-adds per Gram-space vector of ``Vᵀ(V U)`` through the factors.

    Args:
        factors: The group's factors of ``V``.
        width: Block size ``b`` of the products.

    Returns:
        The products' work with a block of ``b`` vectors, divided by ``b``.
    """
    return sum(f.product_work(width) for f in factors) / width


def factor_entries(factors: Sequence[ParamFactors]) -> int:
    """Entries of the tensors that hold a group's factors (both products read them)."""
    return sum(tensor.numel() for f in factors for tensor in f.tensors())


def v_product_passes(entries: int, dtype: torch.dtype) -> float:
    """Multiply-adds of the memory passes of one block of ``V``-products.

    Both products (``V U`` and ``Vᵀ W``) read every entry of the factors; with a
    block of ``b = k`` vectors they run at memory speed, not at the speed their
    multiply-adds alone suggest (a language model's per-token Monte-Carlo
    factors: 11 GMAC/s for the contractions counted by
    :meth:`~vivit.gram.ParamFactors.product_work`, against 75 for forming the
    Gram matrix).

    Args:
        entries: Entries of the factors (``R·D`` for explicit columns).
        dtype: Their data type.

    Returns:
        ``2 · PASS_WORK · entries`` where the factors exceed :data:`CACHE_BYTES`,
        else ``0``.
    """
    return 2.0 * _memory_pass_work(entries, dtype)


@dataclasses.dataclass(frozen=True)
class SolverWork:
    """Expected multiply-adds of each top-``k`` solver (the module docstring).

    Attributes:
        formation: Forming the Gram matrix (``0`` without factors).
        dense: The dense solve of the formed Gram matrix.
        iterative: The iterative solve on the formed Gram matrix.
        matrix_free: The iterative solve on ``V``-products, passes included.
    """

    formation: float
    dense: float
    iterative: float
    matrix_free: float


def solver_work(
    size: int,
    top_k: int,
    *,
    num_params: int,
    dtype: torch.dtype,
    factors: Sequence[ParamFactors] | None = None,
) -> SolverWork:
    """The work :func:`choose_solver` compares.

    Args:
        size: Side length ``R = N·C`` of the Gram matrix.
        top_k: Number of leading eigenpairs.
        num_params: Parameters ``D`` of the group.
        dtype: Data type of the Gram matrix.
        factors: As for :func:`choose_solver`.

    Returns:
        Each solver's expected multiply-adds.
    """
    gram_width = solver_block_size("iterative", top_k, size)
    width = solver_block_size("matrix_free", top_k, size)
    if factors is None:
        formation, product = 0.0, 2.0 * size * num_params
        entries = size * num_params
    else:
        formation = gram_work(factors, dtype)
        product = v_product_work(factors, width)
        entries = factor_entries(factors)
    passes = v_product_passes(entries, dtype)
    return SolverWork(
        formation=formation,
        dense=dense_work(size),
        iterative=iterative_work(size, gram_width, size**2, pass_work(size, dtype)),
        matrix_free=iterative_work(size, width, product, passes),
    )


def choose_solver(
    size: int,
    top_k: int | None,
    *,
    num_params: int,
    dtype: torch.dtype,
    device: torch.device,
    gram_formed: bool = False,
    num_grams: int = 1,
    factors: Sequence[ParamFactors] | None = None,
) -> str:
    """The solver ``"auto"`` uses (see the module docstring for the rules).

    Args:
        size: Side length ``R = N·C`` of the Gram matrix.
        top_k: Number of leading eigenpairs (``None``: all).
        num_params: Parameters ``D`` of the group.
        dtype: Data type of the Gram matrix.
        device: Its device.
        gram_formed: Whether the Gram matrix exists already.
        num_grams: Gram matrices held at once if it is formed.
        factors: The group's factors of ``V``, for the work of forming the Gram
            matrix and of ``V``-products (only their shapes are used: they may be
            on the meta device; ``None``: not counted, and ``V``-products costed
            as explicit columns, ``2·R·D``).

    Returns:
        ``"dense"``, ``"iterative"`` or ``"matrix_free"``.
    """
    if top_k is None or top_k > PARTIAL_FRACTION * size:
        return "dense"
    available = available_bytes(device)
    grams = (0 if gram_formed else num_grams) * size**2 * itemsize(dtype)
    iterative_bytes = grams + iterative_workspace_bytes(size, top_k, dtype)
    if not gram_formed and iterative_bytes > available:
        return "matrix_free"
    work = solver_work(size, top_k, num_params=num_params, dtype=dtype, factors=factors)
    formation = 0.0 if gram_formed else work.formation
    if not gram_formed and work.matrix_free < formation + min(
        work.iterative, work.dense
    ):
        return "matrix_free"
    # both of these form the Gram matrix: compare the solves alone
    dense_fits = grams + dense_workspace_bytes(size, top_k, dtype, device) <= available
    if ITERATIVE_ADVANTAGE * work.iterative <= work.dense or not dense_fits:
        return "iterative"
    return "dense"


def leading_eigenpairs(
    products: Callable[[Tensor], Tensor],
    top_k: int,
    solver: str,
    gram: Callable[[], Tensor],
    *,
    size: int,
    requested: str,
    dtype: torch.dtype,
    device: torch.device,
    tol: float | None = None,
    seed: int = 0,
    max_columns: int | None = None,
) -> tuple[Tensor, Tensor, SolverReport]:
    """The ``top_k`` leading eigenpairs of a group's Gram matrix.

    Args:
        products: ``U ↦ G̃ U`` without the Gram matrix (``[N·C, K]`` columns),
            for the matrix-free solver.
        top_k: Number of leading eigenpairs.
        solver: ``"dense"``, ``"iterative"``, ``"matrix_free"`` or
            ``"implicit"`` (``products`` are then ``G V`` in parameter space).
        gram: Returns the Gram matrix, forming it if needed (not called by the
            matrix-free and implicit solvers).
        size: Side length ``N·C`` of the Gram matrix (``D`` for ``"implicit"``).
        requested: The solver the caller asked for; under ``"auto"`` an iterative
            solve that does not converge falls back to ``"dense"``.
        dtype: Data type of the factors' products.
        device: Their device.
        tol: Relative residual bound of the iterative solvers (default:
            :func:`~vivit.linalg.iterative.default_tolerance`).
        seed: Seed of their start block.
        max_columns: Most columns of their Krylov basis the memory allows
            (:func:`fitting_basis_columns`; ``None``: the default basis).

    Returns:
        Eigenvalues ``[k]`` ascending, Gram eigenvectors ``[N·C, k]`` as columns,
        and the report (with the residual for every solver).

    Raises:
        SolverNotConvergedError: If an explicitly requested iterative solver does
            not converge.
    """
    if solver == "dense":
        matrix = gram()
        evals, evecs = gram_eigh_top(matrix, top_k)
        report = SolverReport(
            solver="dense",
            requested=requested,
            residual=relative_residual(matrix @ evecs, evals, evecs),
            tolerance=None,
            converged=True,
        )
        return evals, evecs, report
    matmul = gram().__matmul__ if solver == "iterative" else products
    try:
        evals, evecs, report = block_krylov_eigh(
            matmul,
            size,
            top_k,
            dtype=dtype,
            device=device,
            tol=tol,
            seed=seed,
            block_size=solver_block_size(solver, top_k, size),
            max_columns=max_columns,
            # under "auto" the Gram routes fall back to the exact dense solver
            rounding_floor=requested != "auto" or solver == "implicit",
        )
    except SolverNotConvergedError as error:
        if requested != "auto":
            raise
        warnings.warn(
            f"{error} Falling back to the dense solver.", RuntimeWarning, stacklevel=3
        )
        evals, evecs, report = leading_eigenpairs(
            products,
            top_k,
            "dense",
            gram,
            size=size,
            requested=requested,
            dtype=dtype,
            device=device,
        )
        return evals, evecs, dataclasses.replace(report, fallback=str(error))
    return evals, evecs, dataclasses.replace(report, solver=solver, requested=requested)


def relative_residual(images: Tensor, evals: Tensor, evecs: Tensor) -> float:
    """``max_k ‖G̃ ũ_k − λ_k ũ_k‖ / λ_max`` (``0`` for a zero matrix).

    Args:
        images: ``G̃ U``, ``[N·C, K]``.
        evals: ``[K]``.
        evecs: ``U``, ``[N·C, K]``.

    Returns:
        The largest relative residual.
    """
    if evals.numel() == 0:
        return 0.0
    scale = evals.abs().max().item()
    residual = (images - evecs * evals).norm(dim=0).max().item()
    return residual / scale if scale > 0 else residual
