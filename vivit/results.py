"""Every result of the GGN's low-rank structure, written once over a source.

:class:`CurvatureResults` answers what a user asks — the Gram matrix, its
eigenvalues, the leading eigenpairs, directional derivatives, damped Newton
steps, the GGN as an operator, solver reports — for any curvature source
(:mod:`vivit.sources.base`): stored factors (:class:`~vivit.LowRankGGN`) or
factors recomputed in passes over a loader (:class:`~vivit.StreamingGGN`). It
picks the eigensolver (the cost model of :mod:`vivit.linalg.top_k`, or the
source's only route), caches what it computed, and maps Gram-space results to
parameter space (``docs/math.rst``, "The Gram matrix and exact eigenpairs",
"Directional derivatives and curvature noise", "Damped Newton step").
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from vivit._validation import (
    check_damping,
    check_lr,
    check_max_decrease,
    check_subsampling,
)
from vivit.directional.gram_space import (
    Damping,
    batch_directional_gradient,
    damped_step_sizes,
    directional_curvatures,
    newton_coefficients_damped,
)
from vivit.directional.results import DirectionalDerivatives, NewtonStep
from vivit.errors import FewerEigenpairsWarning, InvalidArgumentError
from vivit.gram.memory import dense_workspace_bytes, itemsize
from vivit.linalg.iterative import SolverReport, check_seed, check_tolerance
from vivit.linalg.operator import GGNOperator, GramSpaceProducts
from vivit.linalg.solvers import (
    direction_coefficients,
    gram_eigh,
    numerical_zero_tolerance,
    residual_zero_tolerance,
    top_k_indices,
)
from vivit.linalg.top_k import (
    check_solver,
    iterative_workspace_bytes,
    leading_eigenpairs,
    relative_residual,
)
from vivit.memory.costs import choose_solver
from vivit.options import CurvatureOptions
from vivit.sources.base import CurvatureSource, GroupSource
from vivit.sources.collector import in_param_dtypes


class CurvatureResults:
    """The results of a curvature source; the base of the front doors.

    Args:
        source: Where the curvature comes from.
        options: The checked options (the default solver, its tolerance and
            seed).

    Attributes:
        loss: The loss on all samples (detached).
        param_groups: The parameter groups, as lists of parameters.
        engine: Name of the engine that ran (``"backpack"`` or ``"func"``).
    """

    def __init__(self, source: CurvatureSource, options: CurvatureOptions):
        self._source = source
        self._options = options
        self.param_groups = source.param_groups
        self.loss = source.loss
        self.engine = source.engine
        self._decompositions: dict[int, tuple[Tensor, Tensor]] = {}
        self._leading: dict[tuple, tuple[Tensor, Tensor, SolverReport]] = {}
        # parameter-space sources: the numerical zero of each group's latest pairs
        self._residual_zeros: dict[int, float] = {}
        self._auto_solvers: dict[tuple, str] = {}
        self._directions_in_params: dict[tuple, list[Tensor]] = {}
        self._reports: dict[int, SolverReport] = {}
        self._full_reports: dict[tuple, SolverReport] = {}

    # Gram space ---------------------------------------------------------------
    def gram(self, group: int = 0) -> Tensor:
        """The Gram matrix ``Vᵀ V`` of a group (formed on the first call).

        Args:
            group: Index of the parameter group.

        Returns:
            ``[N·C, N·C]`` (``N·M`` with MC), rows and columns ordered sample-major:
            entry ``n·C + c`` is output ``c`` of sample ``n`` (of the subsampling).
            A copy: changing it changes no later result.

        Raises:
            GramTooLargeError: If it and its copy would not fit into memory.
        """
        source = self._source.group(group)
        square = source.num_rows**2 * itemsize(source.dtype)
        return source.form_gram(square).clone()

    def _gram_eigh(self, group: int) -> tuple[Tensor, Tensor]:
        source = self._source.group(group)
        if group not in self._decompositions:
            workspace = dense_workspace_bytes(
                source.num_rows, None, source.dtype, source.device
            )
            self._decompositions[group] = gram_eigh(source.form_gram(workspace))
        return self._decompositions[group]

    def eigvalsh(self, group: int = 0) -> Tensor:
        """All eigenvalues of the Gram matrix: the GGN's non-zero spectrum.

        Args:
            group: Index of the parameter group.

        Returns:
            ``[N·C]`` eigenvalues, ascending (those below the numerical-zero
            tolerance are zeros of the GGN); a copy, as every result.
        """
        return self._gram_eigh(group)[0].clone()

    def zero_tolerance(self, group: int = 0) -> float:
        """Eigenvalues at or below this value are numerically zero.

        ``N·C · ε_gram · λ_max + ε_model² · tr(G̃)``: follows ``gram_dtype``
        (``docs/math.rst``, "Precision and the numerical zero"). With
        ``route="implicit"`` (no Gram matrix) the residual bound of the
        group's latest leading pairs, ``(r + ρ)·λ_max`` ("Without the Gram
        matrix: the residual bound").

        Args:
            group: Index of the parameter group.

        Returns:
            The tolerance of the group's Gram matrix, or of its latest
            leading pairs.

        Raises:
            InvalidArgumentError: With ``route="implicit"``, before any
                request with ``top_k``.
        """
        source = self._source.group(group)
        if source.parameter_space:
            if group not in self._residual_zeros:
                raise InvalidArgumentError(
                    "route='implicit' forms neither V nor the Gram matrix: its "
                    "numerical zero is the residual bound of the leading pairs it "
                    "computed, and none were computed yet. Call eigh(top_k=...) "
                    "(or another request with top_k) first."
                )
            return self._residual_zeros[group]
        return numerical_zero_tolerance(
            self.eigvalsh(group), factor_dtype=self._source.group(group).factor_dtype
        )

    def solver_report(self, group: int = 0) -> SolverReport | None:
        """How the group's latest leading eigenpairs were computed.

        Args:
            group: Index of the parameter group.

        Returns:
            The solver used, its relative residual ``max_k ‖G̃ũ_k − λ_kũ_k‖ /
            λ_max`` and tolerance, iterations and any fallback; ``None`` before the
            first request with ``top_k`` (full decompositions are LAPACK's). A
            request with ``top_k`` answered from the full decomposition (one
            exists and the solver is ``"auto"``) reports ``"dense"``, with the
            residual of the pairs it returned.
        """
        self._source.group(group)
        return self._reports.get(group)

    def _directions(
        self,
        top_k: int | None,
        group: int,
        solver: str | None = None,
        tol: float | None = None,
        seed: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The ``top_k`` leading numerically non-zero eigenpairs of the Gram matrix.

        Uses leading pairs computed before by the same solver (``"auto"``: the
        one it chose first), tolerance and seed if they hold enough pairs; else
        the full decomposition if it is needed, or exists and the solver is
        ``"auto"``; else computes (and keeps) only the leading eigenpairs.
        """
        if solver is None:  # the default applies to requests for a few pairs
            solver = "auto" if top_k is None else self._options.solver
        check_solver(solver, top_k)
        check_tolerance(tol)
        if seed is not None:
            check_seed(seed)
        source = self._source.group(group)
        source.check_solver(solver)
        tol = self._options.solver_tol if tol is None else tol
        seed = self._options.solver_seed if seed is None else seed
        leading = self._kept_leading(group, top_k, solver, tol, seed)
        full = leading is None and (
            top_k is None or (solver == "auto" and group in self._decompositions)
        )
        if full:
            evals, evecs = self._gram_eigh(group)
            keep = self._gram_nonzero(source, evals, top_k)
        else:
            if leading is None:
                resolved = solver if solver != "auto" else _auto_solver(source, top_k)
                leading = self._compute_leading(
                    source, top_k, resolved, solver, tol, seed
                )
                self._leading[(group, resolved, tol, seed)] = leading
                if solver == "auto":
                    self._auto_solvers[(group, tol, seed)] = resolved
                # directions kept from the pairs replaced here would mix two
                # solves (their signs may differ)
                self._directions_in_params = {
                    k: v for k, v in self._directions_in_params.items() if k[0] != group
                }
            evals, evecs, report = leading
            # the report of the pairs returned, also where they were kept
            self._reports[group] = report
            if source.parameter_space:
                keep = self._resolved(source, evals, top_k, report)
            else:
                keep = self._gram_nonzero(source, evals, top_k)
        evals, evecs = evals[keep], evecs[:, keep]
        if full and top_k is not None:  # leading pairs of the full decomposition
            gram = source.formed_gram()
            key = (group, evals.numel(), solver)
            if key not in self._full_reports:  # one residual per request size
                self._full_reports[key] = SolverReport(
                    solver="dense",
                    requested=solver,
                    residual=relative_residual(gram @ evecs, evals, evecs),
                    tolerance=None,
                    converged=True,
                )
            self._reports[group] = self._full_reports[key]
        return evals, evecs

    def _gram_nonzero(
        self, source: GroupSource, evals: Tensor, top_k: int | None
    ) -> list[int]:
        """The ``top_k`` leading eigenvalues above the Gram matrix's numerical zero."""
        # without the Gram matrix, tr(G̃) is bounded by N·C·λ_max
        gram = source.formed_gram()
        trace = None if gram is None else gram.trace().item()
        keep = top_k_indices(evals, top_k, source.num_rows, source.factor_dtype, trace)
        if top_k is not None and len(keep) < top_k:
            warn_fewer_eigenpairs(top_k, len(keep), source.num_rows, self._options)
        return keep

    def _resolved(
        self, source: GroupSource, evals: Tensor, top_k: int, report: SolverReport
    ) -> list[int]:
        """The Ritz values of a parameter-space solve its residual bound resolves.

        No Gram matrix is decomposed, so its numerical zero does not apply: a
        Ritz value at or below the pairs' residual bound against the exact
        ``G`` may be a zero eigenvalue (``docs/math.rst``, "Without the Gram
        matrix: the residual bound").
        """
        zero = residual_zero_tolerance(evals, report.residual, report.rounding)
        self._residual_zeros[source.index] = zero
        keep = top_k_indices(evals, top_k, tolerance=zero)
        if len(keep) < top_k:
            warn_unresolved_eigenpairs(top_k, evals, len(keep), zero, report, source)
        return keep

    def _kept_leading(
        self,
        group: int,
        top_k: int | None,
        solver: str,
        tol: float | None,
        seed: int,
    ) -> tuple[Tensor, Tensor, SolverReport] | None:
        """Leading pairs computed before that answer this request, if any.

        ``"auto"`` stands for the solver it chose first for the group, tolerance
        and seed, so that later requests for as many pairs or fewer use the same
        directions as earlier ones, also after a full decomposition (where the
        top eigenvalues are repeated, the leading directions are not unique).
        """
        if top_k is None:
            return None
        if solver == "auto":
            solver = self._auto_solvers.get((group, tol, seed))
        leading = self._leading.get((group, solver, tol, seed))
        source = self._source.group(group)
        rows = source.num_rows
        if source.parameter_space:  # at most D pairs in parameter space
            rows = min(rows, source.num_params)
        if leading is None or leading[0].numel() < min(top_k, rows):
            return None
        return leading

    def _compute_leading(
        self,
        source: GroupSource,
        top_k: int,
        solver: str,
        requested: str,
        tol: float | None,
        seed: int,
    ) -> tuple[Tensor, Tensor, SolverReport]:
        max_columns = None
        if source.parameter_space:  # block Krylov on G itself, D rows
            size, products = source.num_params, source.flat_ggn_matmul
            max_columns = source.basis_columns(top_k)  # refused if none fits
        else:
            size, products = source.num_rows, source.products.gram_matmul
        if solver == "dense":
            workspace = dense_workspace_bytes(size, top_k, source.dtype, source.device)
        else:
            workspace = iterative_workspace_bytes(size, top_k, source.dtype)
        evals, evecs, report = leading_eigenpairs(
            products,
            top_k,
            solver,
            lambda: source.form_gram(workspace),
            size=size,
            # without a Gram matrix there is no dense solve to fall back to
            requested=requested if "dense" in source.solvers else solver,
            dtype=source.dtype,
            device=source.device,
            tol=tol,
            seed=seed,
            max_columns=max_columns,
        )
        return evals, evecs, report

    def _param_directions(
        self, source: GroupSource, evals: Tensor, gram_evecs: Tensor, key: tuple
    ) -> list[Tensor]:
        """The eigenvectors ``e_k = V ẽ_k / √λ_k`` in the products' type.

        Kept between calls (under ``key``) where each product passes over the
        data; none is formed for no direction. A parameter-space source's
        directions are the eigenvectors already.
        """
        if key in self._directions_in_params:
            return self._directions_in_params[key]
        if source.parameter_space:
            evecs = source.unflatten(gram_evecs)
        elif evals.numel() == 0:
            evecs = [evals.new_zeros(0, *p.shape) for p in source.params]
        else:
            coefficients = direction_coefficients(gram_evecs, evals).T.contiguous()
            evecs = source.products.v_matmul(coefficients)
        if source.keeps_directions:
            self._directions_in_params[key] = evecs
        return evecs

    def eigh(
        self,
        top_k: int | None = None,
        group: int = 0,
        *,
        solver: str | None = None,
        tol: float | None = None,
        seed: int | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """Leading eigenpairs of the GGN.

        Args:
            top_k: Number of leading eigenpairs; ``None`` keeps every eigenvalue
                above the numerical-zero tolerance. Fewer are returned if fewer
                are non-zero; no eigenvector is formed for a numerically zero one.
            group: Index of the parameter group.
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).
            tol: Relative residual bound of the iterative solvers for this call
                (``None``: the constructor's ``solver_tol``).
            seed: Seed of their random start block for this call (``None``: the
                constructor's ``solver_seed``).

        Returns:
            Eigenvalues ``[K]`` ascending, and eigenvectors as one tensor
            ``[K, *p.shape]`` per parameter (unit norm over the group).
        """
        evals, gram_evecs = self._directions(top_k, group, solver, tol, seed)
        source = self._source.group(group)
        key = (group, top_k, solver, tol, seed)
        evecs = self._param_directions(source, evals, gram_evecs, key)
        if source.keeps_directions:
            # views of kept results: the caller gets copies
            return evals, in_param_dtypes(evecs, source.params)
        # formed for this call (V ũ, as large as top_k models): not copied again
        return evals, [e.to(p.dtype) for e, p in zip(evecs, source.params, strict=True)]

    def operator(self, group: int = 0) -> GGNOperator:
        """The group's GGN as a linear operator: ``G·v``, ``G⁺·v``, scipy.

        Products go through the source's products with ``V``; ``G`` is never
        formed. See :class:`~vivit.linalg.operator.GGNOperator`.

        Example::

            from scipy.sparse.linalg import eigsh

            op = ggn.operator()
            Gv = op.matvec(v)                   # v: [D] over the group's parameters
            step = op.pinv_matvec(g, top_k=10)  # G⁺ on the top-10 eigenspace
            evals = eigsh(op.to_scipy(), k=3, return_eigenvectors=False)

        Args:
            group: Index of the parameter group.

        Returns:
            The operator, of shape ``(D, D)`` with ``D`` the group's parameters.
        """
        source = self._source.group(group)
        products = (
            source.products
            if source.parameter_space
            else GramSpaceProducts(source.products)
        )
        return GGNOperator(
            products,
            source.params,
            lambda top_k, solver: self._directions(top_k, group, solver),
        )

    # Gradient and directional derivatives -----------------------------------
    def gradient(self, group: int = 0) -> list[Tensor]:
        """The gradient ``∇L`` of the loss from the same backward pass(es).

        Args:
            group: Index of the parameter group.

        Returns:
            One tensor per parameter of the group, shaped like it (gradient of the
            loss on all samples, whatever the curvature subsampling); copies.
        """
        return [g.clone() for g in self._source.group(group).gradient]

    def _directional(
        self,
        top_k: int | None,
        group: int,
        subsampling_grad: Sequence[int] | None,
        solver: str | None,
        tol: float | None,
        seed: int | None,
    ) -> tuple[Tensor, DirectionalDerivatives]:
        evals, gram_evecs = self._directions(top_k, group, solver, tol, seed)
        source = self._source.group(group)
        samples = check_subsampling(
            subsampling_grad, source.batch.batch_size, "subsampling_grad"
        )
        key = (group, top_k, solver, tol, seed)
        if source.parameter_space:  # one pass: J_n e_k of every sample
            gammas, lambdas = source.directional_derivatives(
                self._param_directions(source, evals, gram_evecs, key)
            )
            if samples is not None:
                gammas = gammas[list(samples)]
        else:
            gammas = source.directional_gradients(
                gram_evecs,
                evals,
                lambda: self._param_directions(source, evals, gram_evecs, key),
                samples,
            )
            lambdas = directional_curvatures(gram_evecs, evals, source.batch)
        directional = DirectionalDerivatives(
            evals=evals,
            gammas=gammas,
            lambdas=lambdas,
            gamma_bar=batch_directional_gradient(gammas, source.batch, samples),
        )
        return gram_evecs, directional

    def directional_derivatives(
        self,
        top_k: int | None = None,
        group: int = 0,
        subsampling_grad: Sequence[int] | None = None,
        *,
        solver: str | None = None,
        tol: float | None = None,
        seed: int | None = None,
    ) -> DirectionalDerivatives:
        """Per-sample first and second derivatives along the leading eigenvectors.

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).
            tol: As for :meth:`eigh`.
            seed: As for :meth:`eigh`.

        Returns:
            ``γ [N_grad, K]``, ``λ [N_ggn, K]`` and their per-direction statistics.
        """
        return self._directional(top_k, group, subsampling_grad, solver, tol, seed)[1]

    def newton(
        self,
        top_k: int | None = None,
        group: int = 0,
        damping: float | Damping = 1.0,
        subsampling_grad: Sequence[int] | None = None,
        *,
        lr: float = 1.0,
        max_decrease: float | None = None,
        solver: str | None = None,
        tol: float | None = None,
        seed: int | None = None,
    ) -> NewtonStep:
        """The directionally damped Newton step with its ingredients.

        ``Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k`` over the leading eigenvectors, with
        ``γ̄_k`` the directional gradient of the loss on the gradient samples. The
        step is one product of ``V`` with a Gram-space vector. A step to which no
        direction contributes is zero and warns (:class:`~vivit.ZeroStepWarning`).

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            damping: A constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs,
                gammas, lambdas) → [K]`` (see :mod:`vivit.optim.damping`).
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).
            lr: Scale of the returned step, ``lr · Δθ``.
            max_decrease: Largest loss decrease the GGN's quadratic model may
                predict for ``lr · Δθ``; the dampings are raised to meet it as
                ``docs/math.rst`` derives ("Trust region of a Newton step").
                ``None``: the dampings as the rule gives them.
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).
            tol: As for :meth:`eigh`.
            seed: As for :meth:`eigh`.

        Returns:
            The step, the directional derivatives, ``γ̄`` and the dampings used.

        Raises:
            InvalidArgumentError: If ``lr`` is not a positive finite number,
                ``max_decrease`` not ``None`` or a number ``≥ 0``, or the damping
                invalid.
        """
        check_damping(damping)
        check_lr(lr)
        check_max_decrease(max_decrease)
        gram_evecs, directional = self._directional(
            top_k, group, subsampling_grad, solver, tol, seed
        )
        source = self._source.group(group)
        if source.parameter_space:  # Δθ = Σ_k t_k e_k, one matrix product
            dampings, sizes = damped_step_sizes(
                gram_evecs, directional, damping, lr=lr, max_decrease=max_decrease
            )
            step = [s[0] for s in source.unflatten((gram_evecs @ sizes).unsqueeze(1))]
        else:
            dampings, u = newton_coefficients_damped(
                gram_evecs, directional, damping, lr=lr, max_decrease=max_decrease
            )
            if directional.evals.numel() > 0:
                step = [s.squeeze(0) for s in source.products.v_matmul(u.unsqueeze(0))]
            else:  # no direction: no product
                step = [torch.zeros_like(p, dtype=source.dtype) for p in source.params]
        return NewtonStep(
            directional=directional,
            dampings=dampings,
            step=in_param_dtypes(step, source.params),
        )

    def newton_step(
        self,
        top_k: int | None = None,
        group: int = 0,
        damping: float | Damping = 1.0,
        subsampling_grad: Sequence[int] | None = None,
        *,
        solver: str | None = None,
        tol: float | None = None,
        seed: int | None = None,
    ) -> list[Tensor]:
        """The directionally damped Newton step on the leading eigenspace.

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            damping: A constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs,
                gammas, lambdas) → [K]`` (see :mod:`vivit.optim.damping`).
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).
            tol: As for :meth:`eigh`.
            seed: As for :meth:`eigh`.

        Returns:
            The step (see :meth:`newton`), one tensor per parameter, shaped like it.
        """
        return self.newton(
            top_k,
            group,
            damping,
            subsampling_grad,
            solver=solver,
            tol=tol,
            seed=seed,
        ).step


def _auto_solver(source: GroupSource, top_k: int) -> str:
    """The solver ``"auto"`` stands for: the source's only one, or the cheapest."""
    if len(source.solvers) == 1:
        return source.solvers[0]
    formed = source.formed_gram() is not None
    return choose_solver(source.factors, top_k, source.dtype, source.device, formed)


def warn_fewer_eigenpairs(
    top_k: int, found: int, rows: int, options: CurvatureOptions
) -> None:
    """Warn that ``found < top_k`` eigenpairs are returned, and say why.

    Args:
        top_k: The pairs asked for.
        found: The numerically non-zero pairs there are.
        rows: The Gram matrix's side.
        options: The request's options (Monte Carlo explains a small side).
    """
    if rows < top_k:
        why = (
            f"the Gram matrix has only {rows} rows (N·C, N·C·T for sequences of T "
            "positions"
        )
        if options.mc_samples and options.mc_per == "sequence":
            why += (
                "; here Monte Carlo per sequence keeps N·M: mc_per='token' keeps N·M·T"
            )
        elif options.mc_samples:
            why += "; here Monte Carlo keeps N·M, N·M·T per token"
        why += ")"
    else:
        why = (
            f"{rows - found} of the Gram matrix's {rows} eigenvalues are numerical "
            "zeros (at or below the tolerance of docs/math.rst, 'Precision and the "
            "numerical zero'; cross-entropy's GGN has rank at most N·(C - 1), "
            "N·(C - 1)·T on sequences)"
        )
    warnings.warn(
        f"top_k={top_k} eigenpairs were asked for, but only {found} exist: {why}. "
        f"The {found} that exist are returned.",
        FewerEigenpairsWarning,
        stacklevel=_outside_the_package(),
    )


def warn_unresolved_eigenpairs(
    top_k: int,
    evals: Tensor,
    found: int,
    zero: float,
    report: SolverReport,
    source: GroupSource,
) -> None:
    """Warn that a parameter-space solve resolves ``found < top_k`` pairs, and why.

    Args:
        top_k: The pairs asked for.
        evals: The Ritz values the solver returned.
        found: Those above ``zero``.
        zero: The residual bound
            (:func:`~vivit.linalg.solvers.residual_zero_tolerance`).
        report: The solve's report (its tolerance and measured rounding).
        source: The group (its parameters and the products' type).
    """
    computed = evals.numel()
    why = []
    if computed < top_k:
        why.append(f"the group has only {computed} parameters")
    if found < computed:
        largest = evals.abs().max().item()
        why.append(
            f"{computed - found} of the {computed} leading Ritz values are at or "
            f"below {zero:.1e} = {zero / largest:.1e}·λ_max, the eigensolver's "
            "residual bound against the exact GGN (the relative residual it reached, "
            f"{report.residual:.1e}, plus the products' rounding, "
            f"{report.rounding:.1e}), so "
            "they cannot be told from zero eigenvalues (docs/math.rst, 'Precision "
            "and the numerical zero', 'Without the Gram matrix: the residual bound')"
        )
        # the rounding sets the bound at the floor, or where the residual the
        # solver reached lies below it: a smaller tol would not lower it
        rounding_sets = report.tolerance > report.requested_tolerance or (
            report.rounding >= report.residual
        )
        if rounding_sets:
            remedy = (
                " The products' rounding sets the bound: a float64 model "
                "(model.double()) lowers it by about 1e9."
                if source.dtype != torch.float64
                else " The products are float64 already: their rounding is the limit."
            )
        else:
            remedy = " A smaller tol (eigh(top_k, tol=...)) lowers the bound."
    else:
        remedy = ""
    warnings.warn(
        f"top_k={top_k} eigenpairs were asked for, but only {found} are resolved: "
        f"{'; '.join(why)}. The {found} resolved are returned.{remedy}",
        FewerEigenpairsWarning,
        stacklevel=_outside_the_package(),
    )


def _outside_the_package() -> int:
    """``stacklevel`` of the first caller outside ``vivit`` (of the warning's caller).

    The results reach the eigenpairs through calls of different depths (``eigh``,
    ``directional_derivatives``, ``newton_step``, the compat classes).
    """
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
