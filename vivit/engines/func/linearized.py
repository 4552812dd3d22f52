"""``J v`` and ``Jᵀ w`` of a part from one recorded forward pass and its pullback.

The forward pass runs once; its graph and the graph of its pullback
``u ↦ Jᵀ u`` (recorded at ``u = 0``, linear in ``u``) are kept, so every later
product is a backward pass through each: ``J v`` is the derivative of
``(Jᵀ u)ᵀ v`` by ``u`` (``docs/math.rst``, "Linearized products").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vivit.engines.func.implicit import PartFunction, forward_mode_kernels


class LinearizedPart:
    """A part's output as a linear function of its group's parameters' change.

    The same products as :class:`~vivit.engines.func.implicit.PartFunction`, for
    the lifetime of this object without running the model again.

    Raises:
        RuntimeError: If an operation's backward has no backward rule itself
            (:func:`check_linearization` finds that out on a copy first).
    """

    def __init__(self, function: PartFunction):
        with forward_mode_kernels(function.model):
            # the parameters' storage, as leaves of their own
            self._leaves = tuple(p.detach().requires_grad_() for p in function.primals)
            output = function(*self._leaves)
            placeholder = torch.zeros_like(output, requires_grad=True)
            pulled = torch.autograd.grad(
                output,
                self._leaves,
                placeholder,
                create_graph=True,
                allow_unused=True,
                materialize_grads=True,
            )
        self._model = function.model
        self._output, self._placeholder, self._pulled = output, placeholder, pulled

    @property
    def output(self) -> Tensor:
        """The part's output ``[N, *out]`` (no graph)."""
        return self._output.detach()

    def jvp(self, tangents: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Output ``[N, *out]`` and ``J v`` ``[K, N, *out]`` (tangents ``[K, *p]``)."""
        with forward_mode_kernels(self._model):
            images = [
                self._backward(self._pulled, self._placeholder, vector)[0]
                for vector in zip(*tangents, strict=True)
            ]
        return self.output, torch.stack(images)

    def vjp(self, cotangents: Tensor) -> list[Tensor]:
        """``Jᵀ w`` ``[K, *p.shape]`` per parameter, summed over the samples.

        ``cotangents``: ``[K, N, *out]``.
        """
        with forward_mode_kernels(self._model):
            images = [
                self._backward((self._output,), self._leaves, (cotangent,))
                for cotangent in cotangents
            ]
        return [torch.stack(piece) for piece in zip(*images, strict=True)]

    @staticmethod
    def _backward(
        outputs: Sequence[Tensor], inputs: Sequence[Tensor], grads: Sequence[Tensor]
    ) -> tuple[Tensor, ...]:
        """One backward pass through a kept graph (kept for the next)."""
        return torch.autograd.grad(
            outputs,
            inputs,
            grads,
            retain_graph=True,
            allow_unused=True,
            materialize_grads=True,
        )


def check_linearization(function: PartFunction) -> str | None:
    """Why the linearized ``J v`` of ``function`` cannot be used (``None``: it can).

    It cannot where an operation's backward has no backward rule, or where its
    ``J v`` differs from forward mode's along a random tangent (seed 0) by more
    than ``√ε`` of their size (the bound of ``check_modes_agree``).
    """
    generator = torch.Generator().manual_seed(0)
    tangents = [
        torch.randn((1, *p.shape), generator=generator, dtype=p.dtype).to(p.device)
        for p in function.primals
    ]
    try:
        _, linearized = LinearizedPart(function).jvp(tangents)
    except (RuntimeError, NotImplementedError) as error:
        return f"a backward pass has no backward rule ({error})"
    _, forward = function.jvp(tangents)
    difference = (linearized - forward).norm().item()
    size = forward.norm().item() + linearized.norm().item()
    if not difference <= torch.finfo(forward.dtype).eps ** 0.5 * size:
        return (
            f"its J v differs from forward mode's by {difference:.2g} (of "
            f"{size:.2g}): a backward pass's own backward computes another derivative"
        )
    return None
