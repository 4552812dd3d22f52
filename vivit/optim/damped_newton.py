"""A ``torch.optim.Optimizer`` that takes directionally damped Newton steps.

Its defaults and why, zero and non-finite steps: user guide, "Damped Newton
steps"; data-parallel training: "Several processes"; BatchNorm: "BatchNorm".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from vivit._param_groups import optimizer_param_groups
from vivit._validation import (
    check_damping,
    check_grad_mode,
    check_lr,
    check_params,
    check_subsampling,
)
from vivit.directional.gram_space import Damping, predicted_decrease
from vivit.directional.results import NewtonStep
from vivit.distributed import agree_across_ranks
from vivit.engines.base import Engine, OutputSelector
from vivit.engines.choice import runs_from_a_loss
from vivit.errors import (
    InvalidArgumentError,
    NonFiniteError,
    UnboundedStepWarning,
    VivitError,
)
from vivit.linalg.solvers import check_top_k
from vivit.lowrank import LowRankGGN
from vivit.options import CurvatureOptions, options_from

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class DampedNewton(Optimizer):
    """Newton steps on the GGN's eigenspace, damped per direction, in a trust region.

    Each :meth:`step` runs one backward pass on a fresh mini-batch and updates each
    parameter group by ``lr · Δθ`` over its ``top_k`` leading eigenvectors (user
    guide, "Damped Newton steps"). A mini-batch comes as ``step(data=(inputs,
    targets))`` (built with ``model`` and ``loss_func``; any engine) or as a closure
    returning the loss without ``backward`` (BackPACK-extended modules; the
    BackPACK engine, Gram route, one process, no chunks)::

        optimizer = DampedNewton(
            model.parameters(), top_k=10, model=model, loss_func=CrossEntropyLoss()
        )
        for inputs, targets in loader:
            optimizer.step(data=(inputs, targets))

    ``lr``, ``damping``, ``top_k``, ``subsampling_grad`` and ``trust_fraction`` may
    differ between groups (one GGN block and trust region each). BatchNorm's running
    statistics are never updated. Under a process group each rank passes its shard.
    The other keyword arguments are :class:`~vivit.options.CurvatureOptions`.

    Args:
        params: Parameters or parameter groups.
        lr: Scale of the Newton step (``1.0``: the damped Newton step itself).
        damping: Constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs, gammas,
            lambdas) → [K]`` such as :class:`~vivit.optim.damping.BootstrapDamping`.
        top_k: Number of leading eigendirections (``None``: every non-zero one).
        subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).
        trust_fraction: Largest predicted loss decrease per step, as a fraction of
            the (non-negative) loss; ``None``: no bound, and a step promising more
            than the loss warns (:class:`~vivit.UnboundedStepWarning`).
        keep_directions: Keep the last step's eigenvectors in parameter space.
        model: The network, for steps given ``data``.
        loss_func: The loss module, for steps given ``data``.

    Attributes:
        last_steps: The last step's :class:`~vivit.directional.NewtonStep` per group.
        last_directions: With ``keep_directions``, its eigenpairs per group.

    Raises:
        InvalidArgumentError: For an invalid argument, or only one of ``model``
            and ``loss_func``.
        ParamGroupError: If ``params`` is empty or not parameters or dicts of them.
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
        trust_fraction: float | None = 0.25,
        mc_samples: int = 0,
        mc_per: str = "token",
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        keep_directions: bool = False,
        gram_dtype: torch.dtype | None = None,
        route: str = "auto",
        solver: str = "auto",
        model: Module | None = None,
        loss_func: Module | None = None,
        engine: str | Engine = "auto",
        process_group: ProcessGroup | bool | None = None,
        chunk_size: int | None = None,
        output: OutputSelector = None,
    ):
        check_grad_mode("DampedNewton")
        if (model is None) != (loss_func is None):
            raise InvalidArgumentError(
                "Pass both model and loss_func (to call step(data=...)) or neither "
                "(to call step(closure))."
            )
        self.options = options_from(locals())
        defaults = {
            "lr": lr,
            "damping": damping,
            "top_k": top_k,
            "subsampling_grad": subsampling_grad,
            "trust_fraction": trust_fraction,
        }
        check_group_settings(defaults)  # add_param_group checks each group
        super().__init__(optimizer_param_groups(params), defaults)
        self.keep_directions = keep_directions
        self.model, self.loss_func = model, loss_func
        self.last_steps: list[NewtonStep] = []
        self.last_directions: list[tuple[Tensor, list[Tensor]]] = []

    def add_param_group(self, param_group: dict) -> None:
        """Add a group ``{"params": ..., "lr": ..., ...}`` (unset: the defaults).

        Raises:
            VivitError: As the constructor (the group is then not added).
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_group_settings(group, len(self.param_groups) - 1)
            check_params(group["params"], {})
        except VivitError:
            self.param_groups.pop()
            raise

    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Tensor] | None = None,
        *,
        data: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Compute the damped Newton step of one mini-batch and apply it.

        Args:
            closure: Returns the mini-batch loss (BackPACK-extended modules),
                without calling ``backward``.
            data: ``(inputs, targets)`` instead, for an optimizer built with
                ``model`` and ``loss_func``.

        Returns:
            The mini-batch loss (detached).

        Raises:
            InvalidArgumentError: Unless exactly one of ``closure`` and ``data``
                (with ``model``) is given; for a closure the options or engine
                cannot serve; for a negative loss under a ``trust_fraction``.
            NonFiniteError: If the loss, curvature or step is not finite.
            DistributedError: If another rank failed or asks for another step.
                On either error the parameters are unchanged.
        """
        if (closure is None) == (data is None) or (
            closure is not None and not callable(closure)
        ):
            raise InvalidArgumentError(
                "DampedNewton.step needs either a closure that returns the loss of "
                "a mini-batch (without calling backward) or data=(inputs, targets) "
                "for an optimizer built with model= and loss_func=."
            )
        for index, group in enumerate(self.param_groups):  # changed since added?
            check_group_settings(group, index)
        groups = [group["params"] for group in self.param_groups]
        options = self.options
        with torch.enable_grad():
            if data is not None:
                if self.model is None:
                    raise InvalidArgumentError(
                        "step(data=...) needs the model and the loss function: "
                        "build the optimizer with model= and loss_func=."
                    )
                ggn = LowRankGGN.from_options(
                    self.model, self.loss_func, data, groups, options
                )
            else:
                _check_closure_options(options)
                ggn = LowRankGGN._from_loss(closure, groups, options)
        if data is not None and options.group is not None:
            # replicas stay equal only if they step alike
            agree_across_ranks(
                options.group,
                "the optimizer settings",
                [_step_settings(group) for group in self.param_groups],
            )
        loss = float(ggn.loss)
        steps = [
            ggn.newton(
                group["top_k"],
                index,
                group["damping"],
                group["subsampling_grad"],
                lr=group["lr"],
                max_decrease=_max_decrease(group["trust_fraction"], loss),
            )
            for index, group in enumerate(self.param_groups)
        ]
        for index, group in enumerate(self.param_groups):
            if group["trust_fraction"] is None:
                _warn_if_unbounded(steps[index], group["lr"], loss, index)
        for index, newton in enumerate(steps):  # refuse before changing anything
            if not all(update.isfinite().all() for update in newton.step):
                raise NonFiniteError(
                    f"The Newton step of parameter group {index} is not finite: no "
                    "step was taken (the parameters are unchanged). Increase the "
                    "damping or use a trust_fraction."
                )
        with torch.no_grad():
            for group, newton in zip(self.param_groups, steps, strict=True):
                for param, update in zip(group["params"], newton.step, strict=True):
                    param.add_(update)
        self.last_steps = steps
        self.last_directions = (
            [ggn.eigh(group["top_k"], i) for i, group in enumerate(self.param_groups)]
            if self.keep_directions
            else []
        )
        return ggn.loss


def _check_closure_options(options: CurvatureOptions) -> None:
    """Refuse the options a closure's loss cannot honour, naming what to do."""
    if options.chunk_size is not None:
        raise InvalidArgumentError(
            "chunk_size splits a batch the optimizer computes itself: "
            "call step(data=(inputs, targets)) (optimizer built with "
            "model= and loss_func=), not a closure."
        )
    if options.group is not None:
        raise InvalidArgumentError(
            "A closure's loss is this process's alone: under a process "
            "group call step(data=(inputs, targets)) with this rank's "
            "shard (optimizer built with model= and loss_func=), or "
            "pass process_group=False for independent steps."
        )
    if not runs_from_a_loss(options.engine) or options.route == "implicit":
        raise InvalidArgumentError(
            f"A closure's loss can only be backpropagated by the BackPACK "
            f"engine on the Gram route, not engine={options.engine!r}, "
            f"route={options.route!r}: build the optimizer with "
            "model= and loss_func= and call step(data=(inputs, targets))."
        )


#: A parameter group's step settings (each may differ between groups).
STEP_SETTINGS = ("lr", "top_k", "damping", "subsampling_grad", "trust_fraction")


def check_group_settings(group: dict, index: int | None = None) -> None:
    """Check the step settings of parameter group ``index`` (``None``: defaults).

    Raises:
        VivitError: For an invalid setting (:class:`~vivit.InvalidSubsamplingError`
            for ``subsampling_grad``).
    """
    try:
        check_lr(group["lr"])
        check_damping(group["damping"])
        check_top_k(group["top_k"])
        check_subsampling(group["subsampling_grad"], name="subsampling_grad")
        check_trust_fraction(group["trust_fraction"])
    except VivitError as error:
        if index is None:
            raise
        raise type(error)(f"Parameter group {index}: {error}") from None


def _step_settings(group: dict) -> dict[str, object]:
    """A parameter group's step settings, comparable across processes."""

    def described(value: object) -> object:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, list | tuple):
            return [described(v) for v in value]
        attributes = getattr(value, "__dict__", {})
        return (
            type(value).__name__,
            {k: described(v) for k, v in sorted(attributes.items())},
        )

    return {key: described(group[key]) for key in STEP_SETTINGS}


def check_trust_fraction(trust_fraction: object) -> None:
    """Refuse a ``trust_fraction`` that is neither ``None`` nor positive and finite."""
    if trust_fraction is not None and (
        isinstance(trust_fraction, bool)
        or not isinstance(trust_fraction, int | float)
        or not 0 < trust_fraction < math.inf
    ):
        raise InvalidArgumentError(
            "trust_fraction must be a positive number (the largest predicted loss "
            f"decrease per step, as a fraction of the loss) or None, got "
            f"{trust_fraction!r}."
        )


def _warn_if_unbounded(newton: NewtonStep, lr: float, loss: float, group: int) -> None:
    """Warn if a step's quadratic model promises a decrease beyond the loss."""
    directional = newton.directional
    decrease = float(
        predicted_decrease(
            directional.evals, directional.gamma_bar, newton.dampings, lr
        ).sum()
    )
    if loss >= 0 and decrease > loss:
        warnings.warn(
            f"The Newton step of parameter group {group} predicts a loss decrease "
            f"of {decrease:.3g}, more than the loss {loss:.3g} itself: the quadratic "
            "model is used far outside where it holds and the step may diverge. "
            "Increase the damping or set a trust_fraction (default 0.25).",
            UnboundedStepWarning,
            stacklevel=3,
        )


def _max_decrease(trust_fraction: float | None, loss: float) -> float | None:
    """The largest predicted decrease of a step: ``trust_fraction · loss``."""
    if trust_fraction is None:
        return None
    if loss < 0:
        raise InvalidArgumentError(
            f"The loss is negative ({loss:.6g}), but the trust region bounds the "
            "predicted decrease by a fraction of a non-negative loss: pass "
            "trust_fraction=None for this loss."
        )
    return trust_fraction * loss
