"""GGN-vector products ``G v = Jᵀ H J v`` of one block of samples, by torch.func.

The implicit route (``docs/math.rst``, "Implicit GGN-vector products") never forms
a column of ``V``: per block of ``K`` parameter-space vectors it runs

* one forward-mode pass, ``torch.func.jvp`` vmapped over the ``K`` tangents:
  ``J v`` of every sample, ``[K, N, *out]`` (the primal forward runs once);
* the loss-Hessian product of every sample (:mod:`vivit.loss_hessians`);
* one reverse-mode pass, the ``torch.func.vjp`` of the same function vmapped over
  the ``K`` cotangents: ``Jᵀ w``, one tensor ``[K, *p.shape]`` per parameter.

The function is ``θ_group ↦ select(model(x))`` through
``torch.func.functional_call`` over the group's parameters; every other parameter
and buffer keeps its value (frozen). Memory: the activations of the batch's
forward pass, plus ``K`` tangents of each activation (the vmapped passes), as
``K`` forward and backward passes of the batch would hold. Forward-mode AD needs
every operation's JVP rule: attention runs through PyTorch's composite
(``MATH``) kernel and ``nn.MultiheadAttention`` without its inference fast
path, whose fused kernels have none; an operation without one is refused,
naming it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.func import functional_call, jvp, vjp, vmap
from torch.nn import Module, Parameter, RNNBase

from vivit.engines.base import OutputSelector, select_output
from vivit.errors import UnsupportedLayerError


@contextmanager
def forward_mode_kernels(model: Module) -> Iterator[None]:
    """Kernels that have forward-mode AD rules, for the block's passes.

    ``nn.MultiheadAttention``'s fast path and the fused scaled-dot-product
    kernels have no JVP; the composite kernel computes the same function. On the
    CPU, oneDNN's (MKLDNN's) float32 LSTM and GRU layers have none either: for a
    model with a recurrent layer oneDNN is off, and PyTorch's native recurrent
    kernel, built of operations that have JVPs, computes the same function.

    Args:
        model: The network.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    recurrent = any(isinstance(m, RNNBase) for m in model.modules())
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    if recurrent and onednn:
        torch.backends.mkldnn.set_flags(False, None, None, None)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        if recurrent and onednn:
            torch.backends.mkldnn.set_flags(True, None, None, None)


class BlockFunction:
    """The model output of one block of samples as a function of a group's parameters.

    Args:
        model: The network (left unchanged).
        params: The group's parameters (the function's arguments).
        inputs: The block's inputs.
        selector: Picks the output tensor from the model's return value.
    """

    def __init__(
        self,
        model: Module,
        params: Sequence[Parameter],
        inputs: Tensor,
        selector: OutputSelector,
    ):
        names = {id(p): name for name, p in model.named_parameters()}
        self._names = [names[id(p)] for p in params]
        self._primals = tuple(p.detach() for p in params)
        self._model = model
        self._inputs = inputs
        self._selector = selector

    def __call__(self, *values: Tensor) -> Tensor:
        """The selected output with the group's parameters set to ``values``."""
        output = functional_call(
            self._model, dict(zip(self._names, values, strict=True)), (self._inputs,)
        )
        return select_output(output, self._selector)

    def jvp(self, tangents: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """The output and ``J v`` of every sample for ``K`` parameter-space vectors.

        Args:
            tangents: One tensor ``[K, *p.shape]`` per parameter.

        Returns:
            The output ``[N, *out]`` (computed once) and ``J v``, ``[K, N, *out]``.

        Raises:
            UnsupportedLayerError: If an operation has no forward-mode AD rule.
        """

        def single(*vector: Tensor) -> tuple[Tensor, Tensor]:
            return jvp(self, self._primals, vector)

        with _naming_unsupported(self._model, "J v (forward-mode AD, torch.func.jvp)"):
            return vmap(single, out_dims=(None, 0))(*tangents)

    def vjp(self, cotangents: Tensor) -> list[Tensor]:
        """``Jᵀ w`` summed over the samples, for ``K`` output-space vectors.

        Args:
            cotangents: ``[K, N, *out]``.

        Returns:
            One tensor ``[K, *p.shape]`` per parameter.
        """
        with _naming_unsupported(self._model, "Jᵀ w (reverse-mode AD, torch.func.vjp)"):
            _, pullback = vjp(self, *self._primals)
            return list(vmap(pullback)(cotangents))


@contextmanager
def _naming_unsupported(model: Module, what: str) -> Iterator[None]:
    """Turn torch's refusal of an operation into a refusal that says what to do."""
    try:
        with forward_mode_kernels(model):
            yield
    except NotImplementedError as error:
        raise UnsupportedLayerError(
            f"The implicit route computes {what} through the model, and an "
            f"operation of the model has no such rule in PyTorch: {error} Use "
            "another solver (solver='auto' or 'matrix_free'), whose engines need "
            "reverse-mode AD only."
        ) from error
