"""The benchmarked methods: a registry of name -> :class:`Method`.

Every method is a function ``(model, loss_func, X, y) -> eigenvalues | None`` that
does all the work (building any curvature object included) and runs in a worker
process of the Python environment it names:

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

Run = Callable[[nn.Module, nn.Module, Tensor, Tensor], Tensor | None]


@dataclass(frozen=True)
class Method:
    """A benchmarked method.

    Attributes:
        run: ``(model, loss_func, X, y) -> eigenvalues | None``.
        description: One line for the table's legend.
        env: ``"main"`` or ``"peers"`` (see the module docstring).
        exact: Whether it computes the exact GGN's leading eigenvalues (those are
            compared across methods; MC, subsampled and per-layer results are not).
        baseline: Whether it is the forward+backward baseline ratios divide by.
    """

    run: Run
    description: str
    env: str = "main"
    exact: bool = True
    baseline: bool = False
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

    def run(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor) -> Tensor:
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
        return evals

    options = {
        **ggn_kwargs,
        "per_layer": per_layer,
        "subsample_half": subsample_half,
        "directional": directional,
    }
    return Method(run, description, exact=exact, options=options)


def power_iteration(
    model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor
) -> Tensor:
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
    estimate = torch.tensor(0.0)
    for _ in range(POWER_MAX_ITERATIONS):
        norm = torch.sqrt(sum((t**2).sum() for t in v.values()))
        v = {k: t / norm for k, t in v.items()}
        gv = ggn_vector(v)
        previous, estimate = estimate, sum((gv[k] * v[k]).sum() for k in v)
        if abs(estimate - previous) <= POWER_RTOL * abs(estimate):
            break
        v = gv
    return estimate.reshape(1)


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


def curvlinops_eigsh(
    model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor
) -> Tensor:
    """curvlinops' ``GGNLinearOperator`` and ``scipy.sparse.linalg.eigsh`` (top-10).

    Lanczos (ARPACK) with its default tolerance (machine precision), largest
    algebraic eigenvalues.
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
            operator = GGNLinearOperator(
                model, loss_func, params, [(X, y)], check_deterministic=False
            ).to_scipy()
            evals = eigsh(operator, k=TOP_K, which="LA", return_eigenvectors=False)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        torch.backends.mkldnn.set_flags(onednn, None, None, None)
    return torch.from_numpy(evals.copy())


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
        "curvlinops GGNLinearOperator + scipy eigsh (Lanczos), top-10",
        env="peers",
    ),
}
BASELINE = "forward+backward"
