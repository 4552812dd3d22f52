"""A request's memory and work, measured on a few samples, then extrapolated.

Its own code runs under a :class:`~vivit.memory.counter.Counter` on a copy of the
model; each quantity is a plane in the sizes the math scales it with
(``docs/math.rst``, "Memory of a request"), kept per model and request shape.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import CrossEntropyLoss, Module, Parameter

from vivit.distributed import ShardExchange
from vivit.engines.base import Engine, select_output
from vivit.gram import ParamFactors
from vivit.gram.memory import available_bytes, itemsize
from vivit.losses import LossCurvature
from vivit.memory.counter import Usage, WorkExceeded, measure
from vivit.model_copy import probe_copy
from vivit.model_inputs import (
    ModelInputs,
    call_model,
    input_tensors,
    map_inputs,
    num_samples,
    take_samples,
)
from vivit.options import CurvatureOptions, derived
from vivit.sources.data import Data, engine_context
from vivit.sources.implicit import ImplicitFactors
from vivit.sources.stored import StoredFactors

logger = logging.getLogger("vivit")


#: The Gram route is measured only where its floor on the samples measured is at
#: most this fraction of the memory available.
MEASURE_FRACTION = 1 / 16
#: Samples and vectors measured: sizes of 1 take other paths in some kernels.
_SAMPLES, _VECTORS = (2, 4), (2, 3)

_F64 = torch.float64


def _terms(x: float, y: float, count: int) -> list[float]:
    """The first ``count`` terms of a plane in ``(x, y)``: 1, ``x``, ``y``, ``x·y``."""
    return [1.0, float(x), float(y), float(x * y)][:count]


@dataclass(frozen=True)
class Plane:
    """The largest of planes ``a + b·x + c·y + d·x·y``, ``coefficients [K, terms]``.

    Fitted through 2 (``a + b·x``), 3 or 4 points: one plane per operation of
    traces of one length, else one through their peaks.
    """

    coefficients: Tensor

    def __call__(self, x: float, y: float | None = None) -> float:
        """The largest value at ``(x, y)`` (``y = x`` if not given), at least 0."""
        y = x if y is None else y
        basis = torch.tensor(_terms(x, y, self.coefficients.shape[1]), dtype=_F64)
        return max(0.0, float((self.coefficients @ basis).max()))

    @classmethod
    def fit(cls, points: dict[tuple[int, int], list[float] | float]) -> Plane:
        """Through ``{(x, y): trace or value}``."""
        values = [v if isinstance(v, list) else [v] for v in points.values()]
        if len({len(v) for v in values}) > 1:
            values = [[max(v)] for v in values]
        count = max(2, len(points))
        matrix = torch.tensor([_terms(*k, count) for k in points], dtype=_F64)
        rhs = torch.tensor(values, dtype=_F64)  # [points, K]
        return cls(torch.linalg.solve(matrix, rhs).T.contiguous())


@dataclass(frozen=True)
class GramProfile:
    """The Gram route's pass of ``x`` samples, ``y`` of them curvature samples.

    ``peak``, ``work``, ``ops``: a pass's peak bytes (by its traces, ``y = x``),
    multiply-adds and operations; ``curvature_peak``: peak bytes by ``(x, y)``;
    ``kept``: bytes its factors, gradient and loss keep; ``largest``: those of the
    largest parameter's factors (parts merge one parameter at a time);
    ``factors``: each group's factors of ``V`` for one sample, on the meta device
    (``None``: too large to measure); ``columns`` of ``V`` per sample; ``dtype``
    of the Gram-space products.
    """

    peak: Plane
    curvature_peak: Plane
    kept: Plane
    largest: Plane
    work: Plane
    ops: Plane
    factors: list[list[ParamFactors]] | None
    columns: int
    dtype: torch.dtype

    def pass_peak(self, samples: int, curvature: int) -> float:
        """Peak bytes of a pass of ``samples``, ``curvature`` of them."""
        fewer = self.curvature_peak(samples) - self.curvature_peak(samples, curvature)
        return self.peak(samples) - fewer

    def factors_of(self, curvature: int) -> list[list[ParamFactors]] | None:
        """Each group's factors for ``curvature`` samples, shapes only."""
        if self.factors is None:
            return None
        rows = [0] * curvature
        return [[f.select(rows) for f in group] for group in self.factors]


class Passes(NamedTuple):
    """A pass's peak bytes (by traces), multiply-adds and operations, as planes."""

    peak: Plane
    work: Plane
    ops: Plane

    @classmethod
    def fit(cls, usage: dict[tuple[int, int], Usage]) -> Passes:
        """Through the usage of passes at ``{(x, y): usage}``."""
        return cls(*(Plane.fit({k: getattr(u, n) for k, u in usage.items()})
                     for n in ("trace", "work", "ops")))  # fmt: skip


@dataclass(frozen=True)
class PerVector:
    """A quantity of products of ``y`` vectors run one after another, by ``x``.

    ``lines``: :class:`Plane` s in ``x`` (traces of one length: one line per
    operation) at each of :data:`_VECTORS`, linear in ``y`` between and beyond.
    """

    lines: tuple[Plane, Plane]

    def __call__(self, x: float, y: float) -> float:
        """The value for ``x`` samples and ``y`` vectors, at least 0."""
        (low, high), (fewer, more) = _VECTORS, self.lines
        step = (more(x) - fewer(x)) / (high - low)
        return max(0.0, fewer(x) + (y - low) * step)

    @classmethod
    def fit(cls, points: dict[tuple[int, int], list[float] | float]) -> PerVector:
        """Through ``{(x, y): trace or value}`` at :data:`_VECTORS`."""
        return cls(tuple(
            Plane.fit({k: v for k, v in points.items() if k[1] == vectors})
            for vectors in _VECTORS
        ))  # fmt: skip


class ImplicitPasses(NamedTuple):
    """A linearized product's peak bytes, multiply-adds, operations, kept bytes.

    ``peak`` and ``kept``: of a part's first product (its recording included, kept
    for the next); ``work`` and ``ops``: of a later one (the products of a solve).
    """

    peak: PerVector
    work: Plane
    ops: Plane
    kept: PerVector


class Profile:
    """What a request uses: a plain pass, and each route when first asked for.

    ``baseline``: the plain pass's peak bytes, multiply-adds and operations by
    samples. ``subsampled``: also measure a pass with fewer curvature samples.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        batch: tuple[ModelInputs, Tensor],
        param_groups: list[list[Parameter]],
        options: CurvatureOptions,
        subsampled: bool,
    ):
        self._device = param_groups[0][0].device
        with engine_context([p for group in param_groups for p in group]):
            self._twin, self._groups, batch = _twin(model, param_groups, batch)
            if batch[1] is None:
                targets = _targets(self._twin, loss_func, batch[0], options)
                batch = (batch[0], targets)
        self._loss_func, self._batch, self._subsampled = loss_func, batch, subsampled
        # the caller's generator is not drawn from: its samples are the run's
        self._options = derived(
            options, chunk_size=None, subsampling=None, process_group=False,
            max_batches=None, progress=False, solver="auto", generator=None,
        )  # fmt: skip
        params = self._params = [p for group in self._groups for p in group]

        def plain_pass(n: int) -> tuple[int, int]:
            """The output's entries and the columns of ``V`` per sample."""
            inputs, targets = _take(batch, n)
            output = select_output(call_model(self._twin, inputs), options.output)
            torch.autograd.grad(loss_func(output, targets), params, allow_unused=True)
            loss = LossCurvature(loss_func, output.detach(), targets)
            return output[0].numel(), loss.columns_per_sample(
                options.mc_samples, options.mc_per
            )

        usage = {}
        with engine_context(params):
            for n in _SAMPLES:
                shape, usage[n, n] = measure(lambda n=n: plain_pass(n))
        self.baseline = Passes.fit(usage)
        self.outputs, self.columns = shape
        self._dtype = options.gram_dtype or params[0].dtype
        #: Where :meth:`gram_within` stopped: cost, and the samples asked for.
        self._gram_stop: tuple[float, int] | None = None

    @functools.cached_property
    def gram(self) -> GramProfile | None:
        """The Gram route's profile (``None`` where it cannot run on the copy).

        Where even its floor (``K`` output-sized vectors a sample) on the samples
        measured exceeds :data:`MEASURE_FRACTION` of the memory available, not
        measured: its memory is that floor and ``factors`` is ``None``.
        """
        return self._gram_profile()

    def gram_within(self, budget: float, samples: int) -> GramProfile | float | None:
        """:attr:`gram`, or the cost at which its measurement stopped.

        A pass over at most ``samples`` samples stops once its cost
        (:class:`~vivit.memory.counter.Counter`) passes ``budget``: a lower bound
        of the route's passes over ``samples`` or more. A stop is kept: a later
        request of no larger budget over as many samples or more gets it again
        without measuring (:attr:`gram` measures whole).
        """
        if "gram" in self.__dict__:
            return self.gram
        stop = self._gram_stop
        if stop is not None and budget <= stop[0] and samples >= stop[1]:
            return stop[0]
        try:
            self.__dict__["gram"] = self._gram_profile(budget, samples)
        except WorkExceeded as stopped:
            self._gram_stop = (stopped.cost, samples)
            return stopped.cost
        return self.gram

    def _gram_profile(
        self, budget: float | None = None, samples: int = 0
    ) -> GramProfile | None:
        per_sample = self.columns * self.outputs * itemsize(self._dtype)
        if per_sample * _SAMPLES[-1] > MEASURE_FRACTION * available_bytes(self._device):
            line = Plane(torch.tensor([[0.0, float(per_sample)]], dtype=_F64))
            zero = Plane(torch.zeros(1, 2, dtype=_F64))
            return GramProfile(line, zero, line, zero, zero, zero, None,
                               self.columns, self._dtype)  # fmt: skip
        with engine_context(self._params):
            return _logged(self._gram, budget, samples)

    @functools.cached_property
    def implicit(self) -> ImplicitPasses | None:
        """The implicit route's profile (``None`` where it cannot run on the copy)."""
        with engine_context(self._params):
            return _logged(self._implicit)

    def _gram(self, budget: float | None = None, samples: int = 0) -> GramProfile:
        model, loss_func, groups = self._twin, self._loss_func, self._groups
        small, large = _SAMPLES
        points = [(small, small), (large, large)]
        points += [(large, small)] if self._subsampled else []
        usage: dict[tuple[int, int], Usage] = {}
        largest: dict[tuple[int, int], float] = {}
        source = None
        for n, curvature in points:
            run = derived(
                self._options,
                subsampling=None if curvature == n else tuple(range(curvature)),
            )
            data = Data(model, loss_func, _take(self._batch, n), run)
            del source  # the previous point's factors
            source, usage[n, curvature] = measure(
                lambda d=data, o=run: StoredFactors.run(
                    model, loss_func, d, groups, {}, o, ShardExchange(None), o.engine
                ),
                budget if n <= samples else None,
            )
            largest[n, curvature] = max(
                _largest_bytes(g.curvature) for g in source.groups
            )
        peak, work, ops = Passes.fit({k: u for k, u in usage.items() if k[0] == k[1]})
        return GramProfile(
            peak=peak,
            curvature_peak=Plane.fit({k: u.peak for k, u in usage.items()}),
            kept=Plane.fit({k: u.kept for k, u in usage.items()}),
            largest=Plane.fit(largest),
            work=work,
            ops=ops,
            factors=[
                [
                    f.map_tensors(lambda t: t.to("meta")).select([0])
                    for f in g.curvature.ggn_factors
                ]
                for g in source.groups
            ],  # fmt: skip
            columns=source.groups[0].batch.columns_per_sample,
            dtype=source.groups[0].dtype,
        )

    def _implicit(self) -> ImplicitPasses:
        first: dict[tuple[int, int], Usage] = {}
        later: dict[tuple[int, int], Usage] = {}
        groups = self._groups
        index = max(range(len(groups)), key=lambda i: sum(p.numel() for p in groups[i]))
        options = derived(self._options, route="implicit", engine="auto")
        for n, vectors in itertools.product(_SAMPLES, _VECTORS):
            data = Data(self._twin, self._loss_func, _take(self._batch, n), options)
            source = ImplicitFactors(self._twin, self._loss_func, data, groups, options)
            group = source.groups[index]
            values = [p.new_zeros(vectors, *p.shape) for p in groups[index]]
            with group.linearized(vectors):  # as a solve runs them
                for usage in (first, later):
                    call = functools.partial(group.ggn_matmul, values)
                    usage[n, vectors] = measure(call)[1]
        # one vector after another: traces of one length per number of vectors
        _, work, ops = Passes.fit(later)
        return ImplicitPasses(
            PerVector.fit({k: u.trace for k, u in first.items()}),
            work,
            ops,
            PerVector.fit({k: u.kept for k, u in first.items()}),
        )


#: Profiles measured before, per model and request shape.
_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def profile(
    model: Module,
    loss_func: Module,
    batch: tuple[ModelInputs, Tensor],
    param_groups: list[list[Parameter]],
    options: CurvatureOptions,
    engine: Engine,
    subsampled: bool = False,
) -> Profile | None:
    """The request's profile, kept per model and request shape.

    ``None`` where it cannot run on a copy of the model: the logger ``"vivit"``
    says why (the run raises what is wrong). ``engine``: the Gram route's.
    """
    inputs, targets = batch
    scalars = (int, float, str, bool, type(None))
    # what the profile depends on: shapes, types, options; not the batch size
    key = (
        tuple((n, type(m)) for n, m in model.named_modules()),
        tuple(
            (n, p.shape, p.dtype, p.device, p.requires_grad)
            for n, p in model.named_parameters()
        ),  # fmt: skip
        tuple((t.shape[1:], t.dtype) for t in input_tensors(inputs)),
        None if targets is None else (targets.shape[1:], targets.dtype),
        type(loss_func),
        tuple(
            sorted((k, v) for k, v in vars(loss_func).items() if isinstance(v, scalars))
        ),  # fmt: skip
        tuple(tuple(id(p) for p in group) for group in param_groups),
        (options.mc_samples, options.mc_per, options.gram_dtype),
        id(options.output) if callable(options.output) else options.output,
        type(engine),
        subsampled,
    )
    known = _PROFILES.setdefault(model, {})
    if key not in known:
        options = derived(options, engine=engine, solver="auto")
        known[key] = _logged(
            Profile, model, loss_func, batch, param_groups, options, subsampled
        )
    return known[key]


def _logged(function: Callable, *args: object) -> object:
    """``function(*args)``, or ``None`` where it raises: an estimate never fails."""
    try:
        return function(*args)
    except WorkExceeded:
        raise
    except Exception as error:  # noqa: BLE001
        logger.info(
            "Cannot measure the request on a copy of the model (%s: %s); it runs "
            "without a memory check.", type(error).__name__, error,
        )  # fmt: skip
        return None


def _take(batch: tuple[ModelInputs, Tensor], n: int) -> tuple[ModelInputs, Tensor]:
    """``n`` samples of a batch (repeated where it has fewer)."""
    inputs, targets = batch
    index = torch.arange(n) % num_samples(inputs)
    return take_samples(inputs, index.to(targets.device)), targets[index]


def _twin(
    model: Module,
    param_groups: list[list[Parameter]],
    batch: tuple[ModelInputs, Tensor],
) -> tuple[Module, list[list[Parameter]], tuple[ModelInputs, Tensor]]:
    """The model's probe copy (meta: its values drawn on the CPU); its groups."""
    params = list(model.parameters())
    twin, twins = probe_copy(model)
    if any(p.is_meta for p in params):
        twin = twin.to_empty(device="cpu")
        twins = list(twin.parameters())
        with torch.no_grad():
            for param in twins:
                param.normal_(std=0.02)
        batch = tuple(None if b is None else map_inputs(b, _on_cpu) for b in batch)
    index = {id(p): i for i, p in enumerate(params)}
    param_groups = [[twins[index[id(p)]] for p in group] for group in param_groups]
    return twin, param_groups, batch


def _targets(
    model: Module, loss_func: Module, inputs: ModelInputs, options: CurvatureOptions
) -> Tensor:
    """Targets of the shape the loss takes for the model's output of ``inputs``."""
    with torch.no_grad():
        output = select_output(call_model(model, inputs), options.output)
    if isinstance(loss_func, CrossEntropyLoss):
        shape = output.shape[:1] + output.shape[2:]
        return torch.zeros(shape, dtype=torch.long, device=output.device)
    return torch.zeros_like(output)


def _on_cpu(tensor: Tensor) -> Tensor:
    """A tensor's values on the CPU, drawn where it has none (the meta device)."""
    if not tensor.is_meta:
        return tensor
    draw = torch.randn if tensor.is_floating_point() else torch.zeros
    return draw(tensor.shape, dtype=tensor.dtype)


def _largest_bytes(curvature) -> int:
    """Bytes of the storages of a group's largest parameter's factors."""
    grads = curvature.grad_factors or [None] * len(curvature.ggn_factors)
    sizes = [0]
    for factors in zip(curvature.ggn_factors, grads, strict=True):
        tensors = [t for f in factors if f is not None for t in f.tensors()]
        storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}
        sizes.append(sum(s.nbytes() for s in storages.values()))
    return max(sizes)
