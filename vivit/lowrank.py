"""One-call access to the GGN's low-rank structure of a mini-batch or data set."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_grad_mode
from vivit.distributed import ShardExchange, local_module, resolve_group
from vivit.engines.base import Engine, OutputSelector
from vivit.memory.plan import Plan
from vivit.memory.request import agreed_plan, asked, plan_request
from vivit.options import CurvatureOptions, derived
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
    group, the layer factors of ``V``. The Gram matrix ``Vᵀ V`` is formed from them
    when a computation first needs it (never with the matrix-free solver).
    ``model`` and ``loss_func`` are left as they were (whatever hooks an engine
    needs are removed again; hooks the caller installed with ``backpack.extend``
    stay), and so are the ``.grad`` of inputs and parameters.

    An engine computes the factors (``engine``, see
    :class:`~vivit.options.CurvatureOptions`). Every option is described there.

    Example::

        ggn = LowRankGGN(model, CrossEntropyLoss(), (X, y))
        evals, evecs = ggn.eigh(top_k=10)

    Args:
        model: The network. BatchNorm and dropout layers must be in eval mode.
            A layer the engine cannot handle raises naming it (``engine``).
        loss_func: A ``torch.nn`` loss module (MSELoss, CrossEntropyLoss,
            BCEWithLogitsLoss) with ``reduction`` ``"mean"`` or ``"sum"``.
        data: ``(inputs, targets)`` of the mini-batch, or an iterable of such
            batches (a ``DataLoader``, a list, a generator): the GGN is then that
            of the loss on all their samples together (for reduction ``"mean"``
            the mean over all samples), from one pass that keeps every batch's
            layer factors; the loss and gradient are those of all samples too
            (``docs/math.rst``, "Data sets and processes"). The memory of the
            stored factors is estimated from the first batch and a loader that
            cannot fit is refused then (:class:`~vivit.FactorsTooLargeError`,
            with the alternatives, among them :class:`~vivit.StreamingGGN`).
        param_groups: Lists of parameters, one GGN block each (block-diagonal
            approximation); ``None`` uses one group with every trainable parameter.
        mc_samples: As for :class:`~vivit.options.CurvatureOptions`.
        mc_per: As for :class:`~vivit.options.CurvatureOptions`.
        subsampling: As for :class:`~vivit.options.CurvatureOptions`.
        generator: As for :class:`~vivit.options.CurvatureOptions`.
        gram_dtype: As for :class:`~vivit.options.CurvatureOptions`.
        route: As for :class:`~vivit.options.CurvatureOptions`.
        solver: As for :class:`~vivit.options.CurvatureOptions`.
        solver_tol: As for :class:`~vivit.options.CurvatureOptions`.
        solver_seed: As for :class:`~vivit.options.CurvatureOptions`.
        engine: As for :class:`~vivit.options.CurvatureOptions`.
        progress: As for :class:`~vivit.options.CurvatureOptions`.
        process_group: As for :class:`~vivit.options.CurvatureOptions`. The
            Gram route forms the Gram matrices at construction, their blocks
            split over the ranks (not with ``solver="factor_krylov"``); nothing
            after its construction communicates. On the implicit route every
            product is summed over the ranks (one ``all_reduce``), so every
            rank must make the same calls in the same order. Each rank chooses
            a route from its own shard; all run the one :attr:`plan` names.
        chunk_size: As for :class:`~vivit.options.CurvatureOptions`.
        output: As for :class:`~vivit.options.CurvatureOptions`.
        max_batches: As for :class:`~vivit.options.CurvatureOptions`.

    Attributes:
        loss: The loss on the mini-batch, or on all samples of a loader
            (detached).
        param_groups: The parameter groups, as lists of parameters.
        engine: Name of the engine that ran (``"backpack"`` or ``"func"``).

        shards: Where each rank's samples sit in the union
            (:class:`~vivit.distributed.ShardLayout`): rows of ``γ``, ``λ`` and
            the Gram matrix that belong to this rank.
        communication: Bytes and time of the exchange between the ranks
            (:class:`~vivit.distributed.ExchangeReport`; zero in one process),
            on the implicit route also of every product since.
        plan: What ran and why (:class:`~vivit.memory.plan.Plan`): its
            ``route``, ``"gram"`` (factors of ``V``) or ``"implicit"``
            (GGN-vector products), and ``reason``; ``str(ggn.plan)`` says both.
            Under a process group the same on every rank. The memory estimate of
            a request reads the same plan (:func:`vivit.memory.estimate_memory`);
            ``None`` for :meth:`from_loss`.

    Raises:
        VivitError: Before the forward pass for malformed arguments (see the
            user guide, "What the library checks"); afterwards for non-finite
            values (:class:`~vivit.NonFiniteError`, naming where they are),
            unsupported loss options or targets, and layers the engine cannot
            handle. Works inside ``torch.no_grad()``; refuses
            ``torch.inference_mode()``. The ``.grad`` of inputs and parameters
            and the random number generators are left as they were.
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
        group = resolve_group(process_group)
        self._build(
            model,
            loss_func,
            data,
            param_groups,
            group,
            lambda: CurvatureOptions(
                mc_samples=mc_samples,
                mc_per=mc_per,
                subsampling=subsampling,
                generator=generator,
                gram_dtype=gram_dtype,
                route=route,
                solver=solver,
                solver_tol=solver_tol,
                solver_seed=solver_seed,
                engine=engine,
                progress=progress,
                process_group=False if group is None else group,
                chunk_size=chunk_size,
                output=output,
                max_batches=max_batches,
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
        """Build from options checked before (e.g. once for many mini-batches).

        :class:`~vivit.optim.DampedNewton` checks its options once and builds one
        of these per step.

        Args:
            model: As for the constructor.
            loss_func: As for the constructor.
            data: As for the constructor.
            param_groups: As for the constructor.
            options: The checked options.

        Returns:
            The low-rank GGN.
        """
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
        """Build the options and run the source inside the ranks' exchange.

        ``options`` is called inside the exchange, so that an option refused on
        one rank raises on every rank.
        """
        with ShardExchange(group) as shards:
            check_grad_mode("LowRankGGN")
            checked = options()
            module = local_module(model)
            groups, names = checked_param_groups(module, loss_func, param_groups)
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
        self._init(source, checked, plan)

    def _group(self, group: int) -> GroupCurvature:
        """The stored curvature of a group: its factors and batch context."""
        return self._source.group(group).curvature

    def _init(
        self,
        source: StoredFactors | ImplicitFactors,
        options: CurvatureOptions,
        plan: Plan | None,
    ) -> None:
        super().__init__(source, options)
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

        For use where the forward pass happens elsewhere (e.g. an optimizer's
        closure); always uses the BackPACK engine, whose backward pass starts from
        the loss. The caller must have extended the model and the loss function
        with ``backpack.extend``. Engines that need the model (func) take the
        constructor's ``(model, loss_func, data)`` instead.

        Args:
            loss: The mini-batch loss, or a function that computes it.
            param_groups: Lists of parameters, one GGN block each.
            mc_samples: As for :class:`~vivit.options.CurvatureOptions`.
            mc_per: As for :class:`~vivit.options.CurvatureOptions`.
            subsampling: As for :class:`~vivit.options.CurvatureOptions`.
            generator: As for :class:`~vivit.options.CurvatureOptions`.
            gram_dtype: As for :class:`~vivit.options.CurvatureOptions`.
            solver: As for :class:`~vivit.options.CurvatureOptions`.
            solver_tol: As for :class:`~vivit.options.CurvatureOptions`.
            solver_seed: As for :class:`~vivit.options.CurvatureOptions`.

        Returns:
            The low-rank GGN of that loss.

        Raises:
            InvalidArgumentError: If ``loss`` is neither a tensor nor a callable.
            GradientContextError: If the loss was computed without gradients.
        """
        check_grad_mode("LowRankGGN.from_loss")
        options = CurvatureOptions(
            mc_samples=mc_samples,
            mc_per=mc_per,
            subsampling=subsampling,
            generator=generator,
            gram_dtype=gram_dtype,
            solver=solver,
            solver_tol=solver_tol,
            solver_seed=solver_seed,
            engine="backpack",
            process_group=False,
        )
        return cls._from_loss(loss, param_groups, options)

    @classmethod
    def _from_loss(
        cls,
        loss: Tensor | Callable[[], Tensor],
        param_groups: Sequence[Sequence[Parameter]],
        options: CurvatureOptions,
    ) -> LowRankGGN:
        """:meth:`from_loss` with options checked before (by ``DampedNewton``).

        Args:
            loss: As for :meth:`from_loss`.
            param_groups: As for :meth:`from_loss`.
            options: The checked options (the engine is BackPACK's).

        Returns:
            The low-rank GGN of that loss.
        """
        from vivit.engines.backpack import BackpackEngine

        source = StoredFactors.from_loss(loss, param_groups, options, BackpackEngine())
        ggn = cls.__new__(cls)
        ggn._init(source, options, None)
        return ggn
