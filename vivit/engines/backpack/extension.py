"""The BackPACK extension that leaves factors of ``V`` on every parameter."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from backpack.extensions.secondorder.hbp import LossHessianStrategy
from backpack.extensions.secondorder.sqrt_ggn import SqrtGGN
from backpack.utils.module_classification import is_loss
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.loss import _Loss

from vivit._validation import (
    check_subsampling,
    warn_random_forward,
)
from vivit.engines.backpack.obstacles import (
    FUNC_HINT,
    global_hook_obstacles,
    module_forward_changes,
    refusal,
)
from vivit.engines.backpack.support import analyse
from vivit.engines.backpack.table import (
    LOSSES,
    module_extensions,
    supported_layer_names,
    supported_types,
)
from vivit.engines.base import BatchInfo
from vivit.errors import (
    InvalidArgumentError,
    SharedWeightError,
    UnsupportedLayerError,
    UnsupportedLossError,
)
from vivit.gram.memory import check_gram_fits
from vivit.losses import LossCurvature, check_loss_function

#: Attribute under which every parameter receives its ParamContribution.
SAVEFIELD = "vivit_contribution"


class GramGGN(SqrtGGN):
    """Backpropagate the GGN square root; keep per-parameter factors, not ``V``.

    Extends BackPACK's ``SqrtGGN{Exact,MC}``: losses also record the :class:`BatchInfo`
    and the subsampling scale; layers with parameters save a
    :class:`~vivit.engines.base.ParamContribution` under ``param.vivit_contribution``.
    The arguments come checked (:class:`~vivit.options.CurvatureOptions`, or
    :mod:`vivit.compat`).

    Args:
        mc_samples: ``0`` for the exact loss Hessian, else the number ``M`` of
            Monte-Carlo samples per datum.
        mc_per: What one draw of a cross-entropy output ``[N, C, *T]`` becomes:
            ``"token"`` (a column per position) or ``"sequence"``.
        subsampling: Sample indices whose curvature is used; ``None`` for all.
        compute_gradients: Also keep per-sample gradient factors.
        num_grams: How many Gram matrices of side ``N·C`` the caller will hold at
            once; settings that cannot fit are refused.
        gram_dtype: Type the caller accumulates the Gram matrices in (``None``:
            the model's), for the same check.
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
        self._mc_samples = mc_samples
        self.mc_per = mc_per
        self.compute_gradients = compute_gradients
        self.num_grams = num_grams
        self.gram_dtype = gram_dtype
        self._batch: BatchInfo | None = None
        strategy = (
            LossHessianStrategy.EXACT
            if mc_samples == 0
            else LossHessianStrategy.SAMPLING
        )
        super().__init__(strategy, SAVEFIELD, subsampling)
        # The engine's own table replaces every entry of SqrtGGN's; layers outside
        # it are refused in __call__ before BackPACK looks anything up.
        for layer, module_extension in module_extensions().items():
            self.set_module_extension(layer, module_extension, overwrite=True)
        # Layers and trainable parameters seen in the running backward pass.
        self._seen_layers: set[int] = set()
        self._seen_params: set[int] = set()
        #: The output of the loss module the backward pass started from.
        self.loss_output: Tensor | None = None

    def get_num_mc_samples(self) -> int:
        """Number of Monte-Carlo samples ``M`` of the loss Hessian (``0``: exact)."""
        return self._mc_samples

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
        changes = module_forward_changes(module, where) + global_hook_obstacles()
        if changes:
            raise refusal(changes)
        warn_random_forward(module)
        if is_loss(module):  # every backward pass starts at the loss
            if not hasattr(module, "output"):  # BackPACK keeps the latest call's
                raise InvalidArgumentError(
                    f"The backward pass reached {module} for a second call: the "
                    "loss was computed from more than one call of the loss module "
                    "(e.g. a sum of two losses). Compute it in one call on the "
                    "whole batch, loss_func(model(inputs), targets), or pass a "
                    "data loader for several batches."
                )
            self.loss_output = module.output
            self._seen_layers.clear()
            self._seen_params.clear()
        params = [p for p in module.parameters() if p.requires_grad]
        if id(module) in self._seen_layers or any(
            id(p) in self._seen_params for p in params
        ):
            raise SharedWeightError(shared_weight_message(module, bool(params)))
        try:
            super().__call__(module, g_inp, g_out)
        except AssertionError as error:
            if "expects a backpropagation quantity" not in str(error):
                raise
            if self._batch is None:  # the backward pass did not start at a loss
                self.current_batch(module)
            raise UnsupportedLayerError(lost_quantity_message(module)) from error
        self._seen_layers.add(id(module))
        self._seen_params.update(id(p) for p in params)

    def start_batch(self, loss_module: Module, curvature: LossCurvature) -> BatchInfo:
        """Record the batch context when the backward pass reaches the loss."""
        inputs = loss_module.input0
        batch_size = inputs.shape[0]
        subsampling = check_subsampling(self.get_subsampling(), batch_size)
        samples = (
            tuple(range(batch_size)) if subsampling is None else tuple(subsampling)
        )
        columns = curvature.columns_per_sample(self._mc_samples, self.mc_per)
        check_gram_fits(
            len(samples) * columns,
            self.num_grams,
            self.gram_dtype or inputs.dtype,
            inputs.device,
        )
        self._batch = BatchInfo(
            normalization=curvature.normalization,
            ggn_samples=samples,
            columns_per_sample=columns,
            mc_samples=self._mc_samples,
        )
        return self._batch

    def current_batch(self, module: Module) -> BatchInfo:
        """The batch context the loss recorded for the running backward pass.

        Raises:
            UnsupportedLossError: If the backward pass did not start at an extended
                loss module (the error names ``module``, the layer asking).
        """
        if self._batch is None:
            raise UnsupportedLossError(
                f"The backward pass reached {module} without passing through a loss "
                "module: compute the loss with an extended torch.nn loss module "
                "(MSELoss, CrossEntropyLoss or BCEWithLogitsLoss, wrapped by "
                "backpack.extend) and call backward on its output directly."
            )
        return self._batch


def unsupported_layer_error(module: Module) -> UnsupportedLayerError:
    """The error for a layer without a module extension, naming what fails inside.

    Returns:
        The error to raise (a :class:`~vivit.SharedWeightError` if the problem
        inside a layer with a custom forward is a shared weight).
    """
    name = f"{type(module).__name__} ({type(module).__module__})"
    if is_loss(module):
        losses = ", ".join(cls.__name__ for cls in LOSSES)
        return UnsupportedLayerError(
            f"The loss {name} has no BackPACK extension. Supported losses: {losses}."
        )
    if next(module.children(), None) is not None:
        obstacles = analyse(module).obstacles
        if obstacles:
            return refusal(obstacles, context=f"Inside layer {name}: ")
        return UnsupportedLayerError(
            f"Layer {name} has a custom forward, which BackPACK cannot backpropagate "
            "through as one layer. LowRankGGN(model, ...) converts such models "
            "itself; with the hook API, extend the converted model: "
            "model = backpack.extend(model, use_converter=True)."
        )
    return UnsupportedLayerError(
        f"The BackPACK engine cannot handle this model: layer {name} has no "
        f"BackPACK extension. Supported layers: {supported_layer_names()}. "
        f"{FUNC_HINT}"
    )


def shared_weight_message(module: Module, has_params: bool) -> str:
    """The error for a layer or weight the backward pass reached a second time."""
    if not has_params:
        return (
            f"The backward pass reached {module} a second time: the layer is called "
            "more than once in one forward pass, and BackPACK stores one input per "
            "layer. Use a separate instance for every call, or let "
            "LowRankGGN(model, ...) convert the model (it copies such layers); "
            "with the hook API, model = backpack.extend(model, use_converter=True)."
        )
    return (
        f"The BackPACK engine cannot handle this model: the backward pass reached "
        f"{module}, or one of its parameters, a second time, so a weight is used "
        "more than once in one forward pass (a layer called twice, or weights tied "
        "between layers). BackPACK keeps one contribution per parameter and would "
        f"drop the others. {FUNC_HINT}"
    )


def lost_quantity_message(module: Module) -> str:
    """Explain that the backward pass reached a layer through an untracked operation."""
    return (
        f"The backward pass reached {module} without the square root of the GGN: "
        "between this layer and the loss, the forward combines tensors outside of "
        "torch.nn layers, which BackPACK cannot follow. BackPACK's converter turns "
        "`+` of two tensors, multiplication by a float and flatten into layers "
        "(LowRankGGN(model, ...) converts models itself; with the hook API, use "
        "model = backpack.extend(model, use_converter=True)); any other function "
        f"(torch.cat, F.relu, ...) needs a supported layer in its place. {FUNC_HINT}"
    )
