"""A ``torch.optim.Optimizer`` that takes directionally damped Newton steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from vivit._validation import check_damping
from vivit.directional.gram_space import Damping
from vivit.directional.results import NewtonStep
from vivit.engines.base import Engine
from vivit.engines.choice import check_engine
from vivit.errors import InvalidArgumentError
from vivit.lowrank import LowRankGGN


class DampedNewton(Optimizer):
    """Newton steps on the GGN's leading eigenspace, damped per direction.

    Each :meth:`step` evaluates the closure (the loss of a fresh mini-batch), runs
    one backward pass that yields the GGN's Gram matrix per parameter group, and
    updates every group by ``lr · Δθ`` with
    ``Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k`` over its ``top_k`` leading eigenvectors.

    Two ways to hand over a mini-batch:

    * Give the optimizer the model and the loss function, and each step the data;
      any engine works (``engine="auto"`` picks one per step, ``"func"`` needs no
      ``extend`` and handles transformers, LSTMs and shared weights)::

        optimizer = DampedNewton(
            model.parameters(), top_k=10, damping=1e-2, model=model,
            loss_func=CrossEntropyLoss(),
        )
        for inputs, targets in loader:
            optimizer.step(data=(inputs, targets))

    * A closure (``torch.optim`` style) that returns the loss and does **not**
      call ``backward``. The backward pass starts from that loss, so this needs
      the BackPACK engine: the model and the loss function must be extended with
      ``backpack.extend`` (``use_converter=True`` for a custom forward)::

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
        model: The network, for steps given ``data`` instead of a closure.
        loss_func: The loss module, for steps given ``data``.
        engine: Engine for steps given ``data`` (see
            :class:`~vivit.LowRankGGN`); closures always use BackPACK.

    Raises:
        ValueError: If ``lr`` is not positive, or only one of ``model`` and
            ``loss_func`` is given.
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
        model: Module | None = None,
        loss_func: Module | None = None,
        engine: str | Engine = "auto",
    ):
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr!r}.")
        if (model is None) != (loss_func is None):
            raise InvalidArgumentError(
                "Pass both model and loss_func (to call step(data=...)) or neither "
                "(to call step(closure))."
            )
        check_engine(engine)
        check_damping(damping)
        defaults = {
            "lr": lr,
            "damping": damping,
            "top_k": top_k,
            "subsampling_grad": subsampling_grad,
        }
        super().__init__(params, defaults)
        self.mc_samples = mc_samples
        self.subsampling = subsampling
        self.generator = generator
        self.keep_directions = keep_directions
        self.model, self.loss_func, self.engine = model, loss_func, engine
        self.last_steps: list[NewtonStep] = []
        self.last_directions: list[tuple[Tensor, list[Tensor]]] = []

    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Tensor] | None = None,
        *,
        data: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Compute the damped Newton step of one mini-batch and apply it.

        Args:
            closure: Computes and returns the loss of a mini-batch through the
                BackPACK-extended model and loss function, without calling
                ``backward``.
            data: ``(inputs, targets)`` of a mini-batch, for an optimizer built
                with ``model`` and ``loss_func``. Give either this or a closure.

        Returns:
            The mini-batch loss (detached).

        Raises:
            ValueError: If neither or both are given, ``data`` without ``model``,
                or a closure with an engine other than BackPACK.
        """
        if (closure is None) == (data is None):
            raise InvalidArgumentError(
                "DampedNewton.step needs either a closure that returns the loss of "
                "a mini-batch (without calling backward) or data=(inputs, targets) "
                "for an optimizer built with model= and loss_func=."
            )
        groups = [group["params"] for group in self.param_groups]
        options = {
            "mc_samples": self.mc_samples,
            "subsampling": self.subsampling,
            "generator": self.generator,
        }
        with torch.enable_grad():
            if data is not None:
                if self.model is None:
                    raise InvalidArgumentError(
                        "step(data=...) needs the model and the loss function: "
                        "build the optimizer with model= and loss_func=."
                    )
                ggn = LowRankGGN(
                    self.model,
                    self.loss_func,
                    data,
                    param_groups=groups,
                    engine=self.engine,
                    **options,
                )
            else:
                if self.engine not in ("auto", "backpack"):
                    raise InvalidArgumentError(
                        f"A closure's loss can only be backpropagated by the BackPACK "
                        f"engine, not {self.engine!r}: build the optimizer with "
                        "model= and loss_func= and call step(data=(inputs, targets))."
                    )
                ggn = LowRankGGN.from_loss(closure, groups, **options)
        self.last_steps, self.last_directions = [], []
        for index, group in enumerate(self.param_groups):
            newton = ggn.newton(
                group["top_k"], index, group["damping"], group["subsampling_grad"]
            )
            with torch.no_grad():
                for param, update in zip(group["params"], newton.step, strict=True):
                    param.add_(update, alpha=group["lr"])
            self.last_steps.append(newton)
            if self.keep_directions:
                self.last_directions.append(ggn.eigh(group["top_k"], index))
        return ggn.loss
