"""Columns ``Σ_t s̃_nc[t] a_n[t]ᵀ`` of ``V`` of Linear and (grouped) convolution weights.

``docs/math.rst``, "Layer structure". Each product takes the route with the fewest
multiply-adds whose largest intermediate (not a backward pass's peak) fits
:data:`MEMORY_BUDGET_BYTES`, else the one with the smallest intermediate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, einsum

from vivit.gram.dense import DenseFactors
from vivit.gram.factors import (
    NUM_BLOCKS,
    ParamFactors,
    per_sample_projections,
    scaled_cat,
    self_gram,
)
from vivit.gram.memory import itemsize
from vivit.gram.stacked import StackedFactors

#: Largest intermediate (in bytes) a route may create; chunked routes pick their
#: chunks from it. Large enough for full-speed matrix products, small next to the
#: Gram matrix at large N·C.
MEMORY_BUDGET_BYTES = 2**28
#: ``compact`` of per-sample gradients (forming ``V`` may be paid for nothing).
COMPACT_RATIO = 4
#: ``compact`` of the GGN's ``V``: every Gram matrix and eigenvector forms it anyway.
GGN_COMPACT_RATIO = 1
#: Multiply-adds one entry of a large intermediate costs besides its products (it
#: is written and read back): the "sample_pairs" Gram route's, ``V`` formed for
#: ``V u``. Calibrated on the ResNet-18 timings ``tests/gram/test_factors.py`` quotes.
COPY_WORK = 32


@dataclass(frozen=True)
class Route:
    """Cost of one way to evaluate a product."""

    name: str
    flops: int  # multiply-adds, counted from the shapes
    memory: int  # entries of the largest intermediate (of a chunk; not the result)
    chunk: int = 0  # samples or features per chunk, where the route has chunks


def budget_entries(dtype: torch.dtype, budget: int | None = None) -> int:
    """Entries of ``dtype`` (at least 1) in ``budget`` (``None``: the default) bytes."""
    budget = MEMORY_BUDGET_BYTES if budget is None else budget
    return max(1, budget // itemsize(dtype))


def choose(
    *routes: Route, dtype: torch.dtype = torch.float32, budget: int | None = None
) -> str:
    """The name of the cheapest route whose intermediates (``dtype``) fit ``budget``."""
    fitting = [r for r in routes if r.memory <= budget_entries(dtype, budget)]
    if fitting:
        return min(fitting, key=lambda r: (r.flops, r.memory)).name
    return min(routes, key=lambda r: (r.memory, r.flops)).name


class OuterProductFactors(ParamFactors):
    """A weight's columns of ``V`` held as layer inputs and backpropagated vectors.

    Args:
        inputs: Layer inputs ``a``, shape ``[N, G, T, P]`` (groups ``G``, positions
            ``T``, input features per group ``P``).
        outputs: Backpropagated vectors ``s̃`` at the layer output, shape
            ``[C, N, G, T, O]`` (output features per group ``O``).
        param_shape: Shape of the weight; it must hold ``G * O * P`` entries laid out
            as ``[G, O, P]``, or as ``[P, O]`` if ``transposed``.
        transposed: The weight is stored input-major, ``[P, O]`` (``G = 1``): the
            ``torch.addmm(bias, a, W)`` of Hugging Face's ``Conv1D``.

    Raises:
        ValueError: If inputs and outputs disagree in samples, groups or positions.
    """

    def __init__(
        self,
        inputs: Tensor,
        outputs: Tensor,
        param_shape: torch.Size,
        transposed: bool = False,
    ):
        self.num_columns, self.num_samples, groups, positions, out_features = (
            outputs.shape
        )
        if inputs.shape[:3] != (self.num_samples, groups, positions):
            raise ValueError(
                f"Inputs {tuple(inputs.shape)} and outputs {tuple(outputs.shape)} "
                "disagree in samples, groups or positions."
            )
        self.param_shape = torch.Size(param_shape)
        self.transposed = transposed
        self._a, self._s = inputs.detach(), outputs.detach()
        self._G, self._T, self._O = groups, positions, out_features
        self._P = inputs.shape[3]

    @classmethod
    def concatenate(
        cls,
        blocks: Sequence[OuterProductFactors],
        scales: Sequence[float],
        inputs_cache: list[tuple[list[Tensor], Tensor]] | None = None,
    ) -> OuterProductFactors:
        """The factors of consecutive parts of the samples, scaled, as one (a copy).

        ``inputs_cache`` (appended to) pairs earlier calls' blocks' inputs with their
        concatenation: factors whose blocks share inputs (``V`` and the per-sample
        gradients of a weight) share it too.
        """
        parts = [block._a for block in blocks]
        cache = [] if inputs_cache is None else inputs_cache
        inputs = next(
            (merged for old, merged in cache if _same_tensors(old, parts)), None
        )
        if inputs is None:
            inputs = torch.cat(parts)
            cache.append((parts, inputs))
        return cls(
            inputs,
            scaled_cat([block._s for block in blocks], scales, dim=1),
            blocks[0].param_shape,
            blocks[0].transposed,
        )

    def _v_size(self) -> int:
        return self.num_rows * self._G * self._O * self._P

    def _form_v_flops(self) -> int:
        return self._v_size() * self._T

    def scaled(self, factor: float) -> OuterProductFactors:  # noqa: D102
        return OuterProductFactors(
            self._a, self._s * factor, self.param_shape, self.transposed
        )

    def gram(self, other: ParamFactors | None = None) -> Tensor:  # noqa: D102
        other = self if other is None else other
        if isinstance(other, StackedFactors):
            return other.gram(self).T
        if (
            not isinstance(other, OuterProductFactors)
            or other.transposed != self.transposed
        ):
            return self.materialize() @ other.materialize().T
        route = self._gram_route(other)
        if route.name == "through_v":
            return self._gram_through_v(other, route.chunk)
        if route.name == "sample_pairs":
            return self._gram_sample_pairs(other, route.chunk)
        return self._gram_pairs(other, route.chunk)

    def gram_work(self) -> int:  # noqa: D102
        return self._gram_route(self).flops

    def gram_memory(self) -> int:  # noqa: D102
        route = self._gram_route(self)
        if route.name != "through_v":
            return route.memory
        # V's chunk is formed by an einsum that copies both operands' chunks
        N, T, C = self.num_samples, self._T, self.num_columns
        return route.memory + N * T * (C * route.chunk + self._G * self._P)

    def _gram_route(self, other: OuterProductFactors) -> Route:
        """The route :meth:`gram` takes for ``Vᵀ V_other``, its cost and chunk."""
        n1, n2 = self.num_samples, other.num_samples
        r1, r2 = self.num_rows, other.num_rows
        C, D = self.num_columns, other.num_columns
        G, T, O, P = self._G, self._T, self._O, self._P
        rows = r1 if other is self else r1 + r2
        features = self._features_per_chunk(rows)
        through_v = Route(
            "through_v",
            flops=self._form_v_flops()
            + (0 if other is self else other._form_v_flops())
            + r1 * r2 * G * O * P,
            memory=rows * features * P,
            chunk=features,
        )
        per_sample = (C * r2 + n2) * (G * T * T)  # of the position pairs' products
        samples = self._samples_within_budget(per_sample)
        pairs = Route(
            "pairs",
            flops=G * T * T * (r1 * r2 * (O + 1) + n1 * n2 * P),
            memory=samples * per_sample,
            chunk=samples,
        )
        # the other operand's vectors weighted by input kernels, copied (COPY_WORK)
        per_sample = 2 * n2 * T * (D * O + T)
        samples = self._samples_within_budget(per_sample)
        intermediate = n1 * n2 * G * T * D * O
        sample_pairs = Route(
            "sample_pairs",
            flops=n1 * n2 * G * T * T * P + (T + C + COPY_WORK) * intermediate,
            memory=samples * per_sample,
            chunk=samples,
        )
        routes = (through_v, pairs, sample_pairs)
        name = choose(*routes, dtype=self._a.dtype)
        return next(route for route in routes if route.name == name)

    def _samples_within_budget(self, per_sample: int) -> int:
        """Samples (at least one) of ``per_sample`` entries each that fit the budget."""
        budget = budget_entries(self._a.dtype)
        return max(1, min(self.num_samples, budget // per_sample))

    def _features_per_chunk(self, rows: int) -> int:
        """Output features (of ``G·O``, at least one) whose ``rows`` of ``Vᵀ`` fit."""
        budget = budget_entries(self._a.dtype)
        return max(1, min(self._G * self._O, budget // max(1, rows * self._P)))

    def _feature_chunks(self, chunk: int) -> list[tuple[slice, slice]]:
        """``(groups, features)`` slices of ``chunk`` features (whole groups if ≥ O)."""
        G, O = self._G, self._O
        if chunk >= O:
            per = chunk // O
            return [(slice(g, min(g + per, G)), slice(None)) for g in range(0, G, per)]
        return [
            (slice(g, g + 1), slice(o, min(o + chunk, O)))
            for g in range(G)
            for o in range(0, O, chunk)
        ]

    def _gram_through_v(self, other: OuterProductFactors, chunk: int) -> Tensor:
        """``Vᵀ V_other``, summed over blocks of ``chunk`` output features of ``V``."""
        gram = None
        for groups, features in self._feature_chunks(chunk):
            vt = self._materialize(groups, features)
            if other is self:
                gram = self_gram(vt, out=gram)
                continue
            block = vt @ other._materialize(groups, features).T
            gram = block if gram is None else gram.add_(block)
        return gram

    def _gram_pairs(self, other: OuterProductFactors, samples: int) -> Tensor:
        """``Vᵀ V_other`` from products of position pairs, ``samples`` rows at a time.

        ``G̃[(n,c),(m,d)] = Σ_{g,t,t'} (s̃_nc[g,t]·s̃_md[g,t']) (a_n[g,t]·a_m[g,t'])``.
        """
        C = self.num_columns
        gram = self._a.new_empty(self.num_rows, other.num_rows)
        for start in range(0, self.num_samples, samples):
            end = min(start + samples, self.num_samples)
            a, s = self._a[start:end], self._s[:, start:end]
            inputs = einsum("ngtp,mgup->nmgtu", a, other._a)
            outputs = einsum("cngto,dmguo->ncmdgtu", s, other._s)
            block = einsum("ncmdgtu,nmgtu->ncmd", outputs, inputs)
            gram[start * C : end * C] = block.reshape((end - start) * C, -1)
        return gram

    def _gram_sample_pairs(self, other: OuterProductFactors, samples: int) -> Tensor:
        """``Vᵀ V_other``, the other operand's vectors weighted by input kernels first.

        ``C`` times fewer multiply-adds than :meth:`_gram_pairs`; ``samples`` rows at
        a time, of ``Vᵀ V`` only the lower triangle, mirrored.
        """
        C, D = self.num_columns, other.num_columns
        T, O = self._T, self._O
        symmetric = other is self
        if symmetric:  # blocks of the lower triangle, mirrored (as ``self_gram``)
            samples = min(samples, -(-self.num_samples // NUM_BLOCKS))
        gram = self._a.new_zeros(self.num_rows, other.num_rows)
        for g in range(self._G):
            # [m, u, (d, o)]: the other operand's vectors, by sample
            vectors = other._s[:, :, g].permute(1, 2, 0, 3)
            for start in range(0, self.num_samples, samples):
                end = min(start + samples, self.num_samples)
                n = end - start
                M = end if symmetric else other.num_samples
                kernel = einsum("ntp,mup->mntu", self._a[start:end, g], other._a[:M, g])
                weighted = torch.bmm(
                    kernel.reshape(M, n * T, T), vectors[:M].reshape(M, T, D * O)
                )
                # [n, (t, o), (m, d)]: contracted with each sample's own vectors
                weighted = weighted.view(M, n, T, D, O).permute(1, 2, 4, 0, 3)
                own = self._s[:, start:end, g].transpose(0, 1).reshape(n, C, T * O)
                block = torch.bmm(own, weighted.reshape(n, T * O, M * D))
                gram[start * C : end * C, : M * D] += block.reshape(n * C, M * D)
        if symmetric:
            gram = gram.tril() + gram.tril(-1).T
        return gram

    def _product_route(self, num_vectors: int) -> Route:
        """The route of :meth:`vmp` and :meth:`vtmp` for ``K`` vectors (same cost)."""
        K = num_vectors
        G, T, O, P = self._G, self._T, self._O, self._P
        N, C = self.num_samples, self.num_columns
        factored = Route(
            "factored",
            flops=K * N * C * G * T * O + K * N * G * T * O * P,
            memory=K * N * G * T * O,
        )
        through_v = Route(
            "through_v",
            flops=self._form_v_flops() + (K + COPY_WORK) * self._v_size(),
            memory=self._v_size(),
        )
        name = choose(factored, through_v, dtype=self._a.dtype)
        return through_v if name == through_v.name else factored

    def product_work(self, num_vectors: int) -> int:  # noqa: D102
        return 2 * self._product_route(num_vectors).flops

    def product_memory(self, num_vectors: int) -> int:  # noqa: D102
        route = self._product_route(num_vectors)
        if route.name != "through_v":
            return route.memory
        # V is formed by an einsum that copies both operands
        return route.memory + self._s.numel() + self._a.numel()

    def vmp(self, u: Tensor) -> Tensor:  # noqa: D102
        K = u.shape[0]
        if self._product_route(K).name == "through_v":
            result = u @ self.materialize()
        else:
            N, C = self.num_samples, self.num_columns
            weighted = einsum("knc,cngto->kngto", u.reshape(K, N, C), self._s)
            result = einsum("kngto,ngtp->kgop", weighted, self._a)
            if self.transposed:
                result = result.transpose(-1, -2)
        return result.reshape(K, *self.param_shape)

    def vtmp(self, w: Tensor) -> Tensor:  # noqa: D102
        K = w.shape[0]
        if self._product_route(K).name == "through_v":
            return w.reshape(K, -1) @ self.materialize().T
        G, O, P = self._G, self._O, self._P
        N, C = self.num_samples, self.num_columns
        if self.transposed:
            w = w.reshape(K, P, O).transpose(-1, -2)
        w = w.reshape(K, G, O, P)
        projected = einsum("kgop,ngtp->kngto", w, self._a)
        return per_sample_projections(projected, self._s).reshape(K, N * C)

    def select(self, samples: Sequence[int]) -> OuterProductFactors:  # noqa: D102
        index = torch.as_tensor(samples, dtype=torch.long, device=self._a.device)
        return OuterProductFactors(
            self._a[index], self._s[:, index], self.param_shape, self.transposed
        )

    def materialize(self) -> Tensor:  # noqa: D102
        vt = self._materialize(slice(None), slice(None))
        if self.transposed:  # [N·C, O, P] as the weight's [P, O]
            return vt.reshape(-1, self._O, self._P).transpose(1, 2).reshape(len(vt), -1)
        return vt

    def _materialize(self, groups: slice, features: slice) -> Tensor:
        """Rows of ``Vᵀ`` of ``g`` groups and ``o`` features each, ``[N·C, g·o·P]``."""
        outputs = self._s[:, :, groups, :, features]
        vt = einsum("cngto,ngtp->ncgop", outputs, self._a[:, groups])
        return vt.reshape(self.num_rows, -1)

    def compact(self, ratio: int = COMPACT_RATIO) -> ParamFactors:
        """``self``, or :class:`~vivit.gram.DenseFactors` where ``ratio`` times smaller.

        With many positions ``T`` (convolutions on large images) ``V`` makes every
        later product one matrix product; forming it costs ``T`` multiply-adds per
        entry, paid even if no product follows.
        """
        C, G, T, O, P = self.num_columns, self._G, self._T, self._O, self._P
        if ratio * C * G * O * P > G * T * (P + C * O):
            return self
        return DenseFactors(
            self.materialize().reshape(self.num_samples, C, *self.param_shape)
        )


def _same_tensors(first: list[Tensor], second: list[Tensor]) -> bool:
    """Whether two lists hold views of the same entries (detached copies of one)."""
    return len(first) == len(second) and all(
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        for a, b in zip(first, second, strict=True)
    )
