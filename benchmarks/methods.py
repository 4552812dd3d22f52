"""The benchmarked methods: a registry of name -> :class:`Method`.

Every method is a function ``(model, loss_func, X, y) -> eigenvalues | None`` that
does all the work (building any curvature object included); a method that counts
the operator products it needs returns an :class:`Outcome` instead. It runs in a
worker process of the Python environment it names:

- ``"main"``: the interpreter running the benchmark, with this repository's
  ``vivit`` first on the path;
- ``"peers"``: the side environment of :mod:`peers` (ViViT 1.0.0, which also
  imports as ``vivit``, and curvlinops), created by the harness.

Imports happen inside the functions, so a worker imports only what its method needs
(in the ``peers`` environment ``import vivit`` is ViViT 1.0).

To add a method, add an entry to :data:`METHODS`. Variants of this library are one
line each through :func:`vivit_method`, e.g. a solver choice::

    METHODS["vivit-lanczos"] = vivit_method("exact top-10, Lanczos", solver="...")

whose keyword arguments go to ``LowRankGGN`` (``eigh_kwargs`` to ``eigh``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

TOP_K = 10
#: Power iteration stops when the Rayleigh quotient changes less than this (relative).
POWER_RTOL = 1e-4
POWER_MAX_ITERATIONS = 500


@dataclass(frozen=True)
class Outcome:
    """Eigenvalues and the operator products that computed them.

    Attributes:
        evals: The eigenvalues (``None`` for the baseline).
        products: Vectors the operator was multiplied onto (a block of ``b``
            vectors counts ``b``); ``None`` where the method has no such products
            (a dense decomposition).
        operator: What a product multiplies by: ``"GGN"`` (a GGN-vector product
            in parameter space), ``"Gram"`` (the ``N·C × N·C`` Gram matrix) or
            ``"V"`` (``V`` and ``Vᵀ``, the Gram matrix's factors).
    """

    evals: Tensor | None
    products: int | None = None
    operator: str | None = None


Run = Callable[..., Tensor | Outcome | None]


def as_outcome(result: Tensor | Outcome | None) -> Outcome:
    """A method's return value as an :class:`Outcome` (eigenvalues alone: no count)."""
    return result if isinstance(result, Outcome) else Outcome(result)


@dataclass(frozen=True)
class Method:
    """A benchmarked method.

    Attributes:
        run: ``(model, loss_func, X, y) -> eigenvalues | Outcome | None``, with
            the keyword ``tol`` if ``takes_tol``.
        description: One line for the table's legend.
        env: ``"main"`` or ``"peers"`` (see the module docstring).
        exact: Whether it computes the exact GGN's leading eigenvalues (those are
            compared across methods; MC, subsampled and per-layer results are not).
        baseline: Whether it is the forward+backward baseline ratios divide by.
        takes_tol: Whether ``run`` takes ``tol``, a peer's stopping tolerance that
            the harness sets to this library's default (``eigenpairs.py``'s
            ``--peer-tol``).
    """

    run: Run
    description: str
    env: str = "main"
    exact: bool = True
    baseline: bool = False
    takes_tol: bool = False
    options: dict[str, Any] = field(default_factory=dict)


# this library ---------------------------------------------------------------------


def forward_backward(
    model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor
) -> None:
    """A plain forward and backward pass (the baseline)."""
    loss_func(model(X), y).backward()


def vivit_method(
    description: str,
    *,
    exact: bool = True,
    per_layer: bool = False,
    subsample_half: bool = False,
    directional: bool = False,
    eigh_kwargs: dict[str, Any] | None = None,
    **ggn_kwargs: Any,
) -> Method:
    """A :class:`vivit.LowRankGGN` variant: top-10 eigenpairs, construction included.

    Args:
        description: One line for the legend.
        exact: Whether the result is the exact GGN's spectrum (compared).
        per_layer: One parameter group per layer (top-10 of each block; the
            returned eigenvalues are those of the last group).
        subsample_half: Curvature of the first half of the mini-batch only.
        directional: Per-sample ``γ`` and ``λ`` along the top-10 eigenvectors
            (``directional_derivatives``, the eigenpairs included) instead of
            the eigenpairs alone.
        eigh_kwargs: Extra keyword arguments of ``LowRankGGN.eigh``.
        **ggn_kwargs: Keyword arguments of ``LowRankGGN`` (``mc_samples``, and
            ``solver`` where the library has it).

    Returns:
        The method.
    """
    eigh_kwargs = eigh_kwargs or {}

    def run(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor) -> Outcome:
        from vivit import LowRankGGN

        kwargs = dict(ggn_kwargs)
        if per_layer:
            kwargs["param_groups"] = [
                list(m.parameters(recurse=False))
                for m in model.modules()
                if list(m.parameters(recurse=False))
            ]
        if subsample_half:
            kwargs["subsampling"] = list(range(max(1, X.shape[0] // 2)))
        ggn = LowRankGGN(model, loss_func, (X, y), **kwargs)
        groups = len(ggn.param_groups)
        evals = None
        for group in range(groups):
            if directional:
                result = ggn.directional_derivatives(top_k=TOP_K, group=group)
                evals = result.evals
            else:
                evals, _ = ggn.eigh(top_k=TOP_K, group=group, **eigh_kwargs)
        return Outcome(evals, *counted_products(ggn))

    options = {
        **ggn_kwargs,
        "per_layer": per_layer,
        "subsample_half": subsample_half,
        "directional": directional,
    }
    return Method(run, description, exact=exact, options=options)


#: What a product of each of this library's iterative solvers multiplies by.
SOLVER_OPERATORS = {"ggn_krylov": "GGN", "gram_krylov": "Gram", "factor_krylov": "V"}


def counted_products(ggn: Any) -> tuple[int | None, str | None]:
    """Products of the latest solve of every group of ``ggn``, and their operator.

    From ``ggn.solver_report(group).products``. ``(None, None)`` unless every
    group's pairs came from the same iterative solver: a dense decomposition has no
    products (nor has the dense fallback of ``solver="auto"`` any left in its
    report), and products with different operators do not add up.
    """
    reports = [ggn.solver_report(group) for group in range(len(ggn.param_groups))]
    solvers = {None if report is None else report.solver for report in reports}
    solver = solvers.pop() if len(solvers) == 1 else None
    if solver not in SOLVER_OPERATORS:
        return None, None
    return sum(report.products for report in reports), SOLVER_OPERATORS[solver]


def power_iteration(
    model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor
) -> Outcome:
    """Leading GGN eigenvalue by power iteration on GGN-vector products.

    ``G v = Jᵀ (H (J v))`` with ``torch.func``: a forward-mode ``jvp`` through the
    model, the loss Hessian on the outputs by forward-over-reverse, and one
    ``vjp``. Stops when the Rayleigh quotient changes by less than
    :data:`POWER_RTOL` (relative) or after :data:`POWER_MAX_ITERATIONS`.
    """
    from torch.func import functional_call, grad, jvp, vjp

    params = {k: p.detach() for k, p in model.named_parameters()}

    def f(p: dict[str, Tensor]) -> Tensor:
        return functional_call(model, p, (X,))

    output, pullback = vjp(f, params)
    output = output.detach()
    loss_grad = grad(lambda out: loss_func(out, y))

    def ggn_vector(v: dict[str, Tensor]) -> dict[str, Tensor]:
        _, jv = jvp(f, (params,), (v,))
        _, hjv = jvp(loss_grad, (output,), (jv,))
        return pullback(hjv)[0]

    generator = torch.Generator(device=X.device).manual_seed(0)
    v = {
        k: torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)
        for k, p in params.items()
    }
    estimate, products = torch.tensor(0.0), 0
    for _ in range(POWER_MAX_ITERATIONS):
        norm = torch.sqrt(sum((t**2).sum() for t in v.values()))
        v = {k: t / norm for k, t in v.items()}
        gv = ggn_vector(v)
        products += 1
        previous, estimate = estimate, sum((gv[k] * v[k]).sum() for k in v)
        if abs(estimate - previous) <= POWER_RTOL * abs(estimate):
            break
        v = gv
    return Outcome(estimate.reshape(1), products, "GGN")


# peers (side environment) ---------------------------------------------------------


def vivit_1(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    """ViViT 1.0.0's ``EighComputation``, top-10 eigenpairs of the exact GGN."""
    import peers
    from backpack import backpack, extend

    from vivit.linalg.eigh import EighComputation

    peers.apply_symeig_shim()
    extend(model)  # idempotent
    extend(loss_func)
    computation = EighComputation()
    group = {
        "params": [p for p in model.parameters() if p.requires_grad],
        "criterion": lambda evals: list(
            range(max(0, evals.numel() - TOP_K), evals.numel())
        ),
    }
    loss = loss_func(model(X), y)
    with backpack(
        computation.get_extension(),
        extension_hook=computation.get_extension_hook([group]),
    ):
        loss.backward()
    evals, _ = computation.get_result(group)
    return evals


def counting_operator(operator: Any) -> Any:
    """``operator`` (a scipy ``LinearOperator``) with a count of its products.

    The count, attribute ``products``, adds 1 per ``matvec`` and the number of
    columns per ``matmat``.
    """
    from scipy.sparse.linalg import LinearOperator

    class Counting(LinearOperator):
        def __init__(self) -> None:
            super().__init__(operator.dtype, operator.shape)
            self.products = 0

        def _matvec(self, x: Any) -> Any:
            self.products += 1
            return operator.matvec(x)

        def _matmat(self, X: Any) -> Any:
            self.products += X.shape[1]
            return operator.matmat(X)

    return Counting()


def curvlinops_eigsh(
    model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor, *, tol: float
) -> Outcome:
    """curvlinops' ``GGNLinearOperator`` and ``scipy.sparse.linalg.eigsh`` (top-10).

    Lanczos (ARPACK), largest algebraic eigenvalues, stopped at ``tol``: the harness
    passes this library's default tolerance for the parameters' data type
    (``vivit.linalg.iterative.default_tolerance``), or ``0`` (eigsh's default,
    machine precision) with ``--peer-tol zero``. The same number, not the same
    guarantee: ARPACK accepts a Ritz pair at ``‖r‖ ≤ tol·|θ_i|``, relative to its
    own Ritz value, this library at ``‖r‖ ≤ tol·θ_max``, so ARPACK's criterion is
    the stricter one for the smaller eigenvalues of the ten.
    """
    from curvlinops import GGNLinearOperator
    from scipy.sparse.linalg import eigsh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    params = [p for p in model.parameters() if p.requires_grad]
    # curvlinops' products use forward-mode AD: the kernels that have its rules,
    # as vivit.engines.func.implicit.forward_mode_kernels chooses them (this
    # environment's ``vivit`` is ViViT 1.0, which has no such function)
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    onednn = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.set_flags(False, None, None, None)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            operator = counting_operator(
                GGNLinearOperator(
                    model, loss_func, params, [(X, y)], check_deterministic=False
                ).to_scipy()
            )
            evals = eigsh(
                operator, k=TOP_K, which="LA", tol=tol, return_eigenvectors=False
            )
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        torch.backends.mkldnn.set_flags(onednn, None, None, None)
    return Outcome(torch.from_numpy(evals.copy()), operator.products, "GGN")


#: Benchmarked methods: name -> :class:`Method`. Order = column order of the output.
METHODS: dict[str, Method] = {
    "forward+backward": Method(
        forward_backward, "loss(model(X), y).backward()", exact=False, baseline=True
    ),
    "vivit": vivit_method("this library, exact GGN, top-10 eigenpairs (solver auto)"),
    "vivit-dense": vivit_method(
        "this library, exact GGN, top-10, dense LAPACK solver", solver="dense"
    ),
    "vivit-iterative": vivit_method(
        "this library, exact GGN, top-10, block Krylov on the Gram matrix",
        solver="gram_krylov",
    ),
    "vivit-matrix-free": vivit_method(
        "this library, exact GGN, top-10, block Krylov on V-products (no Gram)",
        solver="factor_krylov",
    ),
    "vivit-implicit": vivit_method(
        "this library, exact GGN, top-10, implicit GGN-vector products (no V)",
        route="implicit",
    ),
    "vivit-gamma-lambda": vivit_method(
        "this library, exact GGN, γ and λ of every sample along the top-10 "
        "eigenvectors (solver auto)",
        directional=True,
    ),
    "vivit-implicit-gamma-lambda": vivit_method(
        "this library, exact GGN, γ and λ along the top-10, implicit route",
        directional=True,
        route="implicit",
    ),
    "vivit-mc1-gamma-lambda": vivit_method(
        "this library, Monte-Carlo GGN (1 sample), γ and λ along the top-10",
        exact=False,
        directional=True,
        mc_samples=1,
    ),
    "vivit-chunk32": vivit_method(
        "this library, exact GGN, top-10, backward pass in chunks of 32 samples",
        chunk_size=32,
    ),
    "vivit-func": vivit_method(
        "this library, exact GGN, top-10, func engine (no BackPACK)", engine="func"
    ),
    "vivit-mc1": vivit_method(
        "this library, Monte-Carlo GGN (1 sample), top-10", exact=False, mc_samples=1
    ),
    "vivit-sub": vivit_method(
        "this library, exact GGN of the first N/2 samples, top-10",
        exact=False,
        subsample_half=True,
    ),
    "vivit-layers": vivit_method(
        "this library, exact GGN, one block per layer, top-10 of each",
        exact=False,
        per_layer=True,
    ),
    "power-iteration": Method(
        power_iteration,
        "power iteration on torch.func GGN-vector products, leading eigenvalue only",
    ),
    "vivit-1.0": Method(
        vivit_1, "ViViT 1.0.0 EighComputation (symeig shim), top-10", env="peers"
    ),
    "curvlinops-eigsh": Method(
        curvlinops_eigsh,
        "curvlinops GGNLinearOperator + scipy eigsh (Lanczos), top-10, at this "
        "library's default tolerance (--peer-tol)",
        env="peers",
        takes_tol=True,
    ),
}
BASELINE = "forward+backward"
