"""``J v`` and ``Jᵀ w`` of ``θ_group ↦ select(model(x))`` for a part of the samples.

torch.func computes them without forming a column of ``V`` (``docs/math.rst``,
"Implicit GGN-vector products").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.func import functional_call, jvp, vjp, vmap
from torch.nn import Module, Parameter, RNNBase
from torch.overrides import TorchFunctionMode

from vivit.engines.base import OutputSelector, select_output
from vivit.errors import UnsupportedLayerError
from vivit.model_inputs import ModelInputs


@contextmanager
def forward_mode_kernels(model: Module) -> Iterator[None]:
    """Kernels with forward-mode and double-backward rules (no fast path, oneDNN)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    recurrent = any(isinstance(m, RNNBase) for m in model.modules())
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    if recurrent and onednn:
        torch.backends.mkldnn.set_flags(False, None, None, None)
    try:
        with sdpa_kernel(SDPBackend.MATH), PaddingRowsConstant():
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        if recurrent and onednn:
            torch.backends.mkldnn.set_flags(True, None, None, None)


class PaddingRowsConstant(TorchFunctionMode):
    """An embedding's padding row as reverse-mode AD sees it: a constant.

    Its forward-mode rule would give the row a tangent; detached, ``J v`` and
    ``Jᵀ w`` are of one function.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.embedding:
            a = inspect.signature(func).bind(*args, **kwargs).arguments
            if a.get("padding_idx") is not None:
                weight = a["weight"]
                row = torch.zeros(weight.shape[0], 1, dtype=torch.bool)
                row[a["padding_idx"]] = True
                a["weight"] = torch.where(
                    row.to(weight.device), weight.detach(), weight
                )
                return func(**a)
        return func(*args, **kwargs)


class PartFunction:
    """The output of a part of the samples (``inputs``) as a function of ``params``."""

    def __init__(
        self,
        model: Module,
        params: Sequence[Parameter],
        inputs: ModelInputs,
        selector: OutputSelector,
    ):
        names = {id(p): name for name, p in model.named_parameters()}
        self._names = [names[id(p)] for p in params]
        self.primals = tuple(p.detach() for p in params)
        self.model = model
        self._inputs = inputs
        self._selector = selector
        self._pullback: Callable[[Tensor], tuple[Tensor, ...]] | None = None

    def __call__(self, *values: Tensor) -> Tensor:
        """The selected output with the group's parameters set to ``values``."""
        params = dict(zip(self._names, values, strict=True))
        inputs = self._inputs
        args, kwargs = (
            ((), dict(inputs)) if isinstance(inputs, Mapping) else ((inputs,), {})
        )
        output = functional_call(self.model, params, args, kwargs)
        return select_output(output, self._selector)

    def jvp(self, tangents: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """The output ``[N, *out]`` and ``J v`` ``[K, N, *out]``; tangents ``[K, *p]``.

        Raises:
            UnsupportedLayerError: If an operation has no forward-mode AD rule.
        """

        def single(*vector: Tensor) -> tuple[Tensor, Tensor]:
            return jvp(self, self.primals, vector)

        with _naming_unsupported(self.model, "J v (forward-mode AD, torch.func.jvp)"):
            return vmap(single, out_dims=(None, 0))(*tangents)

    def vjp(self, cotangents: Tensor) -> list[Tensor]:
        """``Jᵀ w`` ``[K, *p.shape]`` per parameter, summed over the samples.

        ``cotangents``: ``[K, N, *out]``. The forward pass recording the pullback
        runs once per block.
        """
        with _naming_unsupported(self.model, "Jᵀ w (reverse-mode AD, torch.func.vjp)"):
            if self._pullback is None:
                _, self._pullback = vjp(self, *self.primals)
            return list(vmap(self._pullback)(cotangents))


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
            "another solver (solver='auto' or 'factor_krylov'), whose engines need "
            "reverse-mode AD only."
        ) from error


def check_modes_agree(function: PartFunction, params: Sequence[Parameter]) -> None:
    """Refuse a model whose ``wᵀ(J v)`` and ``(Jᵀ w)ᵀ v`` disagree (random, seed 0).

    Raises:
        UnsupportedLayerError: If they disagree.
    """
    generator = torch.Generator().manual_seed(0)

    def draw(shape: torch.Size, like: Tensor) -> Tensor:
        sample = torch.randn(shape, generator=generator, dtype=like.dtype)
        return sample.to(like.device)

    tangents = [draw((1, *p.shape), p) for p in params]
    _, forward = function.jvp(tangents)
    cotangent = draw(forward.shape, forward)
    backward = function.vjp(cotangent)
    forward_side = (cotangent * forward).sum().item()
    backward_side = sum((g * t).sum() for g, t in zip(backward, tangents, strict=True))
    backward_side = float(backward_side.detach())

    def size(tensors: Sequence[Tensor]) -> float:
        return torch.stack([t.norm() for t in tensors]).norm().item()

    scale = size([cotangent]) * size([forward]) + size(backward) * size(tangents)
    tolerance = torch.finfo(forward.dtype).eps ** 0.5 * scale
    if abs(forward_side - backward_side) > tolerance:
        raise UnsupportedLayerError(
            "Forward- and reverse-mode derivatives of this model disagree: for a "
            f"random pair, wᵀ(J v) = {forward_side:.6g} by JVP but (Jᵀ w)ᵀ v = "
            f"{backward_side:.6g} by VJP (allowed difference {tolerance:.2g}). An "
            "operation's JVP rule and its backward compute different derivatives "
            "(a custom autograd.Function, or a backward that drops a gradient), "
            "so GGN-vector products by JVP and VJP would be wrong. Use a Gram "
            "route, which differentiates by reverse mode only: solver='dense', "
            "'gram_krylov' or 'factor_krylov'."
        )
