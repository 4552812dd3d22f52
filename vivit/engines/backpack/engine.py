"""The BackPACK engine behind the engine seam: one backward pass in ``backpack()``.

BackPACK's hooks are there for that pass only (``backpack.extend`` never removes
them: later passes would warn, ``torch.func`` fail); modules the user extended keep
theirs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager

import torch
from backpack import backpack, hook_run_extensions, hook_store_io, memory_cleanup
from backpack.utils.module_classification import is_no_op
from torch import Tensor
from torch.nn import Module

from vivit._validation import check_batch_norms
from vivit.engines.backpack.extension import SAVEFIELD, GramGGN
from vivit.engines.backpack.obstacles import FUNC_HINT
from vivit.engines.backpack.support import inplace_flags, runnable_model
from vivit.engines.backpack.table import POOL_INDICES, store_pool_indices
from vivit.engines.base import (
    ContributionSink,
    CurvatureRequest,
    Engine,
    EngineOutput,
    OutputSelector,
    check_scalar_loss,
    graph_nodes,
    model_loss,
    select_output,
)
from vivit.errors import (
    GradientContextError,
    InvalidArgumentError,
    UnsupportedLayerError,
)
from vivit.model_inputs import ModelInputs, call_model

#: The attribute ``backpack.extend`` sets on the modules it extended.
EXTENDED_FLAG = "_backpack_extend"


@contextmanager
def extended(model: Module, loss_func: Module) -> Iterator[tuple[Module, Module]]:
    """Model and loss ready for a BackPACK backward pass, unchanged afterwards.

    On exit, also after an error, removes the hooks, what they stored and factors
    left on parameters, and restores ``inplace`` flags. Yields ``(net, loss_func)``,
    ``net`` the model or its conversion.

    Raises:
        SharedWeightError: If a weight is used more than once in a forward pass.
        UnsupportedLayerError: If a layer, function or the loss cannot be handled.
    """
    flags = inplace_flags(model)
    with ExitStack() as cleanup:
        for layer, inplace in flags.items():
            cleanup.callback(setattr, layer, "inplace", inplace)
        net = runnable_model(model, loss_func)
        cleanup.callback(_clean, [net, loss_func, model])  # net may be model
        for layer in [*net.modules(), *loss_func.modules()]:
            if not (is_no_op(layer) or _extended(layer)):
                # torch remembers full backward hooks and would refuse the caller's
                # register_backward_hook: forget them again
                previous = layer._is_full_backward_hook
                cleanup.callback(setattr, layer, "_is_full_backward_hook", previous)
                for hook in (hook_store_io, store_pool_indices):  # (max poolings)
                    cleanup.callback(layer.register_forward_hook(hook).remove)
                backward = layer.register_full_backward_hook(hook_run_extensions)
                cleanup.callback(backward.remove)
        yield net, loss_func


def _extended(layer: Module) -> bool:
    """Whether ``backpack.extend`` hooked the layer (a copy keeps the flag alone)."""
    hooks = layer._forward_hooks.values()
    return getattr(layer, EXTENDED_FLAG, False) and hook_store_io in hooks


def _clean(modules: list[Module]) -> None:
    """Drop the inputs/outputs BackPACK stored and factors left on parameters."""
    for module in modules:
        for layer in module.modules():
            memory_cleanup(layer)
            vars(layer).pop(POOL_INDICES, None)
        for param in module.parameters():
            vars(param).pop(SAVEFIELD, None)


class ContributionHook:
    """BackPACK extension hook: hand each parameter's contribution to ``sink``."""

    def __init__(self, sink: ContributionSink):
        self.sink = sink

    def __call__(self, module: Module) -> None:
        """Hand on the contributions of the layer BackPACK just processed."""
        for param in module.parameters(recurse=False):
            contribution = vars(param).pop(SAVEFIELD, None)
            if contribution is not None:
                self.sink.add(param, contribution)


class BackpackEngine(Engine):
    """Curvature factors from BackPACK's second-order backward pass."""

    name = "backpack"

    def run(  # noqa: D102
        self,
        model: Module,
        loss_func: Module,
        data: tuple[ModelInputs, Tensor],
        request: CurvatureRequest,
        sink: ContributionSink,
    ) -> EngineOutput:
        inputs, targets = data
        check_batch_norms(model)

        with extended(model, loss_func) as (net, loss_module):

            def compute_loss() -> Tensor:
                output = _returned_output(call_model(net, inputs), request.output)
                return model_loss(loss_module, output, targets)[0]

            return self.run_loss(compute_loss, request, sink)

    def run_loss(
        self,
        compute_loss: Callable[[], Tensor],
        request: CurvatureRequest,
        sink: ContributionSink,
    ) -> EngineOutput:
        """Like :meth:`run`, the loss computed by extended modules (``compute_loss``).

        Leaves the ``.grad`` of every leaf the backward pass reaches as it was.

        Raises:
            InvalidArgumentError: If the loss is not a scalar tensor, or the
                closure called ``backward()``.
            GradientContextError: If the loss was computed without gradients.
        """
        extension = GramGGN(
            mc_samples=request.mc_samples,
            mc_per=request.mc_per,
            subsampling=request.subsampling,
            compute_gradients=request.compute_gradients,
            num_grams=request.grams_formed,
            gram_dtype=request.gram_dtype,
        )
        params = request.params
        saved = [(p, p.grad) for p in params]
        own = {id(p) for p in params}
        for param in params:  # autograd would accumulate into them in place
            param.grad = None
        try:
            with torch.enable_grad():
                if request.mc_samples and (generator := request.generator):
                    seed = torch.randint(
                        2**62, (), generator=generator, device=generator.device
                    )
                    torch.manual_seed(int(seed))  # the caller forks the RNG
                loss = _check_loss(compute_loss(), params)
                # every leaf the backward pass reaches (inputs with requires_grad,
                # parameters outside the groups) gets its .grad back afterwards
                leaves = (getattr(n, "variable", None) for n in graph_nodes(loss))
                for leaf in leaves:  # the variables of AccumulateGrad nodes
                    if isinstance(leaf, Tensor) and id(leaf) not in own:
                        own.add(id(leaf))
                        saved.append((leaf, leaf.grad))
                        leaf.grad = None  # autograd may accumulate in place
                with (
                    backpack(extension, extension_hook=ContributionHook(sink)),
                    warnings.catch_warnings(),
                ):  # BackPACK's hooks fire on the first layer (its input: no grad)
                    warnings.filterwarnings("ignore", "Full backward hook is firing")
                    loss.backward()
            _check_loss_module_output(loss, extension.loss_output)
            gradients = [
                torch.zeros_like(p) if p.grad is None else p.grad for p in params
            ]
        finally:
            for tensor, grad in saved:
                tensor.grad = grad
        return EngineOutput(loss=loss.detach(), gradients=gradients)


def _returned_output(returned: object, selector: OutputSelector) -> Tensor:
    """The selected output, which must be a tensor the model returned."""
    output = select_output(returned, selector)
    if not any(output is tensor for tensor in _tensors_in(returned)):
        raise UnsupportedLayerError(
            f"The BackPACK engine cannot handle this model: the output selected by "
            f"output={'<function>' if callable(selector) else repr(selector)} is "
            "computed from what the model returns, not one of the returned tensors; "
            "BackPACK would skip that computation. Select a returned tensor (by "
            f"name or position), or use engine='func', which handles it. {FUNC_HINT}"
        )
    return output


def _tensors_in(returned: object, depth: int = 3) -> list[Tensor]:
    """The tensors a (nested) structured output holds."""
    if isinstance(returned, Tensor):
        return [returned]
    if depth == 0:
        return []
    if isinstance(returned, Mapping):
        entries = list(returned.values())
    elif isinstance(returned, (tuple, list)):
        entries = list(returned)
    else:
        entries = list(getattr(returned, "__dict__", {}).values())
    return [t for entry in entries for t in _tensors_in(entry, depth - 1)]


def _check_loss_module_output(loss: Tensor, loss_output: Tensor | None) -> None:
    """Refuse a loss computed from the loss module's output other than by a constant."""
    if loss_output is not None and not _offset_of(loss, loss_output):
        computed = type(_origin(loss.grad_fn)).__name__
        raise InvalidArgumentError(
            "The loss is not the loss module's output itself but computed from it "
            f"(last operation {computed}): the GGN would be the loss module's and "
            "the gradient another function's. Return loss_func(model(inputs), "
            "targets) unchanged (a constant added is fine); scale through the "
            "loss's reduction, and add a regularizer's curvature and gradient to "
            "the step yourself."
        )


def _offset_of(loss: Tensor, loss_output: Tensor) -> bool:
    """Whether ``loss`` is ``loss_output`` plus constants (no other gradient path)."""
    node, target = _origin(loss.grad_fn), _origin(loss_output.grad_fn)
    while node is not target:
        name = type(node).__name__
        if not name.startswith(("AddBackward", "SubBackward")):
            return False
        inputs = [fn for fn, _ in node.next_functions]
        branches = [(i, fn) for i, fn in enumerate(inputs) if fn is not None]
        if len(branches) != 1 or (name.startswith("Sub") and branches[0][0] != 0):
            return False  # another path with gradients, or a negated loss
        node = _origin(branches[0][1])
    return True


def _origin(node: object) -> object:
    """The autograd node behind module backward hooks' identity nodes."""
    while type(node).__name__ == "BackwardHookFunctionBackward":
        node = node.next_functions[0][0]
    return node


def _check_loss(loss: object, params: Sequence[Tensor]) -> Tensor:
    """What the forward pass returned, checked before the backward pass runs on it."""
    if not isinstance(loss, Tensor):
        raise InvalidArgumentError(
            f"The loss must be a tensor, got {type(loss).__name__}: the closure must "
            "return the loss, e.g. lambda: loss_func(model(inputs), targets)."
        )
    check_scalar_loss(loss)
    if any(p.grad is not None for p in params):
        raise InvalidArgumentError(
            "The closure called backward() (the parameters received gradients "
            "while it ran): return the loss without calling backward; the library "
            "runs its own backward pass."
        )
    if not loss.requires_grad:
        raise GradientContextError(
            "The loss does not require gradients: it was computed inside "
            "torch.no_grad() (or from detached tensors). Pass a function that "
            "computes the loss instead of the tensor; the library enables "
            "gradients for it."
        )
    return loss
