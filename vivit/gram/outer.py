"""Columns of ``V`` of layers whose weight Jacobian is an outer product.

For a Linear layer ``z = W a + b`` the column ``(n, c)`` of ``V_W`` is
``Σ_t s̃_nc[t] a_n[t]ᵀ``: the backpropagated vector at the layer output times the
layer input, summed over positions ``t`` (sequence entries; the patches of an
unfolded convolution input). Convolutions with channel groups are a stack of such
products, one per group. ``docs/math.rst`` ("Layer structure") gives the formulas.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, einsum

from vivit.gram import planner
from vivit.gram.factors import ParamFactors
from vivit.gram.symmetric import self_gram


class OuterProductFactors(ParamFactors):
    """A weight's columns of ``V`` held as layer inputs and backpropagated vectors.

    Args:
        inputs: Layer inputs ``a``, shape ``[N, G, T, P]`` (groups ``G``, positions
            ``T``, input features per group ``P``).
        outputs: Backpropagated vectors ``s̃`` at the layer output, shape
            ``[C, N, G, T, O]`` (output features per group ``O``).

    Both are detached: products never track gradients.
        param_shape: Shape of the weight; it must hold ``G * O * P`` entries laid out
            as ``[G, O, P]``.
    """

    def __init__(self, inputs: Tensor, outputs: Tensor, param_shape: torch.Size):
        self.num_columns, self.num_samples, groups, positions, out_features = (
            outputs.shape
        )
        if inputs.shape[:3] != (self.num_samples, groups, positions):
            raise ValueError(
                f"Inputs {tuple(inputs.shape)} and outputs {tuple(outputs.shape)} "
                "disagree in samples, groups or positions."
            )
        self.param_shape = torch.Size(param_shape)
        # Factors are data: products with them must not extend the autograd graph.
        self._a = inputs.detach()
        self._s = outputs.detach()
        self._G, self._T, self._O, self._P = (
            groups,
            positions,
            out_features,
            inputs.shape[3],
        )

    # routes -----------------------------------------------------------------
    def _v_size(self) -> int:
        return self.num_rows * self._G * self._O * self._P

    def _form_v_flops(self) -> int:
        return self._v_size() * self._T

    def gram(self, other: ParamFactors | None = None) -> Tensor:  # noqa: D102
        other = self if other is None else other
        if not isinstance(other, OuterProductFactors):
            return self.materialize() @ other.materialize().T
        n1, n2 = self.num_samples, other.num_samples
        r1, r2 = self.num_rows, other.num_rows
        G, T, O, P = self._G, self._T, self._O, self._P
        through_v = planner.Route(
            "through_v",
            flops=self._form_v_flops()
            + (0 if other is self else other._form_v_flops())
            + r1 * r2 * G * O * P,
            memory=(r1 if other is self else r1 + r2) * G * O * P,
        )
        pairs = planner.Route(
            "pairs",
            flops=r1 * r2 * G * T * T * O
            + n1 * n2 * G * T * T * P
            + r1 * r2 * G * T * T,
            memory=r1 * r2 * G * T * T + n1 * n2 * G * T * T,
        )
        if planner.choose(through_v, pairs) == "through_v":
            if other is self:
                return self_gram(self.materialize())
            return self.materialize() @ other.materialize().T
        return self._gram_pairs(other)

    def _gram_pairs(self, other: OuterProductFactors) -> Tensor:
        """``G̃[(n,c),(m,d)] = Σ_{g,t,t'} (s̃_nc[g,t]·s̃_md[g,t']) (a_n[g,t]·a_m[g,t'])``.

        Args:
            other: Second set of factors of the same parameter.

        Returns:
            Gram block, shape ``[self.num_rows, other.num_rows]``.
        """
        inputs = einsum("ngtp,mgup->nmgtu", self._a, other._a)
        outputs = einsum("cngto,dmguo->ncmdgtu", self._s, other._s)
        gram = einsum("ncmdgtu,nmgtu->ncmd", outputs, inputs)
        return gram.reshape(self.num_rows, other.num_rows)

    def vmp(self, u: Tensor) -> Tensor:  # noqa: D102
        K = u.shape[0]
        G, T, O, P = self._G, self._T, self._O, self._P
        N, C = self.num_samples, self.num_columns
        factored = planner.Route(
            "factored",
            flops=K * N * C * G * T * O + K * N * G * T * O * P,
            memory=K * N * G * T * O,
        )
        through_v = planner.Route(
            "through_v",
            flops=self._form_v_flops() + K * self._v_size(),
            memory=self._v_size(),
        )
        if planner.choose(factored, through_v) == "through_v":
            result = u @ self.materialize()
        else:
            weighted = einsum("knc,cngto->kngto", u.reshape(K, N, C), self._s)
            result = einsum("kngto,ngtp->kgop", weighted, self._a)
        return result.reshape(K, *self.param_shape)

    def vtmp(self, w: Tensor) -> Tensor:  # noqa: D102
        K = w.shape[0]
        G, T, O, P = self._G, self._T, self._O, self._P
        N, C = self.num_samples, self.num_columns
        factored = planner.Route(
            "factored",
            flops=K * N * G * T * O * P + K * N * C * G * T * O,
            memory=K * N * G * T * O,
        )
        through_v = planner.Route(
            "through_v",
            flops=self._form_v_flops() + K * self._v_size(),
            memory=self._v_size(),
        )
        if planner.choose(factored, through_v) == "through_v":
            return w.reshape(K, -1) @ self.materialize().T
        w = w.reshape(K, G, O, P)
        projected = einsum("kgop,ngtp->kngto", w, self._a)
        return einsum("kngto,cngto->knc", projected, self._s).reshape(K, N * C)

    def select(self, samples: Sequence[int]) -> OuterProductFactors:  # noqa: D102
        index = torch.as_tensor(samples, dtype=torch.long, device=self._a.device)
        return OuterProductFactors(self._a[index], self._s[:, index], self.param_shape)

    def materialize(self) -> Tensor:  # noqa: D102
        vt = einsum("cngto,ngtp->ncgop", self._s, self._a)
        return vt.reshape(self.num_rows, -1)
