"""One-call access to the GGN's low-rank structure of a mini-batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_param_groups, check_subsampling
from vivit.directional import gram_space
from vivit.directional.gram_space import (
    Damping,
    damped_newton_step,
)
from vivit.directional.results import DirectionalDerivatives, NewtonStep
from vivit.engines.base import CurvatureRequest, Engine, EngineOutput
from vivit.engines.choice import check_engine, resolve_engine
from vivit.groups import GroupCollector, GroupCurvature
from vivit.linalg.solvers import gram_to_param


class LowRankGGN:
    """The GGN of a mini-batch through its Gram matrix, from one backward pass.

    Runs the forward and backward pass at construction and keeps, per parameter
    group, the Gram matrix ``Vᵀ V`` and the layer factors needed to map Gram-space
    vectors to parameter space. ``model`` and ``loss_func`` are left as they were
    (whatever hooks an engine needs are removed again; hooks the caller installed
    with ``backpack.extend`` stay), and the parameters' ``.grad`` are unchanged.

    An engine computes the factors (see :doc:`/architecture`): ``"backpack"``
    (BackPACK's layers, composed by ``nn.Sequential`` or a custom forward its
    converter handles); ``"func"`` (any model whose samples are independent:
    transformers, LSTMs, shared weights, GroupNorm); ``"auto"`` picks BackPACK when
    it supports the model and no weight is shared, else func, and logs the choice
    (logger ``"vivit"``, level INFO).

    Example::

        ggn = LowRankGGN(model, CrossEntropyLoss(), (X, y))
        evals, evecs = ggn.eigh(top_k=10)

    Args:
        model: The network. BatchNorm and dropout layers must be in eval mode.
            With ``engine="backpack"``, a layer or function BackPACK cannot
            backpropagate through, or a weight used twice in the forward pass,
            raises :class:`~vivit.UnsupportedLayerError`
            (:class:`~vivit.SharedWeightError`) naming it.
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
        engine: ``"auto"``, ``"backpack"``, ``"func"``, or an engine instance
            (e.g. ``vivit.engines.func.FuncEngine(memory_budget=...)``).

    Attributes:
        loss: The mini-batch loss (detached).
        param_groups: The parameter groups, as lists of parameters.
        engine: Name of the engine that ran (``"backpack"`` or ``"func"``).
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
        engine: str | Engine = "auto",
    ):
        inputs, targets = data
        if param_groups is None:
            param_groups = [[p for p in model.parameters() if p.requires_grad]]
        check_subsampling(subsampling, inputs.shape[0])
        check_engine(engine)
        request = self._request(param_groups, mc_samples, subsampling, generator)
        chosen = resolve_engine(engine, model, loss_func)
        self._run(
            chosen.name,
            lambda sink: chosen.run(model, loss_func, data, request, sink),
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
        closure); always uses the BackPACK engine, whose backward pass starts from
        the loss. The caller must have extended the model and the loss function
        with ``backpack.extend``. Engines that need the model (func) take the
        constructor's ``(model, loss_func, data)`` instead.

        Args:
            loss: The mini-batch loss, or a function that computes it.
            param_groups: Lists of parameters, one GGN block each.
            mc_samples: As for the constructor.
            subsampling: As for the constructor.
            generator: As for the constructor.

        Returns:
            The low-rank GGN of that loss.
        """
        from vivit.engines.backpack import BackpackEngine

        ggn = cls.__new__(cls)
        request = ggn._request(param_groups, mc_samples, subsampling, generator)
        compute_loss = loss if callable(loss) else lambda: loss
        ggn._run(
            BackpackEngine.name,
            lambda sink: BackpackEngine().run_loss(compute_loss, request, sink),
        )
        return ggn

    def _request(
        self,
        param_groups: Sequence[Sequence[Parameter]],
        mc_samples: int,
        subsampling: Sequence[int] | None,
        generator: torch.Generator | None,
    ) -> CurvatureRequest:
        """Validate the groups and describe what the engine must compute."""
        self.param_groups = [list(group) for group in param_groups]
        check_param_groups([{"params": g} for g in self.param_groups], ("params",))
        return CurvatureRequest(
            param_groups=self.param_groups,
            mc_samples=mc_samples,
            subsampling=check_subsampling(subsampling),
            generator=generator,
            compute_gradients=True,
        )

    def _run(self, engine: str, run: Callable[[GroupCollector], EngineOutput]) -> None:
        """Run an engine into the group pipeline and keep each group's curvature."""
        self.engine = engine
        self._curvature: dict[int, GroupCurvature] = {}
        collector = GroupCollector(
            self.param_groups,
            self._curvature.__setitem__,
            keep_factors=True,
            keep_gradient_factors=True,
        )
        output = run(collector)
        self.loss = output.loss
        gradients = iter(output.gradients)
        self._gradients = [[next(gradients) for _ in g] for g in self.param_groups]
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

    def eigvalsh(self, group: int = 0) -> Tensor:
        """All eigenvalues of the Gram matrix: the GGN's non-zero spectrum.

        Args:
            group: Index of the parameter group.

        Returns:
            ``[N·C]`` eigenvalues, ascending (those below the numerical-zero
            tolerance are zeros of the GGN).
        """
        return self._group(group).decomposition()[0]

    def _directions(self, top_k: int | None, group: int) -> tuple[Tensor, Tensor]:
        """The ``top_k`` leading numerically non-zero eigenpairs of the Gram matrix."""
        return self._group(group).top_k(top_k)

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
        return self._group(group).gradient_products(subsampling_grad)

    def _directional(
        self, top_k: int | None, group: int, subsampling_grad: Sequence[int] | None
    ) -> tuple[Tensor, DirectionalDerivatives]:
        evals, gram_evecs = self._directions(top_k, group)
        vt_grads = self._vt_grads(group, subsampling_grad)
        batch = self._group(group).batch
        directional = gram_space.directional_derivatives(
            vt_grads, gram_evecs, evals, batch, subsampling_grad
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
