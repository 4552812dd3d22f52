"""Columns of ``V`` of layers whose weight Jacobian is an outer product.

Column ``(n, c)`` of a Linear or (grouped) convolution weight is
``Σ_t s̃_nc[t] a_n[t]ᵀ`` over positions ``t`` (``docs/math.rst``, "Layer
structure"); each product takes the cheapest route (:mod:`~vivit.gram.planner`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, einsum

from vivit.gram import planner
from vivit.gram.dense import DenseFactors
from vivit.gram.factors import ParamFactors, per_sample_projections, scaled_cat
from vivit.gram.stacked import StackedFactors
from vivit.gram.symmetric import NUM_BLOCKS, self_gram

#: Per-sample gradients: ``V`` replaces the factors where it has at most this many
#: times fewer entries (forming it may be paid for nothing, see ``compact``).
COMPACT_RATIO = 4
#: The GGN's ``V``: replaces the factors wherever it is no larger, since every Gram
#: matrix and eigenvector forms it anyway (``compact``).
GGN_COMPACT_RATIO = 1
#: Multiply-adds one entry of a large intermediate costs besides its products (it
#: is written and read back): the "sample_pairs" Gram route's, ``V`` formed for
#: ``V u``. Calibrated on the ResNet-18 timings ``tests/gram/test_factors.py`` quotes.
COPY_WORK = 32


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

        ``inputs_cache`` holds the concatenated inputs of earlier calls with the
        blocks' inputs they came from (appended to): factors whose blocks share
        their inputs (``V`` and the per-sample gradients of a weight) then share
        the concatenation too.
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
            return self._gram_through_v(other, self._gram_features_per_chunk(other))
        if route.name == "sample_pairs":
            return self._gram_sample_pairs(other, self._sample_pairs_per_chunk(other))
        return self._gram_pairs(other, self._samples_per_chunk(other))

    def gram_work(self) -> int:  # noqa: D102
        return self._gram_route(self).flops

    def gram_memory(self) -> int:  # noqa: D102
        route = self._gram_route(self)
        if route.name != "through_v":
            return route.memory
        # V's chunk is formed by an einsum that copies both operands' chunks
        chunk = self._gram_features_per_chunk(self)
        N, T = self.num_samples, self._T
        return route.memory + N * T * (self.num_columns * chunk + self._G * self._P)

    def _gram_features_per_chunk(self, other: OuterProductFactors) -> int:
        rows = self.num_rows if other is self else self.num_rows + other.num_rows
        return self._features_per_chunk(rows)

    def _gram_route(self, other: OuterProductFactors) -> planner.Route:
        """The route :meth:`gram` takes for ``Vᵀ V_other``, with its cost."""
        n1, n2 = self.num_samples, other.num_samples
        r1, r2 = self.num_rows, other.num_rows
        G, T, O, P = self._G, self._T, self._O, self._P
        chunk = self._gram_features_per_chunk(other)
        samples = self._samples_per_chunk(other)
        through_v = planner.Route(
            "through_v",
            flops=self._form_v_flops()
            + (0 if other is self else other._form_v_flops())
            + r1 * r2 * G * O * P,
            memory=(r1 if other is self else r1 + r2) * chunk * P,
        )
        pairs = planner.Route(
            "pairs",
            flops=G * T * T * (r1 * r2 * (O + 1) + n1 * n2 * P),
            memory=samples * (self.num_columns * r2 + n2) * G * T * T,
        )
        routes = (through_v, pairs, self._sample_pairs_route(other))
        name = planner.choose(*routes, dtype=self._a.dtype)
        return next(route for route in routes if route.name == name)

    def _sample_pairs_route(self, other: OuterProductFactors) -> planner.Route:
        """The cost of :meth:`_gram_sample_pairs` (with its copies, see COPY_WORK)."""
        n1, n2 = self.num_samples, other.num_samples
        C, D = self.num_columns, other.num_columns
        G, T, O, P = self._G, self._T, self._O, self._P
        intermediate = n1 * n2 * G * T * D * O
        return planner.Route(
            "sample_pairs",
            flops=n1 * n2 * G * T * T * P + (T + C + COPY_WORK) * intermediate,
            memory=self._sample_pairs_per_chunk(other) * 2 * n2 * T * (D * O + T),
        )

    def _sample_pairs_per_chunk(self, other: OuterProductFactors) -> int:
        """Samples of ``self`` per block of :meth:`_gram_sample_pairs`."""
        return self._samples_within_budget(
            2 * other.num_samples * self._T * (other.num_columns * self._O + self._T)
        )

    def _samples_per_chunk(self, other: OuterProductFactors) -> int:
        """Samples of ``self`` whose pairwise products with ``other`` fit the budget."""
        return self._samples_within_budget(
            (self.num_columns * other.num_rows + other.num_samples)
            * (self._G * self._T * self._T)
        )

    def _samples_within_budget(self, per_sample: int) -> int:
        """Samples (at least one) of ``per_sample`` entries each that fit the budget."""
        budget = planner.budget_entries(self._a.dtype)
        return max(1, min(self.num_samples, budget // per_sample))

    def _features_per_chunk(self, rows: int) -> int:
        """Output features (of ``G·O``, at least one) whose ``rows`` of ``Vᵀ`` fit."""
        budget = planner.budget_entries(self._a.dtype)
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

    def _product_route(self, num_vectors: int) -> planner.Route:
        """The route of :meth:`vmp` and :meth:`vtmp` for ``K`` vectors (same cost)."""
        K = num_vectors
        G, T, O, P = self._G, self._T, self._O, self._P
        N, C = self.num_samples, self.num_columns
        factored = planner.Route(
            "factored",
            flops=K * N * C * G * T * O + K * N * G * T * O * P,
            memory=K * N * G * T * O,
        )
        through_v = planner.Route(
            "through_v",
            flops=self._form_v_flops() + (K + COPY_WORK) * self._v_size(),
            memory=self._v_size(),
        )
        name = planner.choose(factored, through_v, dtype=self._a.dtype)
        return through_v if name == "through_v" else factored

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
        """``V`` held explicitly where it is sufficiently smaller than these factors.

        With many positions ``T`` (convolutions on large images) ``V`` is smaller
        than the factors and makes every later product one matrix product; forming
        it costs ``T`` multiply-adds per entry, paid even if no product follows.

        Args:
            ratio: ``V`` (``C·G·O·P`` entries per sample) is formed where ``ratio``
                times its entries are at most the factors' (``G·T·(P + C·O)``):
                :data:`GGN_COMPACT_RATIO`, or :data:`COMPACT_RATIO` for
                per-sample gradients.

        Returns:
            ``self``, or :class:`~vivit.gram.DenseFactors` with the same columns.
        """
        C, G, T, O, P = self.num_columns, self._G, self._T, self._O, self._P
        if ratio * C * G * O * P > G * T * (P + C * O):
            return self
        columns = self.materialize().reshape(
            self.num_samples, self.num_columns, *self.param_shape
        )
        return DenseFactors(columns)


def _same_tensors(first: list[Tensor], second: list[Tensor]) -> bool:
    """Whether two lists hold views of the same entries (detached copies of one)."""
    return len(first) == len(second) and all(
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        for a, b in zip(first, second, strict=True)
    )
