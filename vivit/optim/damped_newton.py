"""A ``torch.optim.Optimizer`` that takes directionally damped Newton steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from vivit._validation import (
    check_damping,
    check_finite,
    check_generator,
    check_grad_mode,
    check_mc_samples,
    check_params,
    check_subsampling,
    optimizer_param_groups,
)
from vivit.directional.gram_space import Damping
from vivit.directional.results import NewtonStep
from vivit.errors import InvalidArgumentError
from vivit.linalg.solvers import check_top_k
from vivit.lowrank import LowRankGGN


class DampedNewton(Optimizer):
    """Newton steps on the GGN's leading eigenspace, damped per direction.

    Each :meth:`step` evaluates the closure (the loss of a fresh mini-batch), runs
    one backward pass that yields the GGN's Gram matrix per parameter group, and
    updates every group by ``lr · Δθ`` with
    ``Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k`` over its ``top_k`` leading eigenvectors.

    The model and the loss function must be extended with ``backpack.extend``
    (``use_converter=True`` for models with a custom forward); the closure returns
    the loss and must **not** call ``backward``::

        model, loss_func = extend(model), extend(CrossEntropyLoss())
        optimizer = DampedNewton(model.parameters(), top_k=10, damping=1e-2)
        for inputs, targets in loader:
            optimizer.step(lambda: loss_func(model(inputs), targets))

    The curvature needs BatchNorm layers in eval mode, so the step never updates
    their running statistics; refresh them yourself (e.g. a no-grad forward pass
    in train mode) if they should follow the data.

    ``lr``, ``damping``, ``top_k`` and ``subsampling_grad`` can differ between
    parameter groups (as in ``torch.optim``); each group is one block of a
    block-diagonal GGN. ``mc_samples`` and ``subsampling`` shape the single
    backward pass and hold for all groups.

    After a step, :attr:`last_steps` holds one :class:`~vivit.directional.NewtonStep`
    per group (eigenvalues, ``γ``, ``λ``, ``γ̄``, dampings, the step) and, with
    ``keep_directions=True``, :attr:`last_directions` the eigenvectors.

    Args:
        params: Parameters or parameter groups.
        lr: Scale of the Newton step.
        damping: Constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs, gammas,
            lambdas) → [K]`` such as :class:`~vivit.optim.damping.BootstrapDamping`.
        top_k: Number of leading eigendirections; ``None`` uses every numerically
            non-zero one.
        subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).
        mc_samples: ``0`` for the exact GGN, else ``M`` MC samples per datum.
        subsampling: Samples whose curvature defines the GGN (``None``: all).
        generator: Random generator for reproducible MC sampling.
        keep_directions: Keep the last step's eigenvectors in parameter space.

    Raises:
        InvalidArgumentError: If an argument has the wrong type or value (``lr``
            not positive, ...).
        ParamGroupError: If ``params`` is empty or holds something other than
            parameters or dicts of parameters.
        UnsupportedDtypeError: For 16-bit parameters.
        NonFiniteError: For parameters with NaN or infinite entries.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1.0,
        damping: float | Damping = 1.0,
        top_k: int | None = None,
        subsampling_grad: Sequence[int] | None = None,
        *,
        mc_samples: int = 0,
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        keep_directions: bool = False,
    ):
        check_grad_mode("DampedNewton")
        if (
            isinstance(lr, bool)
            or not isinstance(lr, int | float)
            or not 0 < lr < float("inf")
        ):
            raise InvalidArgumentError(f"lr must be a positive number, got {lr!r}.")
        check_damping(damping)
        check_top_k(top_k)
        check_subsampling(subsampling_grad, name="subsampling_grad")
        check_mc_samples(mc_samples)
        check_subsampling(subsampling)
        check_generator(generator)
        params = optimizer_param_groups(params)
        defaults = {
            "lr": lr,
            "damping": damping,
            "top_k": top_k,
            "subsampling_grad": subsampling_grad,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_damping(group["damping"])
            check_top_k(group["top_k"])
            check_subsampling(group["subsampling_grad"], name="subsampling_grad")
            check_params(group["params"], {})
        self.mc_samples = mc_samples
        self.subsampling = subsampling
        self.generator = generator
        self.keep_directions = keep_directions
        self.last_steps: list[NewtonStep] = []
        self.last_directions: list[tuple[Tensor, list[Tensor]]] = []

    def step(self, closure: Callable[[], Tensor]) -> Tensor:  # type: ignore[override]
        """Evaluate the closure, compute the damped Newton step, apply it.

        Args:
            closure: Computes and returns the loss of a mini-batch through the
                extended model and loss function, without calling ``backward``.

        Returns:
            The loss the closure returned (detached).

        Raises:
            InvalidArgumentError: If no closure is given, or it calls
                ``backward()``.
            NonFiniteError: If the loss, the curvature or a step is not finite;
                the parameters are then left unchanged.
        """
        if closure is None or not callable(closure):
            raise InvalidArgumentError(
                "DampedNewton.step needs a closure that returns the loss of a "
                f"mini-batch (without calling backward), got {closure!r:.60}."
            )
        with torch.enable_grad():
            ggn = LowRankGGN.from_loss(
                closure,
                [group["params"] for group in self.param_groups],
                mc_samples=self.mc_samples,
                subsampling=self.subsampling,
                generator=self.generator,
            )
        steps = [
            ggn.newton(
                group["top_k"], index, group["damping"], group["subsampling_grad"]
            )
            for index, group in enumerate(self.param_groups)
        ]
        for index, newton in enumerate(steps):  # refuse before changing anything
            for position, update in enumerate(newton.step):
                check_finite(
                    update,
                    f"Newton step of parameter {position} of group {index} (the "
                    "parameters are unchanged; increase the damping)",
                    batch_axis=False,
                )
        self.last_steps, self.last_directions = [], []
        for index, (group, newton) in enumerate(
            zip(self.param_groups, steps, strict=True)
        ):
            with torch.no_grad():
                for param, update in zip(group["params"], newton.step, strict=True):
                    param.add_(update, alpha=group["lr"])
            self.last_steps.append(newton)
            if self.keep_directions:
                self.last_directions.append(ggn.eigh(group["top_k"], index))
        return ggn.loss
