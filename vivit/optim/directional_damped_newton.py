"""Directionally damped Newton steps during backpropagation (ViViT-compatible)."""

from __future__ import annotations

from torch import Tensor

from vivit._validation import check_damping
from vivit.directional.gram_space import damped_newton_step
from vivit.groups import GroupCurvature
from vivit.optim.directional_derivatives import DirectionalDerivativesComputation


class DirectionalDampedNewtonComputation(DirectionalDerivativesComputation):
    """Provide a BackPACK extension and hook for directionally damped Newton steps.

    ``Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k`` over the eigenvectors each group's
    ``"criterion"`` selects, with ``γ̄_k`` the directional gradient of the loss on
    the gradient samples and ``δ_k`` from the group's ``"damping"``, a callable
    ``(evals [K], gram_evecs [N·C, K], gammas [N_grad, K], lambdas [N_ggn, K]) →
    [K]`` (see :mod:`vivit.optim.damping`) or, beyond ViViT, a constant ``δ ≥ 0``.
    The step is formed with one product with ``V``. Gram-space vectors are ordered
    sample-major (``n·C + c``).

    Arguments are those of :class:`DirectionalDerivativesComputation`.
    """

    required_keys = ("params", "criterion", "damping")
    keep_factors = True

    def get_extension_hook(self, param_groups: list[dict]):  # noqa: D102
        for group in param_groups:
            check_damping(group.get("damping"), name='group["damping"]')
        return super().get_extension_hook(param_groups)

    def compute(self, group: dict, curvature: GroupCurvature) -> list[Tensor]:
        """Compute the group's result from its curvature (see ``get_result``)."""
        gram_evecs, directional = self._directional(group, curvature)
        return damped_newton_step(
            curvature.ggn_factors, gram_evecs, directional, group["damping"]
        ).step

    def get_result(self, group: dict) -> list[Tensor]:
        """The damped Newton step of a group after the backward pass.

        Args:
            group: The parameter group.

        Returns:
            The step, one tensor per parameter, shaped like the parameter.

        Raises:
            ResultNotReadyError: If the backward pass has not run for this group.
        """
        return self._result(group)
