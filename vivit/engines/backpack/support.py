"""Whether the BackPACK engine can run a model, and if not, why: decided before running.

:func:`analyse` reads a (nested) ``Sequential`` from its structure and traces any
other forward with ``torch.fx``, as BackPACK's converter does (it turns ``+`` of
tensors, multiplication by a float and ``flatten`` into layers). It names each
obstacle and where the forward meets it: a layer without a module extension, a
function the converter cannot turn into a layer, a weight used twice in one forward
pass, a forward ``torch.fx`` cannot trace, and a forward that differs from its chain
of layers (user hooks, parametrizations, ``torch.no_grad()`` inside it).
"""

from __future__ import annotations

import operator
import os
import re
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from backpack.custom_module.graph_utils import (
    BackpackTracer,
    convert_module_to_backpack,
)
from backpack.utils.module_classification import is_no_op
from torch.fx import Graph, Node
from torch.fx.node import _get_qualified_name
from torch.nn import Module, Parameter, Sequential
from torch.nn.modules.conv import _ConvNd
from torch.nn.utils.parametrize import is_parametrized

from vivit.engines.backpack.obstacles import (
    Obstacle,
    global_hook_obstacles,
    module_forward_changes,
    refusal,
)
from vivit.engines.backpack.table import LOSSES, supported_types
from vivit.errors import SharedWeightError, UnsupportedLayerError

_TORCH_DIR = os.path.dirname(torch.__file__)
#: The library's own frames (its tracer) are not the user's call site either.
_VIVIT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@dataclass
class Analysis:
    """What the BackPACK engine needs to know about a model.

    Attributes:
        obstacles: Shared weights first, then the rest in forward order.
        needs_conversion: Whether it must run BackPACK's converted model.
    """

    obstacles: list[Obstacle] = field(default_factory=list)
    needs_conversion: bool = False


def analyse(model: Module) -> Analysis:
    """The obstacles to the BackPACK engine in a model; whether it must be converted."""
    changes = _forward_changes(model)
    chain = _sequential_chain(model)
    if chain is not None:
        analysis = _analyse_calls(model, [(name, "") for name in chain])
        analysis.obstacles.extend(changes)
        return analysis
    try:
        with torch.enable_grad():  # the forward's own grad mode is recorded
            graph = _trace(model)
    except Exception as error:  # torch.fx raises many kinds of errors
        message = (
            f"its forward cannot be traced by torch.fx ({type(error).__name__}: "
            f"{error}), which BackPACK needs to follow the computation from layer "
            "to layer"
        )
        return Analysis([Obstacle(UnsupportedLayerError, message), *changes], True)
    calls = [(n.target, _where(n)) for n in graph.nodes if n.op == "call_module"]
    analysis = _analyse_calls(model, calls)
    analysis.obstacles.extend(changes)
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
        elif node.op == "get_attr" and isinstance(
            _get_attr(model, node.target), Parameter
        ):
            analysis.obstacles.append(_direct_parameter(node))
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
    return analysis


def unsupported_reason(model: Module, loss_func: Module | None = None) -> str | None:
    """Why the BackPACK engine cannot run a model (and loss), or ``None`` if it can."""
    obstacles = _obstacles(analyse(model), loss_func)
    return str(refusal(obstacles)) if obstacles else None


def runnable_model(model: Module, loss_func: Module | None = None) -> Module:
    """The module the BackPACK engine runs in place of ``model``, after checking it.

    The model itself, or BackPACK's conversion of it (a ``torch.fx.GraphModule``
    calling the same layers), which switches the caller's layers to ``inplace=False``
    (restore them with :func:`inplace_flags`). ``loss_func``, if given, is checked too.

    Returns:
        A module computing the same function with the same parameters.

    Raises:
        SharedWeightError: If a weight is used more than once in a forward pass.
        UnsupportedLayerError: If a layer, function or the loss cannot be handled.
    """
    analysis = analyse(model)
    obstacles = _obstacles(analysis, loss_func)
    if obstacles:
        raise refusal(obstacles)
    if not analysis.needs_conversion:
        return model
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            converted = convert_module_to_backpack(model, debug=False)
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
    """BackPACK's tracer, recording the grad mode each node was created in.

    Tracing runs the forward's ``torch.no_grad()`` blocks; the graph does not keep them.
    """

    def create_node(self, *args, **kwargs) -> Node:  # noqa: D102
        node = super().create_node(*args, **kwargs)
        node.meta[_GRAD_ENABLED] = torch.is_grad_enabled()
        return node


def _trace(model: Module) -> Graph:
    """The forward as BackPACK's converter sees it, with the call site of each node."""
    tracer = _GradModeTracer()
    tracer.record_stack_traces = True
    return tracer.trace(model)


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


def _get_attr(model: Module, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(model.get_submodule(owner), name)


def _convertible(node: Node) -> bool:
    """Whether BackPACK's converter turns this call into a layer (it drops keywords)."""
    args, kwargs = node.args, node.kwargs
    tensors = [isinstance(a, Node) for a in args]
    if node.op == "call_function":
        if node.target is operator.add:
            return len(args) == 2 and all(tensors) and not kwargs
        if node.target is operator.mul:
            floats = sum(isinstance(a, float) for a in args)
            return len(args) == 2 and sum(tensors) == floats == 1 and not kwargs
        return node.target is torch.flatten and not kwargs
    if node.target == "add":
        return len(args) == 2 and all(tensors) and not kwargs
    if node.target == "multiply":
        return len(args) == 2 and isinstance(args[1], float) and not kwargs
    return node.target == "flatten" and not kwargs


# Obstacles -------------------------------------------------------------------------
def _analyse_calls(model: Module, calls: list[tuple[str, str]]) -> Analysis:
    """Obstacles among the layer calls ``(name, where)`` of one forward pass."""
    targets = [target for target, _ in calls]
    analysis = Analysis(_shared_weights(model, targets))
    for target, where in calls:
        layer = model.get_submodule(target)
        if is_parametrized(layer):
            continue  # named by _forward_changes
        if type(layer) not in supported_types():
            analysis.obstacles.append(_unsupported_layer(target, layer, where))
        elif isinstance(layer, _ConvNd) and (
            layer.padding_mode != "zeros" or isinstance(layer.padding, str)
        ):
            message = (
                f"{target} ({layer}) pads with padding={layer.padding!r}, "
                f"padding_mode={layer.padding_mode!r}, which BackPACK's convolution "
                "derivatives get wrong (use integer padding with "
                "padding_mode='zeros', or pad before the convolution)"
            )
            analysis.obstacles.append(Obstacle(UnsupportedLayerError, message))
    # BackPACK stores one input per layer: a layer called twice must be copied
    analysis.needs_conversion = len(set(targets)) < len(targets)
    return analysis


def _obstacles(analysis: Analysis, loss_func: Module | None) -> list[Obstacle]:
    obstacles = list(analysis.obstacles)
    if loss_func is not None and type(loss_func) not in LOSSES:
        names = ", ".join(cls.__name__ for cls in LOSSES)
        message = (
            f"the loss {type(loss_func).__name__} has no BackPACK extension "
            f"(supported losses: {names})"
        )
        obstacles.append(Obstacle(UnsupportedLayerError, message, func_can=False))
    return obstacles


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
    user = [
        (path, line)
        for path, line in frames
        if not path.startswith(("<", _TORCH_DIR, _VIVIT_DIR))
    ]
    if not user:
        return None
    path, line = user[-1]
    return f"{os.path.basename(path)}:{line}"


def _unsupported_layer(target: str, layer: Module, where: str) -> Obstacle:
    cls = type(layer)
    name = f"`{target}` ({cls.__module__}.{cls.__qualname__})"
    return Obstacle(
        UnsupportedLayerError,
        f"layer {name}{where} has no BackPACK extension",
        layer=True,
    )


def _function_name(node: Node) -> str:
    if node.op == "call_method":
        return f"tensor method `.{node.target}()`"
    try:
        name = _get_qualified_name(node.target)
    except Exception:  # objects without a qualified name
        name = repr(node.target)
    name = name.replace("_operator.", "operator.")
    return f"function `{name}`"


#: Supported layers that do what a function of the same name does.
_LAYER_FOR = {
    "relu": "ReLU",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
    "leaky_relu": "LeakyReLU",
    "elu": "ELU",
    "selu": "SELU",
    "logsigmoid": "LogSigmoid",
    "dropout": "Dropout",
    "max_pool1d": "MaxPool1d",
    "max_pool2d": "MaxPool2d",
    "max_pool3d": "MaxPool3d",
    "avg_pool1d": "AvgPool1d",
    "avg_pool2d": "AvgPool2d",
    "avg_pool3d": "AvgPool3d",
    "linear": "Linear",
    "conv1d": "Conv1d",
    "conv2d": "Conv2d",
    "conv3d": "Conv3d",
}


def _unsupported_function(node: Node) -> Obstacle:
    name = _function_name(node)
    short = str(node.target).rsplit(".", 1)[-1] if node.op == "call_method" else ""
    short = short or getattr(node.target, "__name__", "")
    layer = _LAYER_FOR.get(short.rstrip("_"))
    instead = f" (use the layer torch.nn.{layer} instead)" if layer else ""
    return Obstacle(
        UnsupportedLayerError,
        f"the {name}{_where(node)} is not a torch.nn layer{instead}; between layers "
        "BackPACK follows only `+` of two tensors, multiplication by a float and "
        "flatten",
    )


def _direct_parameter(node: Node) -> Obstacle:
    return Obstacle(
        UnsupportedLayerError,
        f"the parameter `{node.target}` is used directly{_where(node)} not through a "
        "torch.nn layer",
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
    return (
        f"{subject} used {len(layers)} times in one forward pass ({how}), and "
        "BackPACK keeps one contribution per parameter: it would drop the others"
    )


# Forwards that are not the chain of layers ------------------------------------------
def _forward_changes(model: Module) -> list[Obstacle]:
    """Hooks and parametrizations that make the forward differ from its layers."""
    obstacles = []
    for name, module in model.named_modules():
        where = f"`{name}` ({type(module).__name__})" if name else "the model"
        obstacles.extend(module_forward_changes(module, where))
    return obstacles + global_hook_obstacles()


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
