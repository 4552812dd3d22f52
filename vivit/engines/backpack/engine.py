"""The BackPACK engine behind the engine seam.

:class:`BackpackEngine` runs one backward pass inside ``backpack(GramGGN(...))``;
:class:`ContributionHook` is the BackPACK extension hook that takes each
parameter's :class:`~vivit.engines.base.ParamContribution` off the parameter (where
the extension saved it) and hands it to the group pipeline.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from backpack import backpack
from torch import Tensor
from torch.nn import Module

from vivit.engines.backpack.extension import SAVEFIELD, GramGGN
from vivit.engines.backpack.hooks import extended
from vivit.engines.base import (
    ContributionSink,
    CurvatureRequest,
    Engine,
    EngineOutput,
    ParamContribution,
)


class ContributionHook:
    """BackPACK extension hook: forward each parameter's contribution to a sink.

    Args:
        sink: The group pipeline.
    """

    def __init__(self, sink: ContributionSink):
        self.sink = sink

    def __call__(self, module: Module) -> None:
        """Hand on the contributions of a layer's parameters.

        Args:
            module: The layer BackPACK just processed.
        """
        for param in module.parameters(recurse=False):
            contribution: ParamContribution | None = getattr(param, SAVEFIELD, None)
            if contribution is None:
                continue
            delattr(param, SAVEFIELD)
            self.sink.add(param, contribution)


class BackpackEngine(Engine):
    """Curvature factors from BackPACK's second-order backward pass.

    :meth:`run` installs BackPACK's hooks for the one backward pass and removes
    them again (:func:`~vivit.engines.backpack.hooks.extended`), converting a custom
    forward if needed; :meth:`run_loss` backpropagates a loss computed by modules
    the caller extended.
    """

    name = "backpack"

    def run(  # noqa: D102
        self,
        model: Module,
        loss_func: Module,
        data: tuple[Tensor, Tensor],
        request: CurvatureRequest,
        sink: ContributionSink,
    ) -> EngineOutput:
        inputs, targets = data
        with extended(model, loss_func) as (net, loss_module):
            return self.run_loss(
                lambda: loss_module(net(inputs), targets), request, sink
            )

    def run_loss(
        self,
        compute_loss: Callable[[], Tensor],
        request: CurvatureRequest,
        sink: ContributionSink,
    ) -> EngineOutput:
        """Run the backward pass of a loss computed by extended modules.

        Args:
            compute_loss: Computes the mini-batch loss through modules extended
                with ``backpack.extend``.
            request: Parameter groups and curvature options.
            sink: Receives every requested parameter's contribution.

        Returns:
            The loss and the mini-batch gradient.

        Raises:
            ValueError: If the loss is not a scalar.
        """
        extension = GramGGN(
            mc_samples=request.mc_samples,
            subsampling=request.subsampling,
            compute_gradients=request.compute_gradients,
            num_grams=len(request.param_groups),
        )
        params = request.params
        grads = [p.grad for p in params]
        for param in params:  # autograd would accumulate into them in place
            param.grad = None
        seed = None
        if request.mc_samples and request.generator is not None:
            seed = int(torch.randint(2**62, (), generator=request.generator))
        devices = [params[0].device] if params[0].device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices, enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(seed)
                loss = compute_loss()
                if loss.numel() != 1:
                    raise ValueError(
                        f"The loss has shape {tuple(loss.shape)}; the GGN is defined "
                        "for a scalar loss: use reduction='mean' or 'sum'."
                    )
                with (
                    backpack(extension, extension_hook=ContributionHook(sink)),
                    warnings.catch_warnings(),
                ):
                    # BackPACK's hooks fire on the first layer, whose input needs no
                    # grad.
                    warnings.filterwarnings(
                        "ignore", message="Full backward hook is firing"
                    )
                    loss.backward()
            gradients = [
                torch.zeros_like(p) if p.grad is None else p.grad for p in params
            ]
        finally:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
        return EngineOutput(loss=loss.detach(), gradients=gradients)
