"""The BackPACK extension that leaves factors of ``V`` on every parameter."""

from __future__ import annotations

from collections.abc import Sequence

from backpack.extensions.secondorder.hbp import LossHessianStrategy
from backpack.extensions.secondorder.sqrt_ggn import SqrtGGN
from torch import Tensor
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, Module, MSELoss

from vivit._memory import check_gram_fits
from vivit._validation import check_mc_samples, check_subsampling
from vivit.engines.backpack.dtype import avg_pool_extensions
from vivit.engines.backpack.layers import param_layer_extensions
from vivit.engines.backpack.losses import GramLoss
from vivit.engines.base import BatchInfo
from vivit.errors import UnsupportedLayerError
from vivit.losses import LossNormalization

#: Attribute under which every parameter receives its ParamContribution.
SAVEFIELD = "vivit_contribution"


class GramGGN(SqrtGGN):
    """Backpropagate the GGN square root; keep per-parameter factors, not ``V``.

    Extends BackPACK's ``SqrtGGN{Exact,MC}``: parameter-free layers backpropagate
    exactly as there; losses additionally record the :class:`BatchInfo` and fix
    the subsampling scale; Linear, convolution and BatchNorm layers save a
    :class:`~vivit.engines.base.ParamContribution` under ``param.vivit_contribution``.

    Args:
        mc_samples: ``0`` for the exact loss Hessian, else the number ``M`` of
            Monte-Carlo samples per datum.
        subsampling: Sample indices whose curvature is used; ``None`` for all.
        compute_gradients: Also keep per-sample gradient factors (needed for
            directional derivatives and Newton steps).
        num_grams: How many Gram matrices of side ``N·C`` the caller will hold at
            once (one per parameter group); used to refuse settings that cannot fit.

    Raises:
        ValueError: If ``mc_samples`` is negative or not an integer.
    """

    def __init__(
        self,
        mc_samples: int = 0,
        subsampling: Sequence[int] | None = None,
        compute_gradients: bool = False,
        num_grams: int = 1,
    ):
        self._mc_samples = check_mc_samples(mc_samples)
        self.compute_gradients = compute_gradients
        self.num_grams = num_grams
        self._batch: BatchInfo | None = None
        strategy = (
            LossHessianStrategy.EXACT
            if mc_samples == 0
            else LossHessianStrategy.SAMPLING
        )
        super().__init__(strategy, SAVEFIELD, check_subsampling(subsampling))

        own = {
            **param_layer_extensions(),
            **avg_pool_extensions(),
            MSELoss: GramLoss(),
            CrossEntropyLoss: GramLoss(),
            BCEWithLogitsLoss: GramLoss(),
        }
        for layer, module_extension in own.items():
            self.set_module_extension(layer, module_extension, overwrite=True)
        # BackPACK keeps its table private; read it once to name what is supported.
        self._supported = tuple(vars(self)["_BackpropExtension__module_extensions"])

    def get_num_mc_samples(self) -> int:
        """Number of Monte-Carlo samples ``M`` of the loss Hessian.

        Returns:
            ``M`` (``0`` when the exact loss Hessian is used).
        """
        return self._mc_samples

    def __call__(
        self, module: Module, g_inp: tuple[Tensor, ...], g_out: tuple[Tensor, ...]
    ):
        """Run the module extension of ``module``; refuse layers without one.

        Args:
            module: Layer whose backward hook fired.
            g_inp: Gradients w.r.t. its inputs.
            g_out: Gradients w.r.t. its output.

        Raises:
            UnsupportedLayerError: If the layer type has no module extension, or if
                the backward pass reaches it through an operation outside of
                ``torch.nn`` layers (e.g. a residual sum in a custom forward).
        """
        if type(module) not in self._supported:
            raise UnsupportedLayerError(
                unsupported_layer_message(module, self._supported)
            )
        try:
            super().__call__(module, g_inp, g_out)
        except AssertionError as error:
            if "expects a backpropagation quantity" not in str(error):
                raise
            raise UnsupportedLayerError(lost_quantity_message(module)) from error

    def start_batch(
        self, loss_module: Module, normalization: LossNormalization
    ) -> BatchInfo:
        """Record the batch context when the backward pass reaches the loss.

        Args:
            loss_module: The extended loss module.
            normalization: The loss's reduction and sample weights.

        Returns:
            The batch context of this backward pass.
        """
        inputs = loss_module.input0
        batch_size = inputs.shape[0]
        subsampling = check_subsampling(self.get_subsampling(), batch_size)
        samples = (
            tuple(range(batch_size)) if subsampling is None else tuple(subsampling)
        )
        columns = self._mc_samples or inputs[0].numel()
        check_gram_fits(
            len(samples) * columns, self.num_grams, inputs.dtype, inputs.device
        )
        self._batch = BatchInfo(
            normalization=normalization,
            ggn_samples=samples,
            columns_per_sample=columns,
            mc_samples=self._mc_samples,
        )
        return self._batch

    def current_batch(self, module: Module) -> BatchInfo:
        """The batch context of the running backward pass.

        Args:
            module: Layer asking (for the error message).

        Returns:
            The batch context recorded by the loss.

        Raises:
            RuntimeError: If the backward pass did not start at an extended loss.
        """
        if self._batch is None:
            raise RuntimeError(
                f"The backward pass reached {module} without passing through a loss "
                "module: compute the loss with an extended torch.nn loss module "
                "(MSELoss, CrossEntropyLoss or BCEWithLogitsLoss, wrapped by "
                "backpack.extend) and call backward on its output directly."
            )
        return self._batch


def unsupported_layer_message(module: Module, supported: Sequence[type]) -> str:
    """Explain that a layer is not supported and what to do instead.

    Args:
        module: The offending layer.
        supported: Layer classes the engine supports.

    Returns:
        The error message.
    """
    names = ", ".join(sorted(cls.__name__ for cls in supported))
    return (
        f"Layer {type(module).__name__} ({module.__class__.__module__}) is not "
        "supported "
        f"by the BackPACK engine. Supported layers: {names}. A module with a custom "
        "forward (e.g. a residual block) can often be converted: "
        "backpack.extend(model, use_converter=True). Architectures BackPACK cannot "
        "extend (attention, LayerNorm, weight sharing) need a matrix-free GGN for "
        "now (e.g. curvlinops' GGNLinearOperator with scipy.sparse.linalg.eigsh); a "
        "torch.func engine for them is planned."
    )


def lost_quantity_message(module: Module) -> str:
    """Explain that the backward pass reached a layer through an untracked operation.

    Args:
        module: The layer that received nothing to backpropagate.

    Returns:
        The error message.
    """
    return (
        f"The backward pass reached {module} without the square root of the GGN: "
        "between this layer and the loss, the model combines tensors outside of "
        "torch.nn layers (e.g. a residual sum x + block(x) or a concatenation in a "
        "custom forward), which BackPACK cannot follow. Convert the model with "
        "backpack.extend(model, use_converter=True), which turns such operations "
        "into layers BackPACK supports."
    )
