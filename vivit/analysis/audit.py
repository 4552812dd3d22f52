"""Which approximation of the GGN can I trust on my model? One table answers."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from tqdm import tqdm

from vivit._validation import check_batch, check_lr, check_positive_int
from vivit.analysis.approximations import (
    KRONECKER_FACTORED,
    NOT_INSTALLED,
    ApproximateCurvature,
    CurvlinopsRefusalError,
    cosine,
    curvlinops_installed,
    diagonal_curvature,
    flat,
    kronecker_factored_curvature,
    low_rank_curvature,
)
from vivit.errors import InvalidArgumentError, ParamGroupError
from vivit.lowrank import LowRankGGN
from vivit.model_inputs import num_samples as count_samples

#: Every approximation the audit knows, in the order of its table.
APPROXIMATIONS = ("mc", "subsampled", "block_diagonal", "diagonal", "kfac", "ekfac")


@dataclass(frozen=True)
class AuditRow:
    """One approximation against the exact GGN.

    Only ``"ok"`` rows carry numbers; a step number is ``None`` for a zero gradient.

    Attributes:
        name: Key (``"mc-1"``, ``"subsampled"``, ...); ``label``: its description.
        status: ``"ok"``, ``"not installed"`` or ``"unsupported"`` (by curvlinops:
            the reason names the layers it does not support).
        reason: Why a row has no numbers (``None`` for ``"ok"``).
        eigenvalues: Its top eigenvalues, descending (fewer if fewer are non-zero).
        relative_errors: ``|λ̂_i − λ_i| / λ_i`` for the exact top ``k``.
        principal_cosines: ``cos θ_i`` descending; ``principal_sines``: ascending.
        step_cosine: ``cos(s, ŝ)`` of the damped Newton steps.
        step_norm_ratio: ``‖ŝ‖ / ‖s‖``; ``time_s``: seconds to compute the row.
    """

    name: str
    label: str
    status: str = "ok"
    reason: str | None = None
    eigenvalues: list[float] | None = None
    relative_errors: list[float] | None = None
    principal_cosines: list[float] | None = None
    principal_sines: list[float] | None = None
    step_cosine: float | None = None
    step_norm_ratio: float | None = None
    time_s: float | None = None

    @property
    def max_relative_error(self) -> float | None:
        """The largest eigenvalue relative error (``None`` without numbers)."""
        return max(self.relative_errors) if self.relative_errors else None

    @property
    def largest_sine(self) -> float | None:
        """``sin θ_max = ‖U Uᵀ − Û Ûᵀ‖₂`` for equal dimensions (``None`` without)."""
        return max(self.principal_sines) if self.principal_sines else None

    @property
    def subspace_overlap(self) -> float | None:
        """``Σ_i cos² θ_i / k = ‖U Ûᵀ‖_F² / k`` (``None`` without numbers)."""
        if not self.principal_cosines:
            return None
        return sum(c * c for c in self.principal_cosines) / len(self.principal_cosines)

    def to_dict(self) -> dict:
        """Every field and summary of the row, as a JSON-compatible dict."""
        return {
            **asdict(self),
            "max_relative_error": self.max_relative_error,
            "largest_sine": self.largest_sine,
            "subspace_overlap": self.subspace_overlap,
        }


@dataclass(frozen=True)
class ApproximationAudit:
    """The audit's table: one row per approximation, and the exact reference.

    Attributes:
        top_k: Number of compared eigenpairs (fewer if the GGN has fewer non-zero).
        damping: ``δ`` of every damped Newton step.
        exact_step_norm: ``‖s‖`` of the exact damped Newton step.
    """

    top_k: int
    damping: float
    num_parameters: int
    num_samples: int
    exact_eigenvalues: list[float]
    exact_step_norm: float
    exact_time_s: float
    rows: list[AuditRow]

    def as_rows(self) -> list[dict]:
        """The table: :meth:`AuditRow.to_dict` of every row."""
        return [row.to_dict() for row in self.rows]

    def to_dict(self) -> dict:
        """Every number and setting of the audit, as a JSON-compatible dict."""
        return asdict(self) | {"rows": self.as_rows()}

    def __str__(self) -> str:
        def fmt(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.3g}"

        lines = [
            f"Approximation audit: top {self.top_k} eigenpairs of the GGN of "
            f"{self.num_samples} samples, {self.num_parameters:,} parameters, "
            f"damping {self.damping:g}.",
            f"{'approximation':<28} {'max rel. err':>12} {'max sin θ':>10} "
            f"{'overlap':>8} {'step cos':>9} {'time [s]':>9}",
        ]
        for row in self.rows:
            if row.status != "ok":
                lines.append(f"{row.label:<28} {row.status}: {row.reason}")
                continue
            lines.append(
                f"{row.label:<28} {fmt(row.max_relative_error):>12} "
                f"{fmt(row.largest_sine):>10} {fmt(row.subspace_overlap):>8} "
                f"{fmt(row.step_cosine):>9} {fmt(row.time_s):>9}"
            )
        return "\n".join(lines)


def _sequence(value: object, name: str, expected: str) -> list:
    """``value`` as a list, refusing a string or what is not a sequence."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgumentError(
            f"{name} must be a sequence of {expected}, got {value!r}."
        )
    return list(value)


def _default_blocks(model: Module, params: Sequence[Parameter]) -> list[list]:
    """One block per module that owns audited parameters (the first owner)."""
    audited, blocks = {id(p) for p in params}, []
    for module in model.modules():
        block = [p for p in module.parameters(recurse=False) if id(p) in audited]
        audited -= {id(p) for p in block}
        blocks += [block] if block else []
    return blocks


def audit_approximations(
    model: Module,
    loss_func: Module,
    data: tuple[Tensor, Tensor],
    *,
    top_k: int = 10,
    damping: float = 1.0,
    approximations: Sequence[str] = APPROXIMATIONS,
    mc_samples: Sequence[int] = (1, 8),
    subsampling: Sequence[int] | None = None,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
    seed: int = 0,
    engine: str = "auto",
    gram_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> ApproximationAudit:
    """Audit approximations of a mini-batch's GGN against the exact one.

    Compares top-k eigenpairs and damped Newton steps (``docs/math.rst``,
    "Approximation audit"). KFAC and EKFAC need curvlinops (extra ``vivit[audit]``):
    else ``"not installed"``; ``"unsupported"`` (skipped, the reason naming the
    layers) where audited parameters lie outside ``Linear`` and ``Conv2d`` layers.

    Args:
        model: The network (BatchNorm and dropout in eval mode).
        loss_func: ``MSELoss``, ``CrossEntropyLoss`` or ``BCEWithLogitsLoss``.
        data: The mini-batch ``(inputs, targets)``.
        top_k: Number of leading eigenpairs compared.
        damping: ``δ > 0`` of every damped Newton step.
        approximations: Which rows, from :data:`APPROXIMATIONS`.
        mc_samples: Monte-Carlo samples per datum, one ``"mc"`` row each.
        subsampling: Sample indices of ``"subsampled"`` (default: first half, ≥ 1).
        param_groups: Blocks of ``"block_diagonal"``, partitioning the trainable
            parameters (default: one block per module that owns parameters).
        seed: Seed of the Monte-Carlo samples.
        engine: As in :class:`~vivit.options.CurvatureOptions`.
        gram_dtype: As in :class:`~vivit.options.CurvatureOptions`.
        progress: Show a progress bar over the approximations.

    Raises:
        InvalidArgumentError: For an unknown approximation or a non-positive number.
        ParamGroupError: If ``param_groups`` do not partition the parameters.
        VivitError: What :class:`~vivit.LowRankGGN` raises for the model or data.
    """
    names = _sequence(approximations, "approximations", f"names from {APPROXIMATIONS}")
    unknown = [a for a in names if a not in APPROXIMATIONS]
    if unknown or not names:
        raise InvalidArgumentError(
            f"approximations must be a non-empty sequence of names from "
            f"{APPROXIMATIONS}; unknown: {unknown}."
        )
    check_positive_int(top_k, "top_k", "leading eigenpairs compared")
    check_lr(damping, "damping")
    mc_counts = _sequence(mc_samples, "mc_samples", "positive integers, e.g. (1, 8)")
    for value in mc_counts:
        check_positive_int(value, "mc_samples", "Monte-Carlo samples of one row")
    inputs, targets = check_batch(data)
    params = [p for p in model.parameters() if p.requires_grad]
    num_samples = count_samples(inputs)
    subsampling = (
        list(range(max(1, num_samples // 2))) if subsampling is None else subsampling
    )
    blocks = _default_blocks(model, params) if param_groups is None else param_groups
    if sorted(id(p) for b in blocks for p in b) != sorted(id(p) for p in params):
        raise ParamGroupError(
            "param_groups must partition the model's trainable parameters (each in "
            "exactly one group) for a block-diagonal approximation of the whole GGN; "
            "pass e.g. [[p] for p in model.parameters() if p.requires_grad]."
        )

    def ggn(**options) -> LowRankGGN:
        options = {"param_groups": [params], **options}
        settings = {"engine": engine, "gram_dtype": gram_dtype, "progress": False}
        return LowRankGGN(model, loss_func, (inputs, targets), **settings, **options)

    def low_rank(**options) -> Callable[[], ApproximateCurvature]:
        return lambda: low_rank_curvature(ggn(**options), params, top_k, damping)

    started = time.perf_counter()
    exact_ggn = ggn()
    exact = low_rank_curvature(exact_ggn, params, top_k, damping)
    exact_time = time.perf_counter() - started
    gradient = flat(exact_ggn.gradient())
    jobs: list[tuple[str, str, Callable[[], ApproximateCurvature]]] = []
    for name in names:
        if name == "mc":  # one row per sample count, each from the seed
            for m in mc_counts:
                generator = torch.Generator(params[0].device).manual_seed(seed)
                compute = low_rank(mc_samples=m, generator=generator)
                jobs.append((f"mc-{m}", f"MC ({m} sample{'s' * (m > 1)})", compute))
        elif name == "subsampled":
            label = f"subsampled ({len(subsampling)} of {num_samples})"
            jobs.append((name, label, low_rank(subsampling=subsampling)))
        elif name == "block_diagonal":
            label = f"block-diagonal ({len(blocks)} blocks)"
            jobs.append((name, label, low_rank(param_groups=blocks)))
        elif name == "diagonal":
            compute = partial(diagonal_curvature, exact_ggn, gradient, top_k, damping)
            jobs.append((name, name, compute))
        else:
            args = (name, model, loss_func, (inputs, targets), params, gradient)
            compute = partial(kronecker_factored_curvature, *args, top_k, damping)
            jobs.append((name, name.upper(), compute))

    rows = []
    for name, label, compute in tqdm(jobs, desc="Approximations", disable=not progress):
        if name in KRONECKER_FACTORED and not curvlinops_installed():
            rows.append(AuditRow(name, label, "not installed", NOT_INSTALLED))
            continue
        start = time.perf_counter()
        try:
            approx = compute()
        except CurvlinopsRefusalError as refusal:
            rows.append(AuditRow(name, label, "unsupported", str(refusal)))
            continue
        rows.append(_row(name, label, exact, approx, time.perf_counter() - start))
    return ApproximationAudit(
        top_k=exact.values.numel(),
        damping=float(damping),
        num_parameters=sum(p.numel() for p in params),
        num_samples=num_samples,
        exact_eigenvalues=exact.values.tolist(),
        exact_step_norm=float(exact.step.norm()),
        exact_time_s=exact_time,
        rows=rows,
    )


def _row(
    name: str,
    label: str,
    exact: ApproximateCurvature,
    approx: ApproximateCurvature,
    seconds: float,
) -> AuditRow:
    """The row of one computed approximation: ``docs/math.rst``'s measures."""
    k = exact.values.numel()
    padded = exact.values.new_zeros(k)  # zero at ranks the approximation lacks
    padded[: approx.values.numel()] = approx.values[:k]
    cosines = exact.vectors.new_zeros(k)  # svdvals(U Ûᵀ), zero for missing ranks
    if approx.vectors.shape[0] > 0:
        singular = torch.linalg.svdvals(exact.vectors @ approx.vectors.T)
        cosines[: singular.numel()] = singular[:k]
    cosines = cosines.clamp(max=1.0)
    exact_norm = exact.step.norm()
    ratio = float(approx.step.norm() / exact_norm) if exact_norm > 0 else None
    return AuditRow(
        name=name,
        label=label,
        eigenvalues=approx.values.tolist(),
        relative_errors=((padded - exact.values).abs() / exact.values).tolist(),
        principal_cosines=cosines.tolist(),
        principal_sines=(1 - cosines.square()).clamp(min=0.0).sqrt().tolist(),
        step_cosine=cosine(exact.step, approx.step),
        step_norm_ratio=ratio,
        time_s=seconds,
    )
