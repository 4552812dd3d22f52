"""Whether the BackPACK engine can run a model, and if not, why: decided before running.

A (nested) ``Sequential`` is read from its structure, any other forward traced with
``torch.fx`` as BackPACK's converter does.
"""

from __future__ import annotations

import operator
import os
import re
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cache

import torch
from backpack.custom_module.graph_utils import (
    BackpackTracer,
    convert_module_to_backpack,
)
from backpack.utils.module_classification import is_no_op
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import _get_qualified_name
from torch.nn import Module, Sequential
from torch.nn.utils.parametrize import is_parametrized

from vivit.engines.backpack.obstacles import (
    DROPS_OTHERS,
    Obstacle,
    bad_padding,
    forward_changes,
    refusal,
    unsupported_layer,
)
from vivit.engines.backpack.table import supported_types
from vivit.errors import SharedWeightError, UnsupportedLayerError
from vivit.losses import SUPPORTED_LOSSES as LOSSES
from vivit.model_copy import probe_copy_or_model

_TORCH_DIR = os.path.dirname(torch.__file__)
#: The library's own frames (its tracer) are not the user's call site either.
_VIVIT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@dataclass
class Analysis:
    """A model's obstacles (shared weights first) and whether to convert it.

    ``traced``: the traced forward over the caller's layers (``None``: a
    ``Sequential``, not traced), what BackPACK's converter converts instead of
    tracing the caller's forward again.
    """

    obstacles: list[Obstacle] = field(default_factory=list)
    needs_conversion: bool = False
    traced: GraphModule | None = None


def analyse(model: Module, loss_func: Module | None = None) -> Analysis:
    """The obstacles to the BackPACK engine in a model and loss; whether to convert."""
    changes = forward_changes(model)  # named after the layers' obstacles
    if loss_func is not None and type(loss_func) not in LOSSES:
        names = ", ".join(cls.__name__ for cls in LOSSES)
        message = (
            f"the loss {type(loss_func).__name__} has no BackPACK extension "
            f"(supported losses: {names})"
        )
        changes.append(Obstacle(UnsupportedLayerError, message, func_can=False))
    chain = _sequential_chain(model)
    if chain is not None:
        return _analyse_calls(model, [(name, "") for name in chain], changes)
    tracer = _GradModeTracer()
    tracer.record_stack_traces = True  # the call site of each node
    copy, _ = probe_copy_or_model(model)  # the caller's forward untouched
    try:
        with torch.enable_grad():  # the forward's own grad mode is recorded
            graph = tracer.trace(copy)
    except Exception as error:  # torch.fx raises many kinds of errors
        message = (
            f"its forward cannot be traced by torch.fx ({type(error).__name__}: "
            f"{error}), which BackPACK needs to follow the computation from layer "
            "to layer"
        )
        return Analysis([Obstacle(UnsupportedLayerError, message), *changes], True)
    calls = [(n.target, _where(n)) for n in graph.nodes if n.op == "call_module"]
    analysis = _analyse_calls(model, calls, changes)
    params = dict(model.named_parameters(remove_duplicate=False))
    analysis.obstacles.extend(
        _without_gradients(node)
        for node in graph.nodes
        if not node.meta.get(_GRAD_ENABLED, True)
    )
    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            analysis.needs_conversion = True
            if not _convertible(node):
                analysis.obstacles.append(_unsupported_function(node))
        elif node.op == "get_attr" and node.target in params:
            message = (
                f"the parameter `{node.target}` is used directly{_where(node)} not "
                "through a torch.nn layer"
            )
            analysis.obstacles.append(Obstacle(UnsupportedLayerError, message))
    # BackPACK's hooks would fire on every module whose forward runs: the model
    # and the modules traced through must be containers or supported layers.
    traced_through = {
        name
        for node in graph.nodes
        for name, _ in (node.meta.get("nn_module_stack") or {}).values()
        if name != node.target
    }
    analysis.needs_conversion |= any(
        not is_no_op(m) and type(m) not in supported_types()
        for m in [model, *map(model.get_submodule, traced_through)]
    )
    analysis.traced = _over_the_callers_layers(graph, model, copy)
    return analysis


def _over_the_callers_layers(graph: Graph, model: Module, copy: Module) -> GraphModule:
    """The graph traced on ``copy``, over ``model``'s layers (constants: the copy's)."""
    root = {}
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            try:
                value = operator.attrgetter(node.target)(model)
            except AttributeError:  # a constant the tracer kept on the copy
                value = operator.attrgetter(node.target)(copy)
            root[node.target] = value
    return GraphModule(root, graph)


def unsupported_reason(model: Module, loss_func: Module | None = None) -> str | None:
    """Why the BackPACK engine cannot run a model (and loss), or ``None`` if it can."""
    obstacles = analyse(model, loss_func).obstacles
    return str(refusal(obstacles)) if obstacles else None


def runnable_model(model: Module, loss_func: Module | None = None) -> Module:
    """The model, or BackPACK's conversion of it, for the BackPACK engine to run.

    The conversion switches the caller's layers to ``inplace=False`` (restore them
    with :func:`inplace_flags`).

    Raises:
        SharedWeightError: If a weight is used more than once in a forward pass.
        UnsupportedLayerError: If a layer, function or the loss cannot be handled.
    """
    analysis = analyse(model, loss_func)
    if analysis.obstacles:
        raise refusal(analysis.obstacles)
    if not analysis.needs_conversion:
        return model
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            converted = convert_module_to_backpack(
                analysis.traced or model, debug=False
            )
        left = [w for w in caught if str(w.message).startswith(_NODE_LEFT)]
        for warning in caught:
            if warning not in left:
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
        if left:  # the converter could not turn an operation into a layer
            raise RuntimeError(str(left[0].message))
    except Exception as error:
        message = (
            f"BackPACK's converter failed on its forward ({type(error).__name__}: "
            f"{error})"
        )
        raise refusal([Obstacle(UnsupportedLayerError, message)]) from error
    return converted


#: How BackPACK's converter warns about an operation it left in the graph.
_NODE_LEFT = "Encountered node that may break second-order extensions"


def inplace_flags(model: Module) -> dict[Module, bool]:
    """Each layer's ``inplace`` flag, where it has one, to restore after conversion."""
    return {
        m: m.inplace
        for m in model.modules()
        if isinstance(getattr(m, "inplace", None), bool)
    }


# Tracing ---------------------------------------------------------------------------
#: Node metadata: whether gradients were enabled where the forward called it.
_GRAD_ENABLED = "vivit_grad_enabled"


class _GradModeTracer(BackpackTracer):
    """BackPACK's tracer, recording the grad mode each node was created in."""

    def create_node(self, *args, **kwargs) -> Node:  # noqa: D102
        node = super().create_node(*args, **kwargs)
        node.meta[_GRAD_ENABLED] = torch.is_grad_enabled()
        return node


def _sequential_chain(model: Module) -> list[str] | None:
    """The layers a (nested) ``Sequential`` calls; ``None`` if a forward is custom."""
    names = {id(m): name for name, m in model.named_modules()}
    is_leaf = BackpackTracer().is_leaf_module
    chain = []
    stack = [model]
    while stack:
        module = stack.pop()
        if type(module) is Sequential:
            stack.extend(reversed(list(module)))
        elif is_leaf(module, names[id(module)]):
            chain.append(names[id(module)])
        else:
            return None
    return chain


def _convertible(node: Node) -> bool:
    """Whether BackPACK's converter turns this call into a layer (it drops keywords)."""
    args, target = node.args, node.target
    tensors = sum(isinstance(a, Node) for a in args)
    if node.kwargs or (len(args) != 2 and target not in (torch.flatten, "flatten")):
        return False
    if target in (operator.add, "add"):
        return tensors == 2
    if target is operator.mul:
        return tensors == sum(isinstance(a, float) for a in args) == 1
    if target == "multiply":
        return isinstance(args[1], float)
    return target in (torch.flatten, "flatten")


# Obstacles -------------------------------------------------------------------------
def _analyse_calls(
    model: Module, calls: list[tuple[str, str]], changes: list[Obstacle]
) -> Analysis:
    """The layer calls' ``(name, where)`` obstacles, then the forward's ``changes``."""
    targets = [target for target, _ in calls]
    analysis = Analysis(_shared_weights(model, targets))
    for target, where in calls:
        layer = model.get_submodule(target)
        if is_parametrized(layer):
            continue  # named by _forward_changes
        if type(layer) not in supported_types():
            cls = type(layer)
            name = f"`{target}` ({cls.__module__}.{cls.__qualname__}){where}"
            analysis.obstacles.append(unsupported_layer(name))
        else:
            analysis.obstacles.extend(bad_padding(layer, f"{target} ({layer})"))
    analysis.obstacles.extend(changes)
    # BackPACK stores one input per layer: a layer called twice must be copied
    analysis.needs_conversion = len(set(targets)) < len(targets)
    return analysis


def _where(node: Node) -> str:
    """``, called in the forward of `block` (Block) at file.py:12,`` (or less)."""
    stack = node.meta.get("nn_module_stack") or {}
    owners = [v for v in stack.values() if v[0] != node.target]
    location = _user_frame(node.stack_trace)
    if owners:
        name, cls = owners[-1]
        place = f" in the forward of `{name}` ({cls.__name__})"
    elif location:
        place = " in the model's forward"
    else:
        return ""
    return f", called{place}{f' at {location}' if location else ''},"


_FRAME = re.compile(r'File "(.*)", line (\d+), in ')


def _user_frame(stack_trace: str | None) -> str | None:
    """``file.py:12`` of the innermost call in the user's code, if recorded."""
    frames = _FRAME.findall(stack_trace or "")
    user = [f for f in frames if not f[0].startswith(("<", _TORCH_DIR, _VIVIT_DIR))]
    return f"{os.path.basename(user[-1][0])}:{user[-1][1]}" if user else None


def _function_name(node: Node) -> str:
    if node.op == "call_method":
        return f"tensor method `.{node.target}()`"
    try:
        name = _get_qualified_name(node.target)
    except Exception:  # objects without a qualified name
        name = repr(node.target)
    name = name.replace("_operator.", "operator.")
    return f"function `{name}`"


def _unsupported_function(node: Node) -> Obstacle:
    name = _function_name(node)
    short = str(node.target).rsplit(".", 1)[-1] if node.op == "call_method" else ""
    short = short or getattr(node.target, "__name__", "")
    layer = _layer_for().get(short.rstrip("_").replace("_", ""))
    instead = f" (use the layer torch.nn.{layer} instead)" if layer else ""
    return Obstacle(
        UnsupportedLayerError,
        f"the {name}{_where(node)} is not a torch.nn layer{instead}; between layers "
        "BackPACK follows only `+` of two tensors, multiplication by a float and "
        "flatten",
    )


def _shared_weights(model: Module, targets: list[str]) -> list[Obstacle]:
    """One obstacle per set of layer calls that share trainable parameters."""
    uses: dict[int, list[str]] = defaultdict(list)
    for target in targets:
        for param in model.get_submodule(target).parameters():
            if param.requires_grad:
                uses[id(param)].append(target)
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    shared: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for key, layers in uses.items():
        if len(layers) > 1:
            shared[tuple(layers)].append(f"`{names[key]}`")
    return [
        Obstacle(SharedWeightError, _shared_message(model, layers, params))
        for layers, params in shared.items()
    ]


def _shared_message(model: Module, layers: tuple[str, ...], params: list[str]) -> str:
    counts = Counter(layers)
    described = " and ".join(
        f"`{layer}` ({type(model.get_submodule(layer)).__name__})"
        + (f", called {count} times" if count > 1 else "")
        for layer, count in counts.items()
    )
    how = (
        f"layer {described}"
        if len(counts) == 1
        else f"weights tied between the layers {described}"
    )
    subject = (
        f"the parameter {params[0]} is"
        if len(params) == 1
        else f"the parameters {', '.join(params)} are"
    )
    how = f"{len(layers)} times in one forward pass ({how})"
    return f"{subject} used {how}, and {DROPS_OTHERS}"


def _without_gradients(node: Node) -> Obstacle:
    what = (
        f"layer `{node.target}`" if node.op == "call_module" else _function_name(node)
    )
    return Obstacle(
        UnsupportedLayerError,
        f"the {what}{_where(node)} runs with gradients disabled (torch.no_grad() "
        "inside the forward): autograd does not differentiate through it, and "
        "BackPACK's conversion of the forward would",
    )


@cache
def _layer_for() -> dict[str, str]:
    """Supported ``torch.nn`` layers by lowercase name: ``maxpool2d``: ``MaxPool2d``."""
    return {
        cls.__name__.lower(): cls.__name__
        for cls in supported_types()
        if cls.__module__.startswith("torch.nn") and cls not in LOSSES
    }
