"""One-call access to the GGN's low-rank structure of a mini-batch or data set."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_grad_mode
from vivit.distributed import ParamPlacement, ShardExchange, local_view, resolve_group
from vivit.engines.base import Engine, OutputSelector
from vivit.memory.plan import Plan
from vivit.memory.request import agreed_plan, asked, plan_request
from vivit.options import CurvatureOptions, derived, options_from
from vivit.results import CurvatureResults
from vivit.sources.collector import GroupCurvature, checked_param_groups
from vivit.sources.data import Data
from vivit.sources.implicit import ImplicitFactors
from vivit.sources.stored import StoredFactors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class LowRankGGN(CurvatureResults):
    """The GGN of a mini-batch through its Gram matrix, from one backward pass.

    Runs the forward and backward pass at construction and keeps, per parameter
    group, the layer factors of ``V``; the Gram matrix ``Vᵀ V`` is formed when a
    computation first needs it. ``model``, ``loss_func``, their hooks, the ``.grad``
    of inputs and parameters and the random generators are left as they were.

    Example::

        ggn = LowRankGGN(model, CrossEntropyLoss(), (X, y))
        evals, evecs = ggn.eigh(top_k=10)

    Options: the keyword arguments after ``param_groups`` are those of
    :class:`~vivit.options.CurvatureOptions`. Under ``process_group`` the Gram
    route forms the Gram matrices at construction, split over the ranks, and
    nothing communicates afterwards; on the implicit route every product is summed
    over the ranks, so every rank must make the same calls in the same order. All
    ranks run the route :attr:`plan` names.

    Args:
        model: The network. BatchNorm and dropout layers must be in eval mode.
        loss_func: A ``torch.nn`` loss module (MSELoss, CrossEntropyLoss,
            BCEWithLogitsLoss) with ``reduction`` ``"mean"`` or ``"sum"``.
        data: ``(inputs, targets)`` of the mini-batch, or an iterable of such
            batches (a ``DataLoader``, a list, a generator): the GGN, loss and
            gradient of all their samples together, from one pass that keeps
            every batch's factors (``docs/math.rst``, "Data sets and processes";
            :class:`~vivit.FactorsTooLargeError` after the first batch if they
            cannot fit).
        param_groups: Lists of parameters, one GGN block each (block-diagonal
            approximation); ``None``: one group of every trainable parameter.

    Attributes:
        shards: Where each rank's samples sit in the union
            (:class:`~vivit.distributed.ShardLayout`): the rows of ``γ``, ``λ``
            and the Gram matrix that belong to this rank.
        communication: Bytes and time of the exchange between the ranks
            (:class:`~vivit.distributed.ExchangeReport`; zero in one process),
            on the implicit route also of every product since.
        plan: What ran and why (:class:`~vivit.memory.plan.Plan`), the same on
            every rank; ``None`` for :meth:`from_loss`.

    Raises:
        VivitError: Before the forward pass for malformed arguments (user guide,
            "What the library checks") or ``torch.inference_mode()``; afterwards
            for non-finite values, unsupported losses or targets, and layers the
            engine cannot handle.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]],
        *,
        param_groups: Sequence[Sequence[Parameter]] | None = None,
        mc_samples: int = 0,
        mc_per: str = "token",
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        gram_dtype: torch.dtype | None = None,
        route: str = "auto",
        solver: str = "auto",
        solver_tol: float | None = None,
        solver_seed: int = 0,
        engine: str | Engine = "auto",
        progress: bool | None = None,
        process_group: ProcessGroup | bool | None = None,
        chunk_size: int | None = None,
        output: OutputSelector = None,
        max_batches: int | None = None,
    ):
        arguments = locals()
        group = resolve_group(process_group)
        self._build(
            model,
            loss_func,
            data,
            param_groups,
            group,
            lambda: options_from(
                arguments, process_group=False if group is None else group
            ),
        )

    @classmethod
    def from_options(
        cls,
        model: Module,
        loss_func: Module,
        data: tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]],
        param_groups: Sequence[Sequence[Parameter]] | None,
        options: CurvatureOptions,
    ) -> LowRankGGN:
        """Build from ``options`` checked before (the rest: the constructor's)."""
        ggn = cls.__new__(cls)
        ggn._build(model, loss_func, data, param_groups, options.group, lambda: options)
        return ggn

    def _build(
        self,
        model: Module,
        loss_func: Module,
        data: object,
        param_groups: Sequence[Sequence[Parameter]] | None,
        group: ProcessGroup | None,
        options: Callable[[], CurvatureOptions],
    ) -> None:
        """Run ``options()`` and the source in the exchange: refusals reach all."""
        with ShardExchange(group) as shards:
            module, placement = local_view(model)  # a collective for FSDP2
            check_grad_mode("LowRankGGN")
            checked = options()
            groups, names = checked_param_groups(
                module, loss_func, placement.groups(param_groups)
            )
            data = Data(module, loss_func, data, checked, grouped=group is not None)
            plan = plan_request(module, loss_func, data, groups, checked)
            # under a group every rank runs one route, decided from every shard's
            plan = shards.decide((asked(checked), plan), agreed_plan)
            if plan.route == "implicit":  # no engine, no V: G v by JVP and VJP
                checked = derived(checked, route="implicit")
                source = ImplicitFactors(
                    module, loss_func, data, groups, checked, shards, plan
                )
            else:
                if group is None:
                    plan.check(checked.solver)
                source = StoredFactors.run(
                    module, loss_func, data, groups, names, checked, shards,
                    plan.engine, plan,
                )  # fmt: skip
        self._init(source, checked, plan, placement)

    def _group(self, group: int) -> GroupCurvature:
        """The stored curvature of a group: its factors and batch context."""
        return self._source.group(group).curvature

    def _init(
        self,
        source: StoredFactors | ImplicitFactors,
        options: CurvatureOptions,
        plan: Plan | None,
        placement: ParamPlacement | None = None,
    ) -> None:
        super().__init__(source, options, placement)
        self.plan = plan
        self.shards = source.shards
        self.communication = source.communication

    @classmethod
    def from_loss(
        cls,
        loss: Tensor | Callable[[], Tensor],
        param_groups: Sequence[Sequence[Parameter]],
        *,
        mc_samples: int = 0,
        mc_per: str = "token",
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        gram_dtype: torch.dtype | None = None,
        solver: str = "auto",
        solver_tol: float | None = None,
        solver_seed: int = 0,
    ) -> LowRankGGN:
        """Build from a loss computed by BackPACK-extended model and loss modules.

        For a forward pass that happens elsewhere (e.g. an optimizer's closure):
        the BackPACK engine's backward pass starts from ``loss`` (or a function
        that computes it); ``param_groups`` are lists of parameters, the other
        arguments options of :class:`~vivit.options.CurvatureOptions`.

        Raises:
            InvalidArgumentError: If ``loss`` is neither a tensor nor a callable.
            GradientContextError: If the loss was computed without gradients.
        """
        check_grad_mode("LowRankGGN.from_loss")
        options = options_from(locals(), engine="backpack", process_group=False)
        return cls._from_loss(loss, param_groups, options)

    @classmethod
    def _from_loss(
        cls,
        loss: Tensor | Callable[[], Tensor],
        param_groups: Sequence[Sequence[Parameter]],
        options: CurvatureOptions,
    ) -> LowRankGGN:
        """:meth:`from_loss` with options checked before (by ``DampedNewton``)."""
        from vivit.engines.backpack import BackpackEngine

        source = StoredFactors.from_loss(loss, param_groups, options, BackpackEngine())
        ggn = cls.__new__(cls)
        ggn._init(source, options, None)
        return ggn
