"""Models sharded with FSDP2: a gathered twin to run, results sharded like the model.

``torch.distributed.fsdp.fully_shard`` turns parameters into ``DTensor`` shards and
gathers them one unit at a time inside its own forward and backward hooks, whose
collectives must run alike on every rank. The curvature's passes are not the
model's training passes (chunks, probes, vectors per pass differ between ranks), so
they run on a *gathered twin*: the same modules, classes and buffers without FSDP's
hooks, every sharded parameter gathered once (``DTensor.full_tensor``). Results
in parameter space go back to the caller sharded like its parameters
(``docs/math.rst``, "Models sharded with FSDP2").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, Parameter

from vivit.errors import InvalidArgumentError, ModelTooLargeError
from vivit.gram.memory import available_bytes, format_bytes

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: Where FSDP2's classes and hooks are defined (what the twin leaves out).
FSDP_MODULE = "torch.distributed.fsdp"
#: The prefixes of the attributes FSDP2 sets on a module (its state, its flags).
FSDP_STATE = ("__composable_api_state_key", "_fsdp", "_is_fsdp")


def _dtensor_type() -> type | None:
    """``DTensor``, or ``None`` where ``torch.distributed`` is not available."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a sharded or replicated parameter)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def gathered(tensor: Tensor) -> Tensor:
    """A ``DTensor`` whole on every rank (a collective), another tensor as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def _is_fsdp(obj: object) -> bool:
    """Whether ``obj`` (a class, or a hook function) belongs to FSDP."""
    owner = getattr(obj, "__self__", obj)
    name = getattr(owner, "__module__", None) or type(owner).__module__
    return isinstance(name, str) and name.startswith(FSDP_MODULE)


class ParamPlacement:
    """Where the twin's parameters sit in the caller's model: their ``DTensor``.

    Empty (every method the identity) for a model that is not sharded.
    """

    def __init__(
        self,
        twins: dict[int, Parameter] | None = None,
        callers: Sequence[DTensor] = (),
        gathered: int = 0,
    ):
        self._twins = twins or {}  # id(caller's parameter) -> the twin's
        self._caller_of = {id(self._twins[id(p)]): p for p in callers}
        #: Bytes the gather added beyond the rank's shards.
        self.gathered = gathered

    @property
    def sharded(self) -> bool:
        """Whether any parameter is sharded."""
        return bool(self._caller_of)

    def place(
        self, tensors: Sequence[Tensor], params: Sequence[Tensor], leading: int = 0
    ) -> list[Tensor]:
        """``tensors`` shaped like ``params`` (after ``leading`` dimensions), sharded.

        Each becomes a ``DTensor`` with its caller parameter's mesh and placements
        (a sharded dimension moved by ``leading``); every rank holds the full tensor,
        so each keeps its own shard without communication.
        """
        if not self.sharded:
            return list(tensors)
        from torch.distributed.tensor import Shard, distribute_tensor

        placed = []
        for tensor, param in zip(tensors, params, strict=True):
            caller = self._caller_of.get(id(param))
            if caller is None:
                placed.append(tensor)
                continue
            placements = [
                Shard(p.dim + leading) if isinstance(p, Shard) else p
                for p in caller.placements
            ]
            placed.append(
                distribute_tensor(
                    tensor, caller.device_mesh, placements, src_data_rank=None
                )
            )
        return placed

    def callers(self, param_groups: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
        """The twin's parameter groups in the caller's parameters (:meth:`groups`'s)."""
        return [
            [self._caller_of.get(id(p), p) for p in group] for group in param_groups
        ]

    def groups(
        self, param_groups: Sequence[Sequence[Tensor]] | None
    ) -> list[list[Tensor]] | None:
        """The caller's parameter groups in the twin's parameters.

        Anything but a sequence of lists or tuples stays as it is, for the checks
        of the groups to name (``None``: every parameter).
        """
        if not self._twins or not isinstance(param_groups, list | tuple):
            return param_groups
        return [
            [self._twins.get(id(p), p) for p in group]
            if isinstance(group, list | tuple)
            else group
            for group in param_groups
        ]


class GatheredModel:
    """A plain twin of an FSDP2 model: its parameters gathered, FSDP's hooks left out.

    Its modules are new objects of the original classes sharing the caller's
    buffers, unsharded parameters and other attributes; the caller's own hooks
    stay. Building it is a collective (:func:`check_gathered_fits`, then one
    all-gather per sharded parameter in the order of ``model.parameters()``):
    every rank of the model's mesh builds it.

    Attributes:
        module: The twin.
        placement: Where its parameters sit in the caller's model.
    """

    def __init__(self, model: Module):
        self._twins: dict[int, Parameter] = {}
        callers = []
        gathered = check_gathered_fits(model)
        for param in model.parameters():  # the collectives, in one order everywhere
            if is_sharded(param) and id(param) not in self._twins:
                twin = Parameter(param.full_tensor().detach(), param.requires_grad)
                self._twins[id(param)] = twin
                callers.append(param)
        self.placement = ParamPlacement(self._twins, callers, gathered)
        self.module = self._twin(model, {})

    def _twin(self, module: Module, memo: dict[int, Module]) -> Module:
        """The twin of ``module`` (each shared submodule once)."""
        if id(module) in memo:
            return memo[id(module)]
        cls = type(module)
        if _is_fsdp(cls):  # fully_shard's dynamic subclass FSDP<Original>
            cls = next(base for base in cls.__bases__ if not _is_fsdp(base))
        twin = cls.__new__(cls)
        memo[id(module)] = twin
        state = {}
        for name, value in vars(module).items():
            if name.startswith(FSDP_STATE):
                continue
            if name.endswith("hooks") and isinstance(value, dict):
                value = type(value)(
                    (key, hook) for key, hook in value.items() if not _is_fsdp(hook)
                )
            state[name] = value
        kept = set(state["_forward_pre_hooks"]) | set(state["_forward_hooks"])
        for name in (
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
        ):  # keyed by the hooks above: those of the kept ones
            value = state[name]
            state[name] = type(value)((k, v) for k, v in value.items() if k in kept)
        state["_parameters"] = {
            name: None if p is None else self._twins.get(id(p), p)
            for name, p in module._parameters.items()
        }
        state["_modules"] = {
            name: None if child is None else self._twin(child, memo)
            for name, child in module._modules.items()
        }
        # the same buffers in its own registry: what the twin registers stays its own
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        twin.__dict__.update(state)
        return twin


def gathered_bytes(model: Module) -> int:
    """Bytes a rank adds by gathering ``model``'s sharded parameters whole."""
    params = {id(p): p for p in model.parameters() if is_sharded(p)}.values()
    return sum((p.numel() - p.to_local().numel()) * p.element_size() for p in params)


def check_gathered_fits(model: Module) -> int:
    """The bytes gathering ``model`` adds to a rank, checked on every rank.

    One ``all_gather_object`` of each rank's need and available bytes; where one
    rank lacks them, every rank of the model's mesh raises.

    Raises:
        ModelTooLargeError: If the gathered parameters exceed a rank's available
            memory (:func:`vivit.gram.memory.available_bytes`).
    """
    sharded = [p for p in model.parameters() if is_sharded(p)]
    if not sharded:  # every parameter left unsharded (FSDP's ignored_params)
        return 0
    mesh = sharded[0].device_mesh
    group = mesh.get_group() if mesh.ndim == 1 else None
    need = gathered_bytes(model)
    mine = (need, available_bytes(sharded[0].device))
    every: list[tuple[int, int]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    short = [
        f"rank {rank} needs {format_bytes(need)} with {format_bytes(free)} available"
        for rank, (need, free) in enumerate(every)
        if need > free
    ]
    if short:
        raise ModelTooLargeError(
            "The curvature of a model sharded with FSDP2 runs on a copy gathered "
            f"whole on every rank (docs/math.rst, 'Models sharded with FSDP2'): "
            f"{'; '.join(short)}. Free memory on those ranks (e.g. delete the "
            "optimizer's state first), run fewer ranks per machine so that each "
            "has room for the whole model, or ask for the curvature of a smaller "
            "model."
        )
    return need


def local_view(model: Module) -> tuple[Module, ParamPlacement]:
    """The module the curvature runs on, and where its parameters sit in ``model``.

    A ``DistributedDataParallel``'s ``.module`` (its forward prepares a gradient
    all-reduce that the curvature's backward must not trigger); an FSDP2 model's
    :class:`GatheredModel` twin; otherwise ``model`` itself.

    Raises:
        InvalidArgumentError: If ``model`` has ``DTensor`` parameters but no
            FSDP2 module (tensor parallelism).
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module, ParamPlacement()
    if any(_is_fsdp(type(m)) for m in model.modules()):
        gathered = GatheredModel(model)
        return gathered.module, gathered.placement
    if any(is_sharded(p) for p in model.parameters()):
        raise InvalidArgumentError(
            "The model has DTensor parameters but no module wrapped by "
            "torch.distributed.fsdp.fully_shard (tensor or other parallelism): only "
            "FSDP2's sharding is supported. Gather the parameters into a plain "
            "model (e.g. from its full state_dict), or shard it with fully_shard."
        )
    return model, ParamPlacement()
