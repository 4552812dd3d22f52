"""KFAC and EKFAC of the GGN from curvlinops, the optional extra ``vivit[audit]``.

Nothing here approximates the GGN itself: curvlinops' ``KFACLinearOperator`` and
``EKFACLinearOperator`` (``fisher_type="type-2"``: the exact loss Hessian, so
they approximate the GGN, not a sampled Fisher) give the matrix, its leading
eigenpairs come from :func:`vivit.linalg.iterative.block_krylov_eigh` on its
products, and its damped Newton step from curvlinops'
``KFACInverseLinearOperator`` with exact damping, ``(K + δI)⁻¹``
(``docs/math.rst``, "Approximation audit").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from torch import Tensor
from torch.nn import Module, Parameter

from vivit.analysis.approximations import ApproximateCurvature, flat_rows
from vivit.linalg.iterative import block_krylov_eigh

#: The approximations of this module and curvlinops' class of each.
KRONECKER_FACTORED = {"kfac": "KFACLinearOperator", "ekfac": "EKFACLinearOperator"}

#: What a row says when curvlinops is missing.
NOT_INSTALLED = "pip install 'vivit[audit]' (curvlinops-for-pytorch) for this row"


def curvlinops_installed() -> bool:
    """Whether curvlinops can be imported.

    Returns:
        ``True`` if the ``curvlinops`` package is installed.
    """
    return importlib.util.find_spec("curvlinops") is not None


class CurvlinopsRefusalError(Exception):
    """curvlinops cannot build the approximation for this model (its reason)."""


def kronecker_factored_curvature(
    kind: str,
    model: Module,
    loss_func: Module,
    data: tuple[Tensor, Tensor],
    params: Sequence[Parameter],
    gradient: Tensor,
    top_k: int,
    damping: float,
) -> ApproximateCurvature:
    """Top-k eigenpairs and damped step of curvlinops' KFAC or EKFAC.

    Args:
        kind: ``"kfac"`` or ``"ekfac"``.
        model: The model.
        loss_func: The loss module.
        data: The mini-batch ``(inputs, targets)``.
        params: All audited parameters, in the order of the flattened vectors.
        gradient: The mini-batch gradient ``g`` ``[D]`` in that order.
        top_k: Number of leading eigenpairs.
        damping: ``δ > 0``.

    Returns:
        The approximation's curvature (float64, CPU).

    Raises:
        CurvlinopsRefusalError: If curvlinops refuses the model (parameters
            outside ``Linear`` and ``Conv2d`` layers).
    """
    import curvlinops

    operator_class = getattr(curvlinops, KRONECKER_FACTORED[kind])
    try:
        operator = operator_class(
            model,
            loss_func,
            list(params),
            [data],
            fisher_type=curvlinops.FisherType.TYPE2,
            check_deterministic=False,
        )
    except NotImplementedError as error:
        raise CurvlinopsRefusalError(
            f"curvlinops' {kind.upper()} supports parameters of Linear and Conv2d "
            f"layers only ({error})"
        ) from None
    reference = params[0]
    size = sum(p.numel() for p in params)
    values, vectors, _ = block_krylov_eigh(
        lambda block: operator @ block,
        size,
        top_k,
        dtype=reference.dtype,
        device=reference.device,
    )
    inverse = curvlinops.KFACInverseLinearOperator(
        operator, damping=damping, use_exact_damping=True
    )
    step = inverse @ gradient.to(reference.device, reference.dtype)
    return ApproximateCurvature(
        values=values.flip(0).double().cpu(),
        vectors=flat_rows([vectors.T.flip(0)], vectors.shape[1]).cpu(),
        step=-step.double().cpu(),
    )
