"""Max-pooling derivatives that reuse the forward pass's argmax indices.

BackPACK's derivatives recompute the pooling in every backward product to find the
argmax; autograd already saved it (``result1`` of the forward's backward node). It
is used where it belongs to the output BackPACK stored; otherwise (``MaxPool1d``,
the caller's ``backpack.extend`` hooks, no gradients) the pooling is recomputed.
"""

from __future__ import annotations

from functools import cache

from backpack.core.derivatives.maxpool1d import MaxPool1DDerivatives
from backpack.core.derivatives.maxpool2d import MaxPool2DDerivatives
from backpack.core.derivatives.maxpool3d import MaxPool3DDerivatives
from backpack.core.derivatives.maxpoolnd import MaxPoolNDDerivatives
from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule
from backpack.utils.subsampling import subsample
from torch import Tensor
from torch.nn import MaxPool1d, MaxPool2d, MaxPool3d, Module

#: Attribute under which a max-pooling layer keeps ``(output, argmax indices)``.
POOL_INDICES = "vivit_pool_indices"

MAX_POOLS = (MaxPool1d, MaxPool2d, MaxPool3d)


def store_pool_indices(module: Module, inputs: tuple[Tensor, ...], output: Tensor):
    """Forward hook: keep the argmax indices autograd saved for a max pooling."""
    if not isinstance(module, MAX_POOLS) or output.grad_fn is None:
        return
    indices = getattr(output.grad_fn, "_saved_result1", None)
    if isinstance(indices, Tensor) and indices.shape == output.shape:
        setattr(module, POOL_INDICES, (output, indices))


def forget_pool_indices(module: Module) -> None:
    """Drop the indices :func:`store_pool_indices` left on a layer."""
    if hasattr(module, POOL_INDICES):
        delattr(module, POOL_INDICES)


@cache
def saved_index(derivatives: type[MaxPoolNDDerivatives]) -> type[MaxPoolNDDerivatives]:
    """Sub-class BackPACK's max-pooling derivatives to take the forward's indices."""

    class SavedIndexMaxPool(derivatives):
        def get_pooling_idx(self, module, subsampling=None) -> Tensor:
            saved = getattr(module, POOL_INDICES, None)
            if saved is None or saved[0] is not module.output:
                return super().get_pooling_idx(module, subsampling=subsampling)
            return subsample(saved[1], subsampling=subsampling)

    SavedIndexMaxPool.__name__ = SavedIndexMaxPool.__qualname__ = (
        f"SavedIndex{derivatives.__name__}"
    )
    return SavedIndexMaxPool


def max_pool_extensions() -> dict[type[Module], SqrtGGNBaseModule]:
    """Module extensions of ``MaxPool{1,2,3}d`` that use the forward's indices."""
    return {
        MaxPool1d: SqrtGGNBaseModule(saved_index(MaxPool1DDerivatives)()),
        MaxPool2d: SqrtGGNBaseModule(saved_index(MaxPool2DDerivatives)()),
        MaxPool3d: SqrtGGNBaseModule(saved_index(MaxPool3DDerivatives)()),
    }
