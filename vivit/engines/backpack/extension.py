"""The BackPACK extension that leaves factors of ``V`` on every parameter."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from backpack.extensions.secondorder.hbp import LossHessianStrategy
from backpack.extensions.secondorder.sqrt_ggn import SqrtGGN
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.loss import _Loss

from vivit._validation import check_subsampling, warn_random_forward
from vivit.engines.backpack.obstacles import (
    DROPS_OTHERS,
    FUNC_HINT,
    Obstacle,
    bad_padding,
    forward_changes,
    refusal,
    unsupported_layer,
)
from vivit.engines.backpack.support import analyse
from vivit.engines.backpack.table import module_extensions, supported_types
from vivit.engines.base import BatchInfo, CurvatureRequest
from vivit.errors import (
    InvalidArgumentError,
    SharedWeightError,
    UnsupportedLayerError,
    UnsupportedLossError,
)
from vivit.losses import LossCurvature, check_loss_function

#: Attribute under which every parameter receives its ParamContribution.
SAVEFIELD = "vivit_contribution"
#: Who converts a model for BackPACK.
_CONVERT = (
    "LowRankGGN(model, ...) converts models itself; with the hook API, use "
    "model = backpack.extend(model, use_converter=True)"
)


class GramGGN(SqrtGGN):
    """BackPACK's ``SqrtGGN`` keeping each parameter's factors, not ``V``.

    Layers with parameters save a :class:`~vivit.engines.base.ParamContribution`
    under ``param.vivit_contribution``. The arguments (checked) are those of
    :class:`~vivit.engines.base.CurvatureRequest`.
    """

    def __init__(
        self,
        mc_samples: int = 0,
        subsampling: Sequence[int] | None = None,
        compute_gradients: bool = False,
        mc_per: str = "sequence",
        num_grams: int = 1,
        gram_dtype: torch.dtype | None = None,
    ):
        # the request's fields in order: groups, mc_samples, mc_per, subsampling,
        # generator, compute_gradients, num_grams, gram_dtype
        fields = (mc_samples, mc_per, subsampling, None, compute_gradients, num_grams)
        self.request = CurvatureRequest([], *fields, gram_dtype)
        self._batch: BatchInfo | None = None
        strategy = (
            LossHessianStrategy.SAMPLING if mc_samples else LossHessianStrategy.EXACT
        )
        super().__init__(strategy, SAVEFIELD, subsampling)
        # The engine's own table replaces every entry of SqrtGGN's; layers outside
        # it are refused in __call__ before BackPACK looks anything up.
        for layer, module_extension in module_extensions().items():
            self.set_module_extension(layer, module_extension, overwrite=True)
        # ids of the layers and trainable parameters the backward pass reached
        self._seen: set[int] = set()
        #: The output of the loss module the backward pass started from.
        self.loss_output: Tensor | None = None

    def get_num_mc_samples(self) -> int:
        """Number of Monte-Carlo samples ``M`` of the loss Hessian (``0``: exact)."""
        return self.request.mc_samples

    def __call__(
        self, module: Module, g_inp: tuple[Tensor, ...], g_out: tuple[Tensor, ...]
    ):
        """Run the module extension of ``module``; refuse what it cannot handle.

        Raises:
            UnsupportedLayerError: If the layer type has no module extension, or if
                the backward pass reaches it through an operation outside of
                ``torch.nn`` layers (e.g. a residual sum in a custom forward).
            SharedWeightError: If the layer, or one of its parameters, was already
                reached in this backward pass (a weight used twice in the forward).
        """
        if isinstance(module, _Loss):
            check_loss_function(module)  # names unsupported losses and options
        if type(module) not in supported_types():
            raise unsupported_layer_error(module)
        # a loss computed elsewhere (from_loss, the ViViT classes) is held to the
        # rule a model is checked by before its forward pass
        where = f"The {type(module).__name__} layer"
        changes = forward_changes(module, where) + bad_padding(module, where)
        if changes:
            raise refusal(changes)
        warn_random_forward(module)
        if isinstance(module, _Loss):  # every backward pass starts at the loss
            if not hasattr(module, "output"):  # BackPACK keeps the latest call's
                raise InvalidArgumentError(
                    f"The backward pass reached {module} for a second call: the "
                    "loss was computed from more than one call of the loss module "
                    "(e.g. a sum of two losses). Compute it in one call on the "
                    "whole batch, loss_func(model(inputs), targets), or pass a "
                    "data loader for several batches."
                )
            self.loss_output = module.output
            self._seen.clear()
        params = [p for p in module.parameters() if p.requires_grad]
        if any(id(x) in self._seen for x in [module, *params]):
            raise _reached_again(module, params)
        try:
            super().__call__(module, g_inp, g_out)
        except AssertionError as error:
            if "expects a backpropagation quantity" not in str(error):
                raise
            if self._batch is None:  # the backward pass did not start at a loss
                self.current_batch(module)
            raise UnsupportedLayerError(
                f"The backward pass reached {module} without the square root of the "
                "GGN: between this layer and the loss, the forward combines tensors "
                "outside of torch.nn layers, which BackPACK cannot follow. BackPACK's "
                "converter turns `+` of two tensors, multiplication by a float and "
                f"flatten into layers ({_CONVERT}); any other function (torch.cat, "
                "F.relu, ...) "
                f"needs a supported layer in its place. {FUNC_HINT}"
            ) from error
        self._seen.update(id(x) for x in [module, *params])

    def start_batch(self, loss_module: Module, curvature: LossCurvature) -> BatchInfo:
        """Record the batch when the backward pass reaches the loss."""
        output = loss_module.input0
        check_subsampling(self.get_subsampling(), output.shape[0])
        self._batch = BatchInfo.of(curvature, output, self.request)
        return self._batch

    def current_batch(self, module: Module) -> BatchInfo:
        """The batch the loss recorded for the running backward pass.

        Raises:
            UnsupportedLossError: If the pass did not start at an extended loss.
        """
        if self._batch is None:
            raise UnsupportedLossError(
                f"The backward pass reached {module} without passing through a loss "
                "module: compute the loss with an extended torch.nn loss module "
                "(MSELoss, CrossEntropyLoss or BCEWithLogitsLoss, wrapped by "
                "backpack.extend) and call backward on its output directly."
            )
        return self._batch


def unsupported_layer_error(module: Module) -> Exception:
    """The error for a layer without a module extension, naming what fails inside."""
    name = f"{type(module).__name__} ({type(module).__module__})"
    if next(module.children(), None) is None:
        return refusal([unsupported_layer(name)])
    obstacles = analyse(module).obstacles  # a SharedWeightError if one is shared
    if obstacles:
        return refusal(obstacles, context=f"Inside layer {name}: ")
    return UnsupportedLayerError(
        f"Layer {name} has a custom forward, which BackPACK cannot backpropagate "
        f"through as one layer. {_CONVERT}."
    )


def _reached_again(module: Module, params: list[Tensor]) -> Exception:
    """The error for a layer or weight the backward pass reached a second time."""
    if params:
        message = (
            f"the backward pass reached {module}, or one of its parameters, a second "
            "time: a weight is used more than once in one forward pass (a layer "
            f"called twice, or weights tied between layers), and {DROPS_OTHERS}"
        )
        return refusal([Obstacle(SharedWeightError, message)])
    return SharedWeightError(
        f"The backward pass reached {module} a second time: the layer is called "
        "more than once in one forward pass, and BackPACK stores one input per "
        "layer. Use a separate instance for every call, or let BackPACK's "
        f"converter copy such layers: {_CONVERT}."
    )
