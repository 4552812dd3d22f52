"""The plan of a request: route, samples per pass, vectors per pass, Krylov basis.

Made once from the measured profile and the data's sizes; the run follows it and
the estimate reads it (``docs/math.rst``, "Memory of a request", "Choosing the route").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from vivit.engines.base import Engine
from vivit.errors import FactorsTooLargeError, ProductsTooLargeError
from vivit.gram.memory import (
    PARTIAL_FRACTION,
    available_bytes,
    check_gram_fits,
    dense_workspace_bytes,
    format_bytes,
    gram_bytes,
    itemsize,
)
from vivit.linalg.iterative import basis_capacity
from vivit.linalg.top_k import (
    fitting_basis_columns,
    iterative_workspace_bytes,
    solver_block_size,
)
from vivit.memory.costs import choose_solver, krylov_work, pass_cost, solver_works
from vivit.memory.profile import Profile

#: The estimate lies within this factor of the measured peak, either way: a
#: request is refused only where its estimate over this factor does not fit.
ESTIMATE_FACTOR = 1.5
#: Leading eigenpairs the route is chosen for.
ROUTE_TOP_K = 10
#: Most of the memory available the recordings of a loader's later parts take
#: (``docs/math.rst``, "Linearized products"): a large data set's are not all kept.
RECORDING_FRACTION = 1 / 4
#: Bytes of the tangents one vmapped implicit pass over a part may hold.
PASS_BYTES = 2**29


@dataclass(frozen=True)
class Sizes:
    """``N`` samples, ``N_S`` curvature samples, parts of at most ``part``."""

    samples: int
    curvature: int
    part: int
    parts: int
    loader: bool = False

    @classmethod
    def of(cls, batches: list[int], curvature: int | None, chunk: int | None) -> Sizes:
        """Batches of ``batches`` samples in chunks of ``chunk`` (curvature: N_S)."""
        part = min(chunk or max(batches), max(batches))
        total = sum(batches)
        parts = sum(math.ceil(b / part) for b in batches)
        return cls(total, curvature or total, part, parts, len(batches) > 1)


@dataclass(frozen=True)
class MemoryEstimate:
    """The peak memory of a request on its route, in bytes.

    Attributes:
        route: ``"gram"`` or ``"implicit"``, and ``reason``: why.
        engine: The engine (``"implicit"`` on the implicit route).
        solver: The eigensolver the estimate is for.
        num_rows: ``N·C``, the Gram matrix's side (``N_S`` on the implicit route).
        passes: Peak of the passes over the data (measured, extrapolated).
        kept: What the Gram route's factors keep after the passes (measured).
        solve: The Gram matrices and the solver's workspace, or the Krylov
            basis (closed forms).
        basis_columns: Columns of the implicit route's Krylov basis, and
            ``default_columns`` those of its default one (memory may cut it).
        gathered: An FSDP2 model's parameters gathered whole on the rank,
            beyond its shards (``docs/math.rst``, "Models sharded with FSDP2").
    """

    route: str
    reason: str
    engine: str
    solver: str
    num_rows: int
    passes: int
    kept: int
    solve: int
    basis_columns: int | None = None
    default_columns: int | None = None
    gathered: int = 0

    @property
    def total(self) -> int:
        """Peak bytes: the passes, or the kept factors with the solve; gathered."""
        if self.route == "implicit":
            return self.gathered + self.passes + self.solve
        return self.gathered + max(self.passes, self.kept + self.solve)

    def __str__(self) -> str:
        cut = ""
        if (self.basis_columns or 0) < (self.default_columns or 0):
            cut = f" (cut from {self.default_columns} by memory)"
        parts = (
            f"products {format_bytes(self.passes)}, Krylov basis of "
            f"{self.basis_columns} columns{cut} {format_bytes(self.solve)}"
            if self.route == "implicit"
            else f"passes {format_bytes(self.passes)}, factors "
            f"{format_bytes(self.kept)}, {self.solver} solve {format_bytes(self.solve)}"
        )
        if self.gathered:
            parts += f", the gathered model {format_bytes(self.gathered)}"
        return f"{format_bytes(self.total)} on the {self.route} route ({parts})"


class Plan:
    """The decisions of one request, from its profile and sizes.

    ``fixed``: the route the options or data fix, why, and whether the implicit
    route cannot run (``None``: compared); ``words``: the data, for the reason;
    ``available``: bytes it may take (``None``: what the device has now).
    ``route`` and ``reason``: what ran and why; ``forced``: the implicit route
    cannot run.

    Raises:
        ProductsTooLargeError: If neither route fits.
    """

    def __init__(
        self,
        profile: Profile | None,
        sizes: Sizes,
        engine: Engine,
        param_groups: list[list[Tensor]],
        fixed: tuple[str, str, bool] | None = None,
        words: str = "",
        available: int | None = None,
    ):
        self.profile, self.sizes, self.engine = profile, sizes, engine
        self.num_params = [sum(p.numel() for p in group) for group in param_groups]
        self.device, self.dtype = param_groups[0][0].device, param_groups[0][0].dtype
        self.available, self.reason = available, ""
        if fixed is None:
            self.route, reason = self._compare()
            self.forced, self.reason = False, f"{words}: {reason}" if words else reason
        else:
            self.route, self.reason, self.forced = fixed

    def __str__(self) -> str:
        return f"{self.route} route: {self.reason}"

    def agreed(self, route: str, reason: str) -> Plan:
        """This plan on the route a process group agreed on."""
        plan = object.__new__(Plan)
        plan.__dict__.update(self.__dict__, route=route, reason=reason)
        return plan

    def _available(self, given: int | None = None) -> int:
        given = self.available if given is None else given
        return available_bytes(self.device) if given is None else given

    def measured(self, route: str) -> object:
        """The profile of ``route`` (``None`` where it could not be measured)."""
        return None if self.profile is None else getattr(self.profile, route)

    def gram_estimate(self, top_k: int | None, solver: str = "auto") -> MemoryEstimate:
        """The Gram route's peak for ``top_k`` pairs (``None``: all) by ``solver``."""
        gram, sizes = self.profile.gram, self.sizes
        n, n_s, part = sizes.samples, sizes.curvature, sizes.part
        kept = gram.kept(n, n_s)
        part_s = min(part, n_s)
        passes = gram.kept(n - part, n_s - part_s) + self._part_pass(part, part_s)
        if sizes.parts > 1:  # the parts merged, one parameter's copy at a time
            passes = max(passes, kept + gram.largest(n, n_s))
        factors = gram.factors_of(n_s)
        size, groups = n_s * gram.columns, len(self.num_params)
        if solver == "auto" and factors is None:  # too large to measure
            solver = "dense" if top_k is None else "factor_krylov"
        elif solver == "auto":
            solver = choose_solver(factors[0], top_k, gram.dtype, self.device,
                                   available=self._available())  # fmt: skip
        solve = self._solve_bytes(solver, size, top_k, groups)
        return MemoryEstimate(
            "gram", self.reason, self.engine.name, solver, size, int(passes),
            int(kept), int(solve),
        )  # fmt: skip

    def implicit_estimate(
        self, top_k: int, available: int | None = None
    ) -> MemoryEstimate:
        """The implicit route's peak for ``top_k`` pairs, its basis cut to fit.

        Its passes hold the recordings of :meth:`linearized_parts` parts.
        """
        size, solver = max(self.num_params), "ggn_krylov"
        passes, columns, krylov, _ = self._implicit_parts(top_k, available)
        block = solver_block_size(solver, top_k, size)
        return MemoryEstimate(
            "implicit", self.reason, "implicit", solver, self.sizes.curvature,
            int(passes), 0, int(krylov), columns,
            basis_capacity(block, size, top_k=top_k),
        )  # fmt: skip

    def _implicit_parts(
        self, top_k: int, available: int | None
    ) -> tuple[float, int, int, int]:
        """The implicit route's passes, basis columns and bytes, parts recorded.

        The passes: a pass's peak (the first part's recording in it) and the
        recordings of the further parts that fit once the basis does
        (``docs/math.rst``, "Linearized products").
        """
        implicit, part = self.profile.implicit, self.sizes.part
        size, solver = max(self.num_params), "ggn_krylov"
        width = self.pass_width(min(top_k, size))
        passes = max(implicit.peak(part, width), self.profile.baseline.peak(part))
        available = self._available(available)
        room = available - passes
        columns = fitting_basis_columns(size, top_k, self.dtype, room, 0, solver)
        krylov = iterative_workspace_bytes(size, top_k, self.dtype, 0, columns, solver)
        kept = max(implicit.kept(part, width), 1.0)  # the first is in passes
        room = min(room - krylov, RECORDING_FRACTION * available)
        later = int(min(self.sizes.parts - 1, max(room, 0.0) // kept))
        return passes + later * kept, columns, krylov, 1 + later

    def check(self, solver: str = "auto") -> None:
        """Refuse a Gram route whose passes cannot fit, before they run.

        Raises:
            FactorsTooLargeError: If the passes' estimate over
                :data:`ESTIMATE_FACTOR` exceeds the memory available.
            GramTooLargeError: If ``solver`` is ``"dense"`` and its Gram
                matrices of all samples cannot fit.
        """
        if self.measured("gram") is None:
            return
        estimate = self.gram_estimate(1, "factor_krylov")
        if solver == "dense":
            check_gram_fits(estimate.num_rows, len(self.num_params),
                            self.profile.gram.dtype, self.device)  # fmt: skip
        available = self._available()
        if estimate.passes <= ESTIMATE_FACTOR * available:
            return
        raise FactorsTooLargeError(
            f"The passes over these {self.sizes.samples} samples keep factors of V "
            f"with {estimate.num_rows} columns (N·C, N·C·T for sequences of T "
            f"positions): estimated {format_bytes(estimate.passes)} (at least "
            f"{format_bytes(estimate.passes / ESTIMATE_FACTOR)}), but only "
            f"{format_bytes(available)} are available on {self.device}. Refused "
            f"before running. {_GRAM_ADVICE}"
        )

    def watch(
        self, stored_bytes: Callable[[list, set], int]
    ) -> Callable[[list, object], None]:
        """A check of a loader's pass, called with each part and its curvature.

        It refuses (:class:`~vivit.FactorsTooLargeError`) where the factors of
        all batches (``len(loader)``, else one more), extrapolated from
        ``stored_bytes`` of those so far, and one part's pass cannot fit.
        """
        counted: set[int] = set()
        stored, total = [0], self.sizes.parts if self.sizes.loader else None
        available, part = self._available(), self.sizes.part
        passes = 0 if self.measured("gram") is None else self._part_pass(part, part)

        def admit(curvature: list, part: object) -> None:
            stored[0] += stored_bytes(curvature, counted)
            done = part.index + 1
            parts = max(total, done) if total is not None else done + 1
            factors = stored[0] * parts // done
            estimate = factors + passes
            if estimate <= ESTIMATE_FACTOR * available:
                return
            whole = "the whole loader" if total is not None else "one more batch"
            of = parts if total is not None else "an unknown number of"
            raise FactorsTooLargeError(
                f"The layer factors of {whole} and one batch's pass need about "
                f"{format_bytes(estimate)} (factors {format_bytes(factors)}, "
                f"extrapolated from {format_bytes(stored[0])} for the first {done} "
                f"of {of} batches), but only {format_bytes(available)} are "
                f"available on {self.device}. {_GRAM_ADVICE}"
            )

        return admit

    def basis_columns(self, top_k: int) -> int | None:
        """Columns of the implicit route's Krylov basis that fit (``None``: default).

        Raises:
            ProductsTooLargeError: If not even the smallest basis fits.
        """
        if self.measured("implicit") is None:
            return None
        estimate = self.implicit_estimate(top_k)
        available = self._available()
        if estimate.total <= ESTIMATE_FACTOR * available:
            return estimate.basis_columns
        raise ProductsTooLargeError(
            f"route='implicit' needs an estimated {estimate}, but only "
            f"{format_bytes(available)} are available on {self.device}. Refused "
            "before the first product. Ask for fewer pairs (top_k), use the "
            "curvature of fewer samples (subsampling=[...]) or a smaller batch (a "
            "loader's: smaller batches), bound the products' activations with "
            "chunk_size=..., or use the Gram route with Monte-Carlo sampling "
            "(mc_samples=1)."
        )

    def linearized_parts(self, top_k: int) -> int:
        """Parts whose recorded forward pass a solve of ``top_k`` pairs keeps.

        The first part's recording is in the measured pass; each further part's
        adds the bytes a first product keeps, as many as fit beside the solve
        (``docs/math.rst``, "Linearized products"). Unmeasured: a lone part.
        """
        if self.measured("implicit") is None:
            return 1 if self.sizes.parts == 1 else 0
        return self._implicit_parts(top_k, None)[3]

    def pass_width(self, vectors: int) -> int:
        """Vectors per vmapped implicit pass over a part: as many as fit."""
        implicit, part = self.measured("implicit"), self.sizes.part
        if implicit is None:
            return vectors
        per_vector = implicit.peak(part, 2) - implicit.peak(part, 1)
        return max(1, min(vectors, int(PASS_BYTES // max(per_vector, 1))))

    @functools.cached_property
    def samples_per_pass(self) -> int | None:
        """Most samples of a part per engine pass in its budget (``None``: all)."""
        budget, gram = self.engine.memory_budget, self.measured("gram")
        if budget is None or gram is None:
            return None
        budget *= itemsize(gram.dtype)
        samples = part = self.sizes.part
        while samples > 1 and self._transient(samples) > budget:
            samples = (samples + 1) // 2
        return None if samples >= part else samples

    def _transient(self, samples: int) -> float:
        """Bytes of one engine pass beyond the factors it keeps."""
        gram = self.profile.gram
        return gram.peak(samples) - gram.kept(samples)

    def _part_pass(self, part: int, curvature: int) -> float:
        """Peak of one part's pass, ``samples_per_pass`` at a time."""
        gram = self.profile.gram
        if self.samples_per_pass is None:
            return gram.pass_peak(part, curvature)
        activations = self.profile.baseline.peak(part)
        transient = self._transient(self.samples_per_pass)
        return gram.kept(part, curvature) + max(activations, transient)

    def _solve_bytes(
        self, solver: str, size: int, top_k: int | None, groups: int
    ) -> float:
        """The Gram matrices, solver workspace and eigenvectors (closed forms)."""
        dtype, params = self.profile.gram.dtype, max(self.num_params)
        entry = itemsize(dtype)
        per_group = self.profile.gram.factors_of(self.sizes.curvature) or []
        factors = [f for group in per_group for f in group]

        def largest(memory: Callable[[object], int]) -> int:
            return max(map(memory, factors), default=0) * entry

        count = size if top_k is None else min(size, top_k)
        # the eigenvectors V ũ / √λ, formed by one product with V after the solve
        directions = count * params * entry + largest(lambda f: f.product_memory(count))
        if solver == "factor_krylov":
            width = solver_block_size("factor_krylov", top_k, size)
            workspace = iterative_workspace_bytes(size, top_k, dtype, params)
            workspace += largest(lambda f: f.product_memory(width))
            return max(workspace, directions)
        if solver == "dense":
            workspace = dense_workspace_bytes(size, top_k, dtype, self.device)
        else:
            workspace = iterative_workspace_bytes(size, top_k, dtype)
        # while formed: the groups' sums, a parameter's block, its intermediate
        formation = size**2 * entry + largest(lambda f: f.gram_memory())
        return max(
            gram_bytes(size, groups, workspace, dtype),
            groups * size**2 * entry + max(formation, directions),
        )

    def _compare(self) -> tuple[str, str]:
        """The route under ``"auto"``: memory first, then work.

        Except where the Gram route's measurement stops, a pass of it costing more
        than the implicit route's products: then that route is cheaper, and the
        Gram route's memory is not measured.
        """
        stopped = self._gram_stopped()
        if stopped is not None:
            return self._implicit_if_it_fits(stopped, self._available())
        if self.measured("gram") is None:
            return "gram", (
                "the routes' memory and work could not be measured (the logger "
                "'vivit' says why); pass route='implicit' for GGN-vector products"
            )
        available = self._available()
        gram = self.gram_estimate(ROUTE_TOP_K, "factor_krylov")
        if gram.passes > ESTIMATE_FACTOR * available:
            reason = (
                f"the Gram route's passes over the data ({gram.num_rows} columns "
                f"of V) need at least {format_bytes(gram.passes / ESTIMATE_FACTOR)}, "
                f"but {format_bytes(available)} are available"
            )
            return self._implicit_if_it_fits(reason, available)
        if self.profile.gram.factors is None:
            return self._implicit_if_it_fits(
                "the Gram route's factors are too large to measure", available
            )
        costs = self.costs(measure=False)
        if costs["gram"] > costs["implicit"]:  # a lower bound: measure it
            costs = self.costs()
        at_least = "" if costs["measured"] else "at least "
        reason = (
            f"the Gram route costs about {costs['gram']:.2g} multiply-adds (passes "
            f"{costs['passes']:.2g}, solve {costs['solve']:.2g}), the implicit "
            f"route {at_least}{costs['implicit']:.2g} for {ROUTE_TOP_K} eigenpairs"
        )
        if costs["gram"] > costs["implicit"]:
            return self._implicit_if_it_fits(reason, available)
        return "gram", reason

    def _gram_stopped(self) -> str | None:
        """Why the Gram route costs more, where its measurement stopped (else None).

        Its budget: the implicit route's work bounded from below (nothing else
        measured), then, where a pass passed that, measured.
        """
        if self.profile is None:
            return None
        # a pass over fewer samples than a part costs less than the route's passes
        samples = min(self.sizes.curvature, self.sizes.part)
        cost = self.profile.gram_within(self._implicit_work(False), samples)
        if not isinstance(cost, float) or self.measured("implicit") is None:
            return None
        implicit = self._implicit_work(True)
        cost = self.profile.gram_within(implicit, samples)
        if not isinstance(cost, float):
            return None
        return (
            f"the Gram route costs more than {cost:.2g} multiply-adds (its "
            f"measurement, a pass over at most {samples} samples, stopped there), "
            f"the implicit route {implicit:.2g} for {ROUTE_TOP_K} eigenpairs"
        )

    def _implicit_work(self, measure: bool) -> float:
        """The implicit route's products for :data:`ROUTE_TOP_K` pairs, multiply-adds.

        ``measure=False``: a product of ``b`` vectors bounded from below by ``b``
        plain passes.
        """
        part, parts = self.sizes.part, self.sizes.parts
        implicit = self.measured("implicit") if measure else None
        _, base_work, base_ops = self.profile.baseline
        products = 0.0
        for params in self.num_params:
            width = solver_block_size("ggn_krylov", ROUTE_TOP_K, params)
            if implicit is None:
                work, ops = width * base_work(part), base_ops(part)
            else:
                work, ops = implicit.work(part, width), implicit.ops(part, width)
            products += krylov_work(params, width, parts * pass_cost(work, ops))
        return products

    def costs(self, measure: bool = True) -> dict[str, object]:
        """Both routes' expected work for :data:`ROUTE_TOP_K` pairs, multiply-adds.

        ``"gram"`` (its ``"passes"`` and ``"solve"``), ``"implicit"``, and whether
        that was ``"measured"`` (``measure=False``: a product of ``b`` vectors
        bounded from below by ``b`` plain passes).
        """
        gram, sizes = self.profile.gram, self.sizes
        part, parts = sizes.part, sizes.parts
        passes = pass_cost(gram.work(sizes.samples), parts * gram.ops(part))
        solve = 0.0
        for factors in gram.factors_of(sizes.curvature):
            size = factors[0].num_rows
            top_k = min(ROUTE_TOP_K, size)
            work = solver_works(factors, top_k, gram.dtype)
            formed = work["formation"] + work["dense"]
            if top_k <= PARTIAL_FRACTION * size:
                formed = work["formation"] + min(work["dense"], work["gram_krylov"])
                formed = min(formed, work["factor_krylov"])
            solve += formed
        implicit = self.measured("implicit") if measure else None
        return {"gram": passes + solve, "passes": passes, "solve": solve,
                "implicit": self._implicit_work(measure),
                "measured": implicit is not None}  # fmt: skip

    def _implicit_if_it_fits(self, reason: str, available: int) -> tuple[str, str]:
        """The implicit route where its products fit, else the Gram route (or none)."""
        if self.profile.implicit is None:
            return "gram", f"{reason}; but the implicit route could not be measured"
        products = self.implicit_estimate(ROUTE_TOP_K, available)
        if products.total <= ESTIMATE_FACTOR * available:
            return "implicit", reason
        gram = self.gram_estimate(ROUTE_TOP_K, "factor_krylov")
        if gram.passes <= ESTIMATE_FACTOR * available:
            return "gram", f"{reason}; but route='implicit' needs {products}"
        streaming = (
            ", or keep no factors: vivit.StreamingGGN(model, loss_func, "
            "loader).eigh(top_k=...)"
            if self.sizes.loader
            else ""
        )
        raise ProductsTooLargeError(
            f"Neither exact route fits into the {format_bytes(available)} "
            f"available: the Gram route's passes need an estimated "
            f"{format_bytes(gram.passes)}, and route='implicit' {products}. "
            "Refused before running. Ask for fewer pairs (eigh(top_k=...) with "
            "route='implicit'), use the curvature of fewer samples "
            "(subsampling=[...]) or smaller batches, bound the activations with "
            "chunk_size=..., or Monte-Carlo sample the loss Hessian on the Gram "
            f"route (mc_samples=1){streaming}."
        )


#: What to do where the Gram route's factors do not fit.
_GRAM_ADVICE = (
    "Store fewer columns: Monte-Carlo sample the loss Hessian (mc_samples=1), use "
    "the curvature of fewer samples (subsampling=[...]) or a smaller batch, "
    "chunk_size=... (bounds the backward pass, not the kept factors); or keep no "
    "factors at all: route='implicit' (GGN-vector products) or "
    "vivit.StreamingGGN(model, loss_func, loader).eigh(top_k=...), which "
    "recomputes them in every pass."
)
