"""One-call access to the GGN's low-rank structure of a mini-batch."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from backpack import backpack
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_param_groups, check_subsampling
from vivit.directional import gram_space
from vivit.directional.gram_space import (
    Damping,
    damped_newton_step,
)
from vivit.directional.results import DirectionalDerivatives, NewtonStep
from vivit.engines.backpack import GramGGN, extended
from vivit.groups import GroupCollector, GroupCurvature, gradient_cross_gram
from vivit.linalg.solvers import (
    check_top_k,
    gram_eigh,
    gram_eigh_top,
    gram_to_param,
    top_k_indices,
)


class LowRankGGN:
    """The GGN of a mini-batch through its Gram matrix, from one backward pass.

    Runs the forward and backward pass at construction and keeps, per parameter
    group, the Gram matrix ``Vᵀ V`` and the layer factors needed to map Gram-space
    vectors to parameter space. ``model`` and ``loss_func`` are left as they were:
    the BackPACK hooks the pass needs are removed again (hooks the caller installed
    with ``backpack.extend`` stay), and the parameters' ``.grad`` are unchanged.

    Example::

        ggn = LowRankGGN(model, CrossEntropyLoss(), (X, y))
        evals, evecs = ggn.eigh(top_k=10)

    Args:
        model: The network. BatchNorm layers must be in eval mode. A custom
            forward (residual blocks) is converted internally by BackPACK's
            converter; a layer or function BackPACK cannot backpropagate through,
            or a weight used twice in the forward pass, raises
            :class:`~vivit.UnsupportedLayerError` (:class:`~vivit.SharedWeightError`)
            naming it.
        loss_func: A ``torch.nn`` loss module (MSELoss, CrossEntropyLoss,
            BCEWithLogitsLoss) with ``reduction`` ``"mean"`` or ``"sum"``.
        data: ``(inputs, targets)`` of the mini-batch.
        param_groups: Lists of parameters, one GGN block each (block-diagonal
            approximation); ``None`` uses one group with every trainable parameter.
        mc_samples: ``0`` for the exact GGN; ``M > 0`` for its unbiased
            Monte-Carlo estimate with ``M`` samples per datum (``N·M`` instead of
            ``N·C`` Gram rows).
        subsampling: Indices of the samples whose curvature is used (``None``:
            all). The GGN is then that of the same loss on those samples alone.
        generator: Random generator that makes MC sampling reproducible.

    Attributes:
        loss: The mini-batch loss (detached).
        param_groups: The parameter groups, as lists of parameters.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: tuple[Tensor, Tensor],
        *,
        param_groups: Sequence[Sequence[Parameter]] | None = None,
        mc_samples: int = 0,
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ):
        inputs, targets = data
        if param_groups is None:
            param_groups = [[p for p in model.parameters() if p.requires_grad]]
        check_subsampling(subsampling, inputs.shape[0])
        with extended(model, loss_func) as (net, loss_module):
            self._backward(
                lambda: loss_module(net(inputs), targets),
                param_groups,
                mc_samples,
                subsampling,
                generator,
            )

    @classmethod
    def from_loss(
        cls,
        loss: Tensor | Callable[[], Tensor],
        param_groups: Sequence[Sequence[Parameter]],
        *,
        mc_samples: int = 0,
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> LowRankGGN:
        """Build from a loss computed by BackPACK-extended model and loss modules.

        For use where the forward pass happens elsewhere (e.g. an optimizer's
        closure). The caller must have extended the model and the loss function
        with ``backpack.extend``.

        Args:
            loss: The mini-batch loss, or a function that computes it.
            param_groups: Lists of parameters, one GGN block each.
            mc_samples: As for the constructor.
            subsampling: As for the constructor.
            generator: As for the constructor.

        Returns:
            The low-rank GGN of that loss.
        """
        ggn = cls.__new__(cls)
        ggn._backward(
            loss if callable(loss) else lambda: loss,
            param_groups,
            mc_samples,
            subsampling,
            generator,
        )
        return ggn

    def _backward(
        self,
        compute_loss: Callable[[], Tensor],
        param_groups: Sequence[Sequence[Parameter]],
        mc_samples: int,
        subsampling: Sequence[int] | None,
        generator: torch.Generator | None,
    ) -> None:
        """Run the backward pass and keep each group's curvature."""
        self.param_groups = [list(group) for group in param_groups]
        check_param_groups([{"params": g} for g in self.param_groups], ("params",))
        extension = GramGGN(
            mc_samples=mc_samples,
            subsampling=subsampling,
            compute_gradients=True,
            num_grams=len(self.param_groups),
        )
        self._curvature: dict[int, GroupCurvature] = {}
        self._decompositions: dict[int, tuple[Tensor, Tensor]] = {}
        self._leading: dict[int, tuple[Tensor, Tensor]] = {}
        self._vt_grads_cache: dict[tuple, Tensor] = {}
        collector = GroupCollector(
            self.param_groups,
            self._curvature.__setitem__,
            keep_factors=True,
            keep_gradient_factors=True,
        )
        params = [p for group in self.param_groups for p in group]
        grads = [p.grad for p in params]
        for param in params:  # autograd would accumulate into them in place
            param.grad = None
        seed = None
        if mc_samples and generator is not None:
            seed = int(torch.randint(2**62, (), generator=generator))
        devices = [params[0].device] if params[0].device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            loss = compute_loss()
            if loss.numel() != 1:
                raise ValueError(
                    f"The loss has shape {tuple(loss.shape)}; the GGN is defined for a "
                    "scalar loss: use reduction='mean' or 'sum'."
                )
            with (
                backpack(extension, extension_hook=collector),
                warnings.catch_warnings(),
            ):
                # BackPACK's hooks fire on the first layer, whose input needs no grad.
                warnings.filterwarnings(
                    "ignore", message="Full backward hook is firing"
                )
                loss.backward()
        self._gradients = [
            [torch.zeros_like(p) if p.grad is None else p.grad for p in group]
            for group in self.param_groups
        ]
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        self.loss = loss.detach()

        missing = [g for g in range(len(self.param_groups)) if g not in self._curvature]
        if missing:
            raise RuntimeError(
                f"Parameter group(s) {missing} received no curvature from the backward "
                f"pass ({collector.num_missing(missing[0])} parameter(s) of group "
                f"{missing[0]} missing): their layers are not part of the loss's "
                "computation graph, or not extended with backpack.extend."
            )

    # Gram space ---------------------------------------------------------------
    def _group(self, group: int) -> GroupCurvature:
        if not isinstance(group, int) or not 0 <= group < len(self.param_groups):
            raise IndexError(
                f"group must be an index in [0, {len(self.param_groups)}), "
                f"got {group!r}."
            )
        return self._curvature[group]

    def gram(self, group: int = 0) -> Tensor:
        """The Gram matrix ``Vᵀ V`` of a group.

        Args:
            group: Index of the parameter group.

        Returns:
            ``[N·C, N·C]`` (``N·M`` with MC), rows and columns ordered sample-major:
            entry ``n·C + c`` is output ``c`` of sample ``n`` (of the subsampling).
        """
        return self._group(group).gram

    def _gram_eigh(self, group: int) -> tuple[Tensor, Tensor]:
        if group not in self._decompositions:
            self._decompositions[group] = gram_eigh(self.gram(group))
        return self._decompositions[group]

    def eigvalsh(self, group: int = 0) -> Tensor:
        """All eigenvalues of the Gram matrix: the GGN's non-zero spectrum.

        Args:
            group: Index of the parameter group.

        Returns:
            ``[N·C]`` eigenvalues, ascending (those below the numerical-zero
            tolerance are zeros of the GGN).
        """
        return self._gram_eigh(group)[0]

    def _directions(self, top_k: int | None, group: int) -> tuple[Tensor, Tensor]:
        """The ``top_k`` leading numerically non-zero eigenpairs of the Gram matrix.

        Uses the full decomposition if it exists or is needed; otherwise computes
        (and caches) only the leading eigenpairs.
        """
        check_top_k(top_k)
        size = self.gram(group).shape[0]
        if top_k is None or group in self._decompositions:
            evals, evecs = self._gram_eigh(group)
        else:
            leading = self._leading.get(group)
            if leading is None or leading[0].numel() < min(top_k, size):
                leading = gram_eigh_top(self.gram(group), top_k)
                self._leading[group] = leading
            evals, evecs = leading
        keep = top_k_indices(evals, top_k, size)
        return evals[keep], evecs[:, keep]

    def eigh(
        self, top_k: int | None = None, group: int = 0
    ) -> tuple[Tensor, list[Tensor]]:
        """Leading eigenpairs of the GGN.

        Args:
            top_k: Number of leading eigenpairs; ``None`` keeps every eigenvalue
                above the numerical-zero tolerance. Fewer are returned if fewer
                are non-zero; no eigenvector is formed for a numerically zero one.
            group: Index of the parameter group.

        Returns:
            Eigenvalues ``[K]`` ascending, and eigenvectors as one tensor
            ``[K, *p.shape]`` per parameter of the group (unit norm over the group).
        """
        evals, gram_evecs = self._directions(top_k, group)
        return evals, gram_to_param(self._group(group).ggn_factors, gram_evecs, evals)

    # Gradient and directional derivatives -----------------------------------
    def gradient(self, group: int = 0) -> list[Tensor]:
        """The mini-batch gradient ``∇L`` from the same backward pass.

        Args:
            group: Index of the parameter group.

        Returns:
            One tensor per parameter of the group, shaped like it (gradient of the
            loss on the whole mini-batch, whatever the curvature subsampling).
        """
        self._group(group)
        return self._gradients[group]

    def _vt_grads(self, group: int, subsampling_grad: Sequence[int] | None) -> Tensor:
        """``Vᵀ∇ℓ_n`` of the gradient samples, ``[N·C, N_grad]``, cached per samples."""
        curvature = self._group(group)
        samples = check_subsampling(
            subsampling_grad, curvature.batch.batch_size, "subsampling_grad"
        )
        key = (group, None if samples is None else tuple(samples))
        if key not in self._vt_grads_cache:
            self._vt_grads_cache[key] = sum(
                gradient_cross_gram(ggn, grad, samples)
                for ggn, grad in zip(
                    curvature.ggn_factors, curvature.grad_factors, strict=True
                )
            )
        return self._vt_grads_cache[key]

    def _directional(
        self, top_k: int | None, group: int, subsampling_grad: Sequence[int] | None
    ) -> tuple[Tensor, DirectionalDerivatives]:
        evals, gram_evecs = self._directions(top_k, group)
        vt_grads = self._vt_grads(group, subsampling_grad)
        batch = self._group(group).batch
        directional = gram_space.directional_derivatives(
            vt_grads, gram_evecs, evals, batch
        )
        return gram_evecs, directional

    def directional_derivatives(
        self,
        top_k: int | None = None,
        group: int = 0,
        subsampling_grad: Sequence[int] | None = None,
    ) -> DirectionalDerivatives:
        """Per-sample first and second derivatives along the leading eigenvectors.

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).

        Returns:
            ``γ [N_grad, K]``, ``λ [N_ggn, K]`` and their per-direction statistics.
        """
        return self._directional(top_k, group, subsampling_grad)[1]

    def newton(
        self,
        top_k: int | None = None,
        group: int = 0,
        damping: float | Damping = 1.0,
        subsampling_grad: Sequence[int] | None = None,
    ) -> NewtonStep:
        """The directionally damped Newton step with its ingredients.

        ``Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k`` over the leading eigenvectors, with
        ``γ̄_k`` the directional gradient of the loss on the gradient samples. The
        step is one product of ``V`` with a Gram-space vector.

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            damping: A constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs,
                gammas, lambdas) → [K]`` (see :mod:`vivit.optim.damping`).
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).

        Returns:
            The step, the directional derivatives, ``γ̄`` and the dampings.
        """
        gram_evecs, directional = self._directional(top_k, group, subsampling_grad)
        factors = self._group(group).ggn_factors
        return damped_newton_step(factors, gram_evecs, directional, damping)

    def newton_step(
        self,
        top_k: int | None = None,
        group: int = 0,
        damping: float | Damping = 1.0,
        subsampling_grad: Sequence[int] | None = None,
    ) -> list[Tensor]:
        """The directionally damped Newton step on the leading eigenspace.

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            damping: A constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs,
                gammas, lambdas) → [K]`` (see :mod:`vivit.optim.damping`).
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).

        Returns:
            The step (see :meth:`newton`), one tensor per parameter, shaped like it.
        """
        return self.newton(top_k, group, damping, subsampling_grad).step
