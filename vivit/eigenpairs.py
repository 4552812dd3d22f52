"""The leading eigenpairs of one group source: solver, numerical zero, warnings.

Fewer pairs than asked for are said why (``docs/math.rst``, "Precision and the
numerical zero").
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
from torch import Tensor

from vivit.errors import FewerEigenpairsWarning
from vivit.gram.memory import dense_workspace_bytes
from vivit.linalg.iterative import SolverReport
from vivit.linalg.solvers import top_k_indices
from vivit.linalg.top_k import iterative_workspace_bytes, leading_eigenpairs
from vivit.memory.costs import choose_solver
from vivit.options import CurvatureOptions
from vivit.sources.base import GroupSource


def auto_solver(source: GroupSource, top_k: int) -> str:
    """The solver ``"auto"`` stands for: the source's only one, or the cheapest."""
    if len(source.solvers) == 1:
        return source.solvers[0]
    formed = source.formed_gram() is not None
    return choose_solver(source.factors, top_k, source.dtype, source.device, formed)


def compute_leading(
    source: GroupSource,
    top_k: int,
    solver: str,
    requested: str,
    tol: float | None,
    seed: int,
) -> tuple[Tensor, Tensor, SolverReport]:
    """``top_k`` leading pairs by ``solver`` (on ``G`` itself without ``V``)."""
    max_columns, scope = None, contextlib.nullcontext()
    if source.parameter_space:  # block Krylov on G itself, D rows
        size, products = source.num_params, source.flat_ggn_matmul
        max_columns = source.basis_columns(top_k)  # refused if none fits
        scope = source.linearized(top_k)
    else:
        size, products = source.num_rows, source.products.gram_matmul
    if solver == "dense":
        workspace = dense_workspace_bytes(size, top_k, source.dtype, source.device)
    else:
        workspace = iterative_workspace_bytes(size, top_k, source.dtype)
    with scope:
        return leading_eigenpairs(
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


def gram_nonzero(
    source: GroupSource, evals: Tensor, top_k: int | None, options: CurvatureOptions
) -> list[int]:
    """The ``top_k`` leading eigenvalues above the Gram matrix's numerical zero."""
    # without the Gram matrix, tr(G̃) is bounded by N·C·λ_max
    gram = source.formed_gram()
    trace = None if gram is None else gram.trace().item()
    keep = top_k_indices(evals, top_k, source.num_rows, source.factor_dtype, trace)
    if top_k is not None and len(keep) < top_k:
        warn_fewer_eigenpairs(top_k, len(keep), source.num_rows, options)
    return keep


def resolved(
    source: GroupSource, evals: Tensor, top_k: int, report: SolverReport, zero: float
) -> list[int]:
    """The Ritz values of a parameter-space solve above its residual bound ``zero``."""
    keep = top_k_indices(evals, top_k, tolerance=zero)
    if len(keep) < top_k:
        warn_unresolved_eigenpairs(top_k, evals, len(keep), zero, report, source)
    return keep


def warn_fewer_eigenpairs(
    top_k: int, found: int, rows: int, options: CurvatureOptions
) -> None:
    """Warn that only ``found < top_k`` of ``rows`` Gram eigenpairs exist, and why."""
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
    """Warn that only ``found < top_k`` Ritz values exceed ``zero``, and why."""
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
    """``stacklevel`` of the first caller outside ``vivit`` (calls differ in depth)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
