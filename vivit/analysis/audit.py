"""Which approximation of the GGN can I trust on my model? One table answers.

``docs/math.rst``, "Approximation audit", defines every number of the table.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from tqdm import tqdm

from vivit._validation import check_batch, check_lr, check_positive_int
from vivit.analysis.approximations import (
    ApproximateCurvature,
    diagonal_curvature,
    exact_diagonal,
    flat_rows,
    low_rank_curvature,
)
from vivit.analysis.comparison import (
    eigenvalue_errors,
    principal_cosines,
    principal_sines,
    step_cosine,
)
from vivit.analysis.kfac import (
    KRONECKER_FACTORED,
    NOT_INSTALLED,
    CurvlinopsRefusalError,
    curvlinops_installed,
    kronecker_factored_curvature,
)
from vivit.errors import InvalidArgumentError, ParamGroupError
from vivit.lowrank import LowRankGGN
from vivit.model_inputs import num_samples as count_samples

#: Every approximation the audit knows, in the order of its table.
APPROXIMATIONS = ("mc", "subsampled", "block_diagonal", "diagonal", "kfac", "ekfac")


@dataclass(frozen=True)
class AuditRow:
    """One approximation against the exact GGN.

    Attributes:
        name: Key of the approximation (``"mc-1"``, ``"subsampled"``, ...).
        label: Its description (``"MC (1 sample)"``, ...).
        status: ``"ok"``, ``"not installed"`` (curvlinops missing) or
            ``"unsupported"`` (curvlinops refuses the model); only ``"ok"`` rows
            carry numbers.
        reason: Why a row has no numbers (``None`` for ``"ok"``).
        eigenvalues: Its top eigenvalues, descending (fewer than ``k`` if it
            has fewer non-zero ones).
        relative_errors: ``|λ̂_i − λ_i| / λ_i`` for the exact top ``k``.
        principal_cosines: ``cos θ_i`` of the principal angles, descending.
        principal_sines: ``sin θ_i``, ascending.
        step_cosine: ``cos(s, ŝ)`` of the damped Newton steps (``None`` for a
            zero gradient).
        step_norm_ratio: ``‖ŝ‖ / ‖s‖`` (``None`` for a zero gradient).
        time_s: Seconds to compute it.
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
        top_k: Number of compared eigenpairs (the exact GGN's non-zero ones if
            fewer than requested).
        damping: ``δ`` of every damped Newton step.
        num_parameters: ``D``.
        num_samples: ``N``.
        exact_eigenvalues: The exact top-k eigenvalues, descending.
        exact_step_norm: ``‖s‖`` of the exact damped Newton step.
        exact_time_s: Seconds for the exact eigenpairs and step.
        rows: One row per approximation.
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
        return {
            **{k: v for k, v in asdict(self).items() if k != "rows"},
            "rows": self.as_rows(),
        }

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


def _check_approximations(approximations: object) -> list[str]:
    if isinstance(approximations, str) or not isinstance(approximations, Sequence):
        raise InvalidArgumentError(
            f"approximations must be a sequence of names from {APPROXIMATIONS}, got "
            f"{approximations!r}."
        )
    unknown = [a for a in approximations if a not in APPROXIMATIONS]
    if unknown or not approximations:
        raise InvalidArgumentError(
            f"approximations must be a non-empty sequence of names from "
            f"{APPROXIMATIONS}; unknown: {unknown}."
        )
    return list(approximations)


def _check_mc_samples(mc_samples: object) -> list[int]:
    if isinstance(mc_samples, str) or not isinstance(mc_samples, Sequence):
        raise InvalidArgumentError(
            f"mc_samples must be a sequence of positive integers (one Monte-Carlo "
            f"row each, e.g. (1, 8)), got {mc_samples!r}."
        )
    for value in mc_samples:
        check_positive_int(value, "mc_samples", "Monte-Carlo samples of one row")
    return list(mc_samples)


def _default_blocks(model: Module, params: Sequence[Parameter]) -> list[list]:
    """One block per module that owns audited parameters (the first owner)."""
    audited, seen, blocks = {id(p) for p in params}, set(), []
    for module in model.modules():
        block = [
            p
            for p in module.parameters(recurse=False)
            if id(p) in audited and id(p) not in seen
        ]
        seen.update(id(p) for p in block)
        if block:
            blocks.append(block)
    return blocks


def _check_blocks(blocks: Sequence[Sequence[Parameter]], params) -> None:
    counts: dict[int, int] = {}
    for block in blocks:
        for p in block:
            counts[id(p)] = counts.get(id(p), 0) + 1
    if sorted(counts) != sorted(id(p) for p in params) or any(
        c != 1 for c in counts.values()
    ):
        raise ParamGroupError(
            "param_groups must partition the model's trainable parameters (each in "
            "exactly one group) for a block-diagonal approximation of the whole GGN; "
            "pass e.g. [[p] for p in model.parameters() if p.requires_grad]."
        )


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

    The exact GGN's top-k eigenpairs and damped Newton step come from
    :class:`~vivit.LowRankGGN`; each approximation's are compared with them
    (``docs/math.rst``, "Approximation audit"; the guide, "Auditing
    approximations"). The KFAC and EKFAC rows need curvlinops (``pip install
    'vivit[audit]'``): without it they say ``"not installed"``, and for a model
    with parameters outside ``Linear`` and ``Conv2d`` layers ``"unsupported"``.

    Args:
        model: The network (BatchNorm and dropout in eval mode).
        loss_func: ``MSELoss``, ``CrossEntropyLoss`` or ``BCEWithLogitsLoss``.
        data: The mini-batch ``(inputs, targets)``.
        top_k: Number of leading eigenpairs compared.
        damping: ``δ > 0`` of every damped Newton step.
        approximations: Which rows, from :data:`APPROXIMATIONS`.
        mc_samples: Monte-Carlo samples per datum, one ``"mc"`` row each.
        subsampling: Sample indices of ``"subsampled"`` (default: the first half
            of the batch, at least one sample).
        param_groups: Blocks of ``"block_diagonal"``, partitioning the trainable
            parameters (default: one block per module that owns parameters).
        seed: Seed of the Monte-Carlo samples.
        engine: As for :class:`~vivit.LowRankGGN`.
        gram_dtype: As for :class:`~vivit.LowRankGGN`.
        progress: Show a progress bar over the approximations.

    Returns:
        The table.

    Raises:
        InvalidArgumentError: For an unknown approximation, a ``top_k``, ``damping``
            or ``mc_samples`` that is not positive.
        ParamGroupError: If ``param_groups`` do not partition the parameters.
        VivitError: Whatever :class:`~vivit.LowRankGGN` raises for the model, the
            loss or the data.
    """
    names = _check_approximations(approximations)
    check_positive_int(top_k, "top_k", "leading eigenpairs compared")
    check_lr(damping, "damping")
    mc_counts = _check_mc_samples(mc_samples)
    inputs, targets = check_batch(data)
    params = [p for p in model.parameters() if p.requires_grad]
    num_samples = count_samples(inputs)
    subsampling = (
        list(range(max(1, num_samples // 2))) if subsampling is None else subsampling
    )
    blocks = _default_blocks(model, params) if param_groups is None else param_groups
    _check_blocks(blocks, params)

    def ggn(**options) -> LowRankGGN:
        return LowRankGGN(
            model,
            loss_func,
            (inputs, targets),
            engine=engine,
            gram_dtype=gram_dtype,
            progress=False,
            **{"param_groups": [params], **options},
        )

    started = time.perf_counter()
    exact_ggn = ggn()
    exact = low_rank_curvature(exact_ggn, params, top_k, damping)
    exact_time = time.perf_counter() - started
    gradient = flat_rows([g.unsqueeze(0) for g in exact_ggn.gradient()], 1)[0]

    def low_rank_row(**options) -> Callable[[], ApproximateCurvature]:
        return lambda: low_rank_curvature(ggn(**options), params, top_k, damping)

    def kronecker_row(kind: str) -> Callable[[], ApproximateCurvature]:
        return lambda: kronecker_factored_curvature(
            kind, model, loss_func, (inputs, targets), params, gradient, top_k, damping
        )

    single_rows = {
        "subsampled": (
            f"subsampled ({len(subsampling)} of {num_samples})",
            low_rank_row(subsampling=subsampling),
        ),
        "block_diagonal": (
            f"block-diagonal ({len(blocks)} blocks)",
            low_rank_row(param_groups=blocks),
        ),
        "diagonal": (
            "diagonal",
            lambda: diagonal_curvature(
                exact_diagonal(exact_ggn), gradient, top_k, damping
            ),
        ),
        **{kind: (kind.upper(), kronecker_row(kind)) for kind in KRONECKER_FACTORED},
    }
    jobs: list[tuple[str, str, Callable[[], ApproximateCurvature]]] = []
    for name in names:
        if name == "mc":  # one row per sample count, each from the seed
            jobs += [
                (
                    f"mc-{m}",
                    f"MC ({m} sample{'s' * (m > 1)})",
                    low_rank_row(
                        mc_samples=m,
                        generator=torch.Generator(params[0].device).manual_seed(seed),
                    ),
                )
                for m in mc_counts
            ]
        else:
            jobs.append((name, *single_rows[name]))

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
    """The row of one computed approximation."""
    cosines = principal_cosines(exact.vectors, approx.vectors)
    exact_norm = exact.step.norm()
    return AuditRow(
        name=name,
        label=label,
        eigenvalues=approx.values.tolist(),
        relative_errors=eigenvalue_errors(exact.values, approx.values).tolist(),
        principal_cosines=cosines.tolist(),
        principal_sines=principal_sines(cosines).tolist(),
        step_cosine=step_cosine(exact.step, approx.step),
        step_norm_ratio=float(approx.step.norm() / exact_norm)
        if exact_norm > 0
        else None,
        time_s=seconds,
    )
