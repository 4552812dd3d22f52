"""Every result of the GGN's low-rank structure, written once over a source.

Picks the eigensolver, caches what it computed and maps Gram-space results to
parameter space (``docs/math.rst``, "The Gram matrix and exact eigenpairs").
"""

from __future__ import annotations

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
from vivit.distributed.sharded import ParamPlacement, gathered
from vivit.eigenpairs import auto_solver, compute_leading, gram_nonzero, resolved
from vivit.errors import InvalidArgumentError
from vivit.gram.memory import dense_workspace_bytes, itemsize
from vivit.linalg.iterative import SolverReport, check_seed, check_tolerance
from vivit.linalg.operator import GGNOperator, GramSpaceProducts
from vivit.linalg.solvers import (
    direction_coefficients,
    gram_eigh,
    numerical_zero_tolerance,
    residual_zero_tolerance,
)
from vivit.linalg.top_k import check_solver, relative_residual
from vivit.options import CurvatureOptions
from vivit.sources.base import CurvatureSource, GroupSource
from vivit.sources.collector import in_param_dtypes


class CurvatureResults:
    """The front doors' base: the results of a ``source`` under checked ``options``.

    Attributes:
        loss: The loss on all samples (detached).
        param_groups: The parameter groups, as lists of parameters.
        engine: Name of the engine that ran (``"backpack"`` or ``"func"``).
    """

    def __init__(
        self,
        source: CurvatureSource,
        options: CurvatureOptions,
        placement: ParamPlacement | None = None,
    ):
        self._source = source
        self._options = options
        # an FSDP2 model's parameter-space results are sharded like its parameters
        self._placement = placement or ParamPlacement()
        self.param_groups = self._placement.callers(source.param_groups)
        self.loss = source.loss
        self.engine = source.engine
        self._decompositions: dict[int, tuple[Tensor, Tensor]] = {}
        self._leading: dict[tuple, tuple[Tensor, Tensor, SolverReport]] = {}
        self._residual_zeros: dict[int, float] = {}
        self._auto_solvers: dict[tuple, str] = {}
        self._directions_in_params: dict[tuple, list[Tensor]] = {}
        self._reports: dict[int, SolverReport] = {}
        self._full_reports: dict[tuple, SolverReport] = {}

    # Gram space ---------------------------------------------------------------
    def gram(self, group: int = 0) -> Tensor:
        """The Gram matrix ``Vᵀ V`` of parameter group ``group`` (formed once).

        Returns:
            A copy, ``[N·C, N·C]`` (``N·M`` with MC), ordered sample-major: entry
            ``n·C + c`` is output ``c`` of sample ``n`` (of the subsampling).

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
        """All eigenvalues of the group's Gram matrix: the GGN's non-zero spectrum.

        Returns:
            ``[N·C]`` eigenvalues, ascending (at or below :meth:`zero_tolerance`: zero).
        """
        return self._gram_eigh(group)[0].clone()

    def zero_tolerance(self, group: int = 0) -> float:
        """The group's eigenvalues at or below this value are numerically zero.

        With ``route="implicit"``: the residual bound of its latest leading pairs
        (``docs/math.rst``, "Precision and the numerical zero").

        Raises:
            InvalidArgumentError: With ``route="implicit"``, before any ``top_k``.
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
            self.eigvalsh(group), factor_dtype=source.factor_dtype
        )

    def solver_report(self, group: int = 0) -> SolverReport | None:
        """How the latest leading eigenpairs of group ``group`` were computed.

        Returns:
            ``None`` before the first request with ``top_k``; ``"dense"`` for pairs
            of the full decomposition.
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
        """The ``top_k`` leading non-zero Gram eigenpairs: kept, full, or computed."""
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
            keep = gram_nonzero(source, evals, top_k, self._options)
        else:
            if leading is None:
                chosen = solver if solver != "auto" else auto_solver(source, top_k)
                leading = compute_leading(source, top_k, chosen, solver, tol, seed)
                self._leading[(group, chosen, tol, seed)] = leading
                if solver == "auto":
                    self._auto_solvers[(group, tol, seed)] = chosen
                # directions kept from replaced pairs could differ in sign
                self._directions_in_params = {
                    k: v for k, v in self._directions_in_params.items() if k[0] != group
                }
            evals, evecs, report = leading
            self._reports[group] = report
            if source.parameter_space:  # the numerical zero: the residual bound
                zero = residual_zero_tolerance(evals, report.residual, report.rounding)
                self._residual_zeros[source.index] = zero
                keep = resolved(source, evals, top_k, report, zero)
            else:
                keep = gram_nonzero(source, evals, top_k, self._options)
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

    def _kept_leading(
        self,
        group: int,
        top_k: int | None,
        solver: str,
        tol: float | None,
        seed: int,
    ) -> tuple[Tensor, Tensor, SolverReport] | None:
        """Kept leading pairs that answer this request (``"auto"``: its first pick)."""
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

    def _param_directions(
        self, source: GroupSource, evals: Tensor, gram_evecs: Tensor, key: tuple
    ) -> list[Tensor]:
        """The eigenvectors ``e_k = V ẽ_k / √λ_k`` (kept under ``key`` if costly)."""
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
            top_k: Number of leading eigenpairs (fewer if fewer are non-zero);
                ``None``: every one above the numerical-zero tolerance.
            group: Index of the parameter group.
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).
            tol: The iterative solvers' residual bound (``None``: ``solver_tol``).
            seed: Seed of their start block (``None``: ``solver_seed``).

        Returns:
            Eigenvalues ``[K]`` ascending, and eigenvectors as one tensor
            ``[K, *p.shape]`` per parameter (unit norm over the group).
        """
        evals, gram_evecs = self._directions(top_k, group, solver, tol, seed)
        source = self._source.group(group)
        key = (group, top_k, solver, tol, seed)
        evecs = self._param_directions(source, evals, gram_evecs, key)
        if source.keeps_directions:
            evecs = in_param_dtypes(evecs, source.params)
        else:  # formed for this call (V ũ, as large as top_k models): not copied again
            evecs = [e.to(p.dtype) for e, p in zip(evecs, source.params, strict=True)]
        return evals, self._placement.place(evecs, source.params, leading=1)

    def operator(self, group: int = 0) -> GGNOperator:
        """The GGN of group ``group`` as a linear operator, never formed.

        Example: ``ggn.operator().pinv_matvec(g, top_k=10)`` (user guide, "The GGN
        as an operator").

        Returns:
            The operator, of shape ``(D, D)`` with ``D`` the group's parameters.
        """
        source = self._source.group(group)
        products = source.products
        return GGNOperator(
            products if source.parameter_space else GramSpaceProducts(products),
            source.params,
            lambda top_k, solver: self._directions(top_k, group, solver),
            gather=gathered,
            place=lambda tensors, leading: self._placement.place(
                tensors, source.params, leading
            ),
        )

    # Gradient and directional derivatives -----------------------------------
    def gradient(self, group: int = 0) -> list[Tensor]:
        """The gradient ``∇L`` of the loss on all samples (whatever ``subsampling``).

        Returns:
            One tensor per parameter of group ``group``, shaped like it; copies.
        """
        source = self._source.group(group)
        return self._placement.place(
            [g.clone() for g in source.gradient], source.params
        )

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

        ``top_k``, ``group``, ``solver``, ``tol`` and ``seed`` choose the directions
        as in :meth:`eigh`; the gradients of the samples ``subsampling_grad``
        (``None``: all) give ``γ``.

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

        ``lr · Δθ`` over the directions of :meth:`directional_derivatives` for the
        same arguments (``docs/math.rst``, "Damped Newton step in the eigenspace").
        ``damping``: a constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs,
        gammas, lambdas) → [K]`` (:mod:`vivit.optim.damping`). ``max_decrease``
        bounds the model's predicted decrease by raising the dampings ("Trust
        region of a Newton step"). A zero step warns (:class:`~vivit.ZeroStepWarning`).

        Returns:
            The step, the directional derivatives and the dampings used.

        Raises:
            InvalidArgumentError: For an invalid ``lr``, ``max_decrease`` or damping.
        """
        check_damping(damping)
        check_lr(lr)
        check_max_decrease(max_decrease)
        gram_evecs, directional = self._directional(
            top_k, group, subsampling_grad, solver, tol, seed
        )
        source = self._source.group(group)
        space = source.parameter_space
        dampings, u = (damped_step_sizes if space else newton_coefficients_damped)(
            gram_evecs, directional, damping, lr=lr, max_decrease=max_decrease
        )
        if space:  # Δθ = Σ_k t_k e_k, one matrix product
            step = [s[0] for s in source.unflatten((gram_evecs @ u).unsqueeze(1))]
        elif directional.evals.numel() > 0:
            step = [s.squeeze(0) for s in source.products.v_matmul(u.unsqueeze(0))]
        else:  # no direction: no product
            step = [torch.zeros_like(p, dtype=source.dtype) for p in source.params]
        return NewtonStep(
            directional=directional,
            dampings=dampings,
            step=self._placement.place(
                in_param_dtypes(step, source.params), source.params
            ),
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
        """The step of :meth:`newton` (same arguments, ``lr=1``) alone.

        Returns:
            One tensor per parameter, shaped like it.
        """
        return self.newton(
            top_k, group, damping, subsampling_grad, solver=solver, tol=tol, seed=seed
        ).step
