"""Spectral density of a symmetric PSD operator by stochastic Lanczos quadrature."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vivit._validation import check_positive_int
from vivit.errors import InvalidArgumentError, NonFiniteError
from vivit.linalg.operator import GGNOperator


@dataclass(frozen=True)
class SpectralDensity:
    """The quadrature measure of stochastic Lanczos quadrature; it counts eigenvalues.

    Attributes:
        nodes: ``[n_v, k]`` Ritz values per probe (zero-weight padding past its end).
        weights: ``[n_v, k]`` their weights, summing to ``dim``.
        dim: Side length ``n`` of the operator.
        lanczos_steps: Lanczos steps ``k`` per probe.
    """

    nodes: Tensor
    weights: Tensor
    dim: int
    lanczos_steps: int

    @property
    def probes(self) -> int:
        """The number of probe vectors ``n_v``."""
        return self.nodes.shape[0]

    def density(self, grid: Tensor, width: float) -> Tensor:
        """``ρ`` (eigenvalues per unit) on a 1-d grid, Gaussian kernel of width ``σ``.

        Raises:
            InvalidArgumentError: For a width that is not positive.
        """
        if not width > 0:
            raise InvalidArgumentError(f"width must be positive, got {width!r}.")
        grid = torch.as_tensor(grid)
        nodes = self.nodes.flatten().to(grid.dtype)
        weights = self.weights.flatten().to(grid.dtype)
        scaled = (grid[:, None] - nodes[None, :]) / width
        kernel = torch.exp(-0.5 * scaled.square()) / (width * math.sqrt(2 * math.pi))
        return kernel @ weights

    def count(self, threshold: float) -> float:
        """Estimated number of eigenvalues above ``threshold`` (the zero: a rank)."""
        return self.weights[self.nodes > threshold].sum().item()

    def trace(self) -> float:
        """Estimated trace ``Σ_j w_j θ_j``: Hutchinson's estimate with the probes."""
        return (self.weights * self.nodes).sum().item()


def spectral_density(
    operator: Tensor | GGNOperator | Callable[[Tensor], Tensor],
    *,
    lanczos_steps: int = 30,
    probes: int | Tensor = 10,
    seed: int = 0,
    dim: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> SpectralDensity:
    """The spectral measure of a symmetric PSD operator by stochastic Lanczos.

    All probes at once, fully reorthogonalized (``docs/math.rst``, "Spectral density
    by stochastic Lanczos quadrature"); memory ``k·n·n_v`` numbers.

    Args:
        operator: A symmetric ``[n, n]`` tensor, an object with ``matvec`` on
            ``[n, b]`` blocks, ``shape``, ``dtype`` and ``device`` (e.g.
            :meth:`vivit.LowRankGGN.operator`'s), or a callable on ``[n, b]`` blocks.
        lanczos_steps: Lanczos steps ``k`` per probe (at most ``n`` run).
        probes: Number ``n_v`` of random unit probes, or an ``[n, n_v]`` tensor.
        seed: Seed of the random probes.
        dim: ``n``, required for a callable operator.
        dtype: Type of the probes for a callable (default: torch's default).
        device: Device of the probes for a callable (default: CPU).

    Returns:
        The quadrature measure (weights summing to ``n``).

    Raises:
        InvalidArgumentError: For a malformed operator, probes or counts.
        NonFiniteError: If a product returns NaN or infinity.
    """
    check_positive_int(lanczos_steps, "lanczos_steps", "Lanczos steps per probe")
    matmul, size, probe_dtype, probe_device = _as_matmul(operator, dim, dtype, device)
    start = _probes(probes, size, seed, probe_dtype, probe_device)
    steps = min(lanczos_steps, size)
    alphas, betas, lengths = _lanczos(matmul, start, steps)
    nodes = torch.zeros(start.shape[1], steps, dtype=start.dtype)
    weights = torch.zeros_like(nodes)
    for i, length in enumerate(lengths):
        tridiagonal = torch.diag(alphas[:length, i])
        off = betas[: length - 1, i]
        tridiagonal += torch.diag(off, 1) + torch.diag(off, -1)
        ritz, vectors = torch.linalg.eigh(tridiagonal)
        nodes[i, :length] = ritz
        weights[i, :length] = vectors[0].square() * (size / start.shape[1])
    return SpectralDensity(nodes, weights, size, steps)


def _as_matmul(
    operator: object,
    dim: int | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> tuple[Callable[[Tensor], Tensor], int, torch.dtype, torch.device]:
    """``X ↦ A X`` on ``[n, b]`` blocks, ``n``, and the probes' type and device."""
    if isinstance(operator, Tensor):
        shape = list(operator.shape)
        if len(shape) != 2 or shape[0] != shape[1] or not operator.is_floating_point():
            raise InvalidArgumentError(
                "A matrix operator must be square and floating-point, got shape "
                f"{shape} of {operator.dtype}."
            )
        matrix = operator.detach()
        return matrix.__matmul__, matrix.shape[0], matrix.dtype, matrix.device
    if hasattr(operator, "matvec") and hasattr(operator, "shape"):
        device = torch.device(operator.device)
        return operator.matvec, operator.shape[0], operator.dtype, device
    if callable(operator):
        check_positive_int(dim, "dim", "side length of a callable operator")
        dtype, device = dtype or torch.get_default_dtype(), device or "cpu"
        return operator, dim, dtype, torch.device(device)
    raise InvalidArgumentError(
        "operator must be a square tensor, an object with matvec and shape (e.g. "
        f"LowRankGGN.operator()) or a callable with dim, got {type(operator).__name__}."
    )


def _probes(
    probes: int | Tensor, size: int, seed: int, dtype: torch.dtype, device
) -> Tensor:
    """``[n, n_v]`` unit probes: given, or uniform on the sphere from ``seed``."""
    if isinstance(probes, Tensor):
        if probes.dim() != 2 or probes.shape[0] != size or probes.shape[1] == 0:
            raise InvalidArgumentError(
                f"probes must be an [{size}, n_v] tensor (one column per probe), "
                f"got shape {list(probes.shape)}."
            )
        norms = probes.norm(dim=0)
        if not (norms.isfinite() & (norms > 0)).all():
            raise InvalidArgumentError("Every probe must be finite and non-zero.")
    else:
        check_positive_int(probes, "probes", "number of random probe vectors")
        generator = torch.Generator().manual_seed(seed)
        probes = torch.randn(size, probes, generator=generator, dtype=torch.float64)
    return (probes / probes.norm(dim=0)).to(device, dtype)


def _lanczos(
    matmul: Callable[[Tensor], Tensor], start: Tensor, steps: int
) -> tuple[Tensor, Tensor, list[int]]:
    """``α [k, n_v]``, ``β [k, n_v]`` and each probe's steps (fewer once exhausted)."""
    size, count = start.shape
    basis = torch.zeros(steps, size, count, dtype=start.dtype, device=start.device)
    alphas = torch.zeros(steps, count, dtype=start.dtype)
    betas = torch.zeros(steps, count, dtype=start.dtype)
    lengths = [steps] * count
    active = torch.ones(count, dtype=torch.bool, device=start.device)
    basis[0] = start
    scale = torch.zeros(count, dtype=start.dtype, device=start.device)
    eps = torch.finfo(start.dtype).eps
    for j in range(steps):
        product = matmul(basis[j])
        if not torch.isfinite(product).all():
            raise NonFiniteError(
                f"The operator returned NaN or inf in Lanczos step {j}."
            )
        alpha = (basis[j] * product).sum(0)
        for _ in range(2):  # twice is enough (Giraud et al.)
            earlier = basis[: j + 1]
            product -= torch.einsum(
                "jnb,jb->nb", earlier, torch.einsum("jnb,nb->jb", earlier, product)
            )
        beta = product.norm(dim=0)
        scale = torch.maximum(scale, alpha.abs() + beta)
        alphas[j] = torch.where(active, alpha, 0).cpu()
        if j + 1 == steps:
            break
        ended = active & (beta <= size * eps * scale)
        for i in ended.nonzero().flatten().tolist():
            lengths[i] = j + 1
        active &= ~ended
        betas[j] = torch.where(active, beta, 0).cpu()
        basis[j + 1] = torch.where(active, product / beta.clamp_min(eps), 0)
    return alphas, betas, lengths


def wasserstein_distance(density: SpectralDensity, eigenvalues: Tensor) -> float:
    """Wasserstein-1 distance ``∫ |F_SLQ(x) − F(x)| dx`` of the probability measures.

    Args:
        density: The quadrature measure.
        eigenvalues: All ``n`` eigenvalues of the operator.

    Returns:
        The distance, in the eigenvalues' units.

    Raises:
        InvalidArgumentError: If the number of eigenvalues is not ``dim``.
    """
    if eigenvalues.numel() != density.dim:
        raise InvalidArgumentError(
            f"Pass all {density.dim} eigenvalues of the operator, got "
            f"{eigenvalues.numel()}."
        )
    exact = eigenvalues.detach().flatten().to(torch.float64).cpu()
    nodes = density.nodes.flatten().double().cpu()
    weights = density.weights.flatten().double().cpu()
    points = torch.cat([nodes, exact])
    masses = torch.cat([weights, -torch.ones_like(exact)]) / density.dim
    order = points.argsort()
    difference = masses[order].cumsum(0)[:-1]
    return (difference.abs() * points[order].diff()).sum().item()


def wasserstein_bound(
    dim: int,
    lanczos_steps: int,
    probes: int,
    spread: float,
    failure_probability: float = 1e-3,
) -> float:
    """Chen, Trogdon and Ubaru's bound on the Wasserstein-1 error of SLQ.

    Holds with probability at least ``1 − η``, in exact arithmetic (``docs/math.rst``,
    "Spectral density by stochastic Lanczos quadrature").

    Args:
        dim: Side length ``n`` of the operator.
        lanczos_steps: ``k``.
        probes: ``n_v``.
        spread: ``λ_max − λ_min`` or an upper bound (``λ_max`` if PSD).
        failure_probability: ``η``.

    Raises:
        InvalidArgumentError: If a count is not a positive int or ``η`` not in (0, 1).
    """
    for value, name in (
        (dim, "dim"),
        (lanczos_steps, "lanczos_steps"),
        (probes, "probes"),
    ):
        check_positive_int(value, name)
    if not 0 < failure_probability < 1:
        raise InvalidArgumentError(
            f"failure_probability must lie in (0, 1), got {failure_probability!r}."
        )
    quadrature = 0.0 if lanczos_steps >= dim else 12 / (2 * lanczos_steps - 1)
    sampling = math.sqrt(math.log(2 * dim / failure_probability) / ((dim + 2) * probes))
    return spread * (quadrature + sampling)
