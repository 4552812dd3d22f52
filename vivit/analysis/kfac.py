"""KFAC and EKFAC of the GGN from curvlinops, the optional extra ``vivit[audit]``.

``fisher_type="type-2"`` (the exact loss Hessian: the GGN, not a sampled Fisher);
the damped step is curvlinops' exactly damped inverse (``docs/math.rst``,
"Approximation audit").
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
    """Whether the ``curvlinops`` package is installed."""
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
    """Top-k eigenpairs and damped step of curvlinops' KFAC or EKFAC (``kind``).

    ``params``, ``top_k`` and ``damping`` as for
    :func:`vivit.analysis.approximations.low_rank_curvature`; ``gradient`` is the
    mini-batch ``data``'s ``g`` ``[D]`` in the order of ``params``. The result is
    float64, on the CPU.

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
