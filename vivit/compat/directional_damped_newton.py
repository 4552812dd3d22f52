"""Directionally damped Newton steps during backpropagation (ViViT-compatible)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from vivit._validation import check_damping
from vivit.compat.directional_derivatives import DirectionalDerivativesComputation
from vivit.compat.selection import to_class_major
from vivit.directional.gram_space import damped_step_sizes
from vivit.linalg.group_products import v_matmul
from vivit.sources.collector import GroupCurvature


class DirectionalDampedNewtonComputation(DirectionalDerivativesComputation):
    """Provide a BackPACK extension and hook for directionally damped Newton steps.

    The step along the eigenvectors each group's ``"criterion"`` selects
    (``docs/math.rst``, "Damped Newton step in the eigenspace"), with ``δ_k`` from
    the group's ``"damping"``: a callable ``(evals [K], gram_evecs [N·C, K],
    gammas [N_grad, K], lambdas [N_ggn, K]) → [K]`` (:mod:`vivit.optim.damping`;
    ``gram_evecs`` class-major, ``docs/migration.rst``) or a constant ``δ ≥ 0``.

    Arguments are those of :class:`DirectionalDerivativesComputation`.
    """

    required_keys = ("params", "criterion", "damping")
    keep_factors = True

    def get_extension_hook(self, param_groups: list[dict]):  # noqa: D102
        for group in param_groups:
            check_damping(group.get("damping"), name='group["damping"]')
        return super().get_extension_hook(param_groups)

    def compute(self, group: dict, curvature: GroupCurvature) -> list[Tensor]:
        """The damped Newton step of the group.

        Returns:
            The step, one tensor per parameter, shaped like it and in its dtype.
        """
        selection, directional = self._directional(group, curvature)
        damping, evals = group["damping"], selection.evals
        if callable(damping):
            class_major = to_class_major(
                selection.gram_evecs, curvature.batch.columns_per_sample
            )
            dampings = (
                damping(evals, class_major, directional.gammas, directional.lambdas)
                if evals.numel()
                else evals.new_zeros(0)
            )
            damping = lambda *_: dampings  # noqa: E731 (already evaluated)
        # Zero-vector directions (γ̄ = 0, zero coefficients) get a zero step; a
        # placeholder eigenvalue 1 keeps the step's division by √λ finite there.
        resolved = selection.resolved
        evals = torch.where(resolved, evals, 1.0)
        directional = dataclasses.replace(directional, evals=evals)
        gram_evecs = selection.gram_evecs * resolved
        _, sizes = damped_step_sizes(gram_evecs, directional, damping, stacklevel=3)
        u = gram_evecs @ (sizes / evals.sqrt())
        step = v_matmul(curvature.ggn_factors, u.unsqueeze(0))
        return curvature.in_param_dtypes([s.squeeze(0) for s in step])
