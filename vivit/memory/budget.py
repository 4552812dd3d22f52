"""The memory of a pass over a data loader, checked while it runs.

:class:`~vivit.LowRankGGN` over a loader keeps every batch's layer factors;
:class:`FactorBudget` extrapolates the factors stored after each batch to the
whole loader, adds one batch's pass (:func:`vivit.memory.estimate_memory`) and
refuses a loader that cannot fit early in the pass (``docs/math.rst``, "Data
sets and processes").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from torch.nn import Module, Parameter

from vivit.errors import FactorsTooLargeError
from vivit.gram import ParamFactors
from vivit.gram.memory import available_bytes, check_gram_fits
from vivit.memory.estimate import kept_bytes
from vivit.memory.request import estimate_memory
from vivit.model_inputs import ModelInputs, num_samples, take_samples
from vivit.options import CurvatureOptions

logger = logging.getLogger("vivit")


class KeptFactors(Protocol):
    """A group's curvature with the factors it keeps for later products.

    :class:`~vivit.sources.collector.GroupCurvature` is one; the budget reads
    only these (the group pipeline lies below this package).

    Attributes:
        ggn_factors: Per-parameter factors of ``V``.
        grad_factors: Per-parameter factors of the per-sample gradients, or
            ``None``.
    """

    ggn_factors: list[ParamFactors] | None
    grad_factors: list[ParamFactors] | None


def stored_bytes(
    curvatures: Iterable[KeptFactors], counted: dict[tuple, int] | None = None
) -> int:
    """Bytes the factors of ``V`` and of the per-sample gradients keep alive.

    Tensors that share memory (a layer's inputs serve both) count once; a view
    counts its whole storage.

    Args:
        curvatures: Groups' curvature with their factors kept.
        counted: Storages counted before (e.g. by the earlier chunks of a batch,
            whose inputs are views of the batch's); updated, and not counted again.

    Returns:
        The bytes of the storages not counted before.
    """
    storages: dict[tuple, int] = {}
    for curvature in curvatures:
        factors = [*(curvature.ggn_factors or []), *(curvature.grad_factors or [])]
        storages.update(_storage_sizes(factors))
    if counted is None:
        return sum(storages.values())
    new = {key: size for key, size in storages.items() if key not in counted}
    counted.update(new)
    return sum(new.values())


def largest_parameter_bytes(curvatures: Iterable[KeptFactors]) -> int:
    """Bytes of the parameter whose factors (``V`` and gradients) take the most.

    Merging a loader's batches (:func:`vivit.sources.union.merged_blocks`) copies one
    parameter's factors at a time: this is the copy's size for these samples.
    """
    sizes = [0]
    for curvature in curvatures:
        grads = curvature.grad_factors or [None] * len(curvature.ggn_factors)
        for ggn, grad in zip(curvature.ggn_factors, grads, strict=True):
            factors = [ggn] if grad is None else [ggn, grad]
            sizes.append(sum(_storage_sizes(factors).values()))
    return max(sizes)


def _storage_sizes(factors: Iterable[ParamFactors]) -> dict[tuple, int]:
    """Bytes of every storage the factors hold, by device and address."""
    storages = {}
    for tensor in (t for f in factors for t in f.tensors()):
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return storages


def batch_pass_bytes(
    model: Module,
    inputs: ModelInputs,
    options: CurvatureOptions,
    loss_func: Module | None = None,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
) -> int:
    """Estimated peak of one batch's pass before any Gram matrix is formed.

    The pass is estimated with the request's own options (engine, ``gram_dtype``,
    Monte-Carlo samples), as the run makes it.

    Args:
        model: The network.
        inputs: The batch's inputs (one chunk's with ``chunk_size``).
        options: The request's checked options.
        loss_func: The loss module (resolves ``engine="auto"`` as the run does).
        param_groups: The request's parameter groups.

    Returns:
        Bytes: activations, the batch's factors with their temporaries (such as
        unfolded convolution inputs) and the backward transients
        (:func:`vivit.memory.estimate_memory`).
    """
    one = estimate_memory(
        model,
        take_samples(inputs, slice(0, 1)),
        num_samples(inputs),
        loss_func=loss_func,
        param_groups=param_groups,
        top_k=None,
        options=options.replace(solver="dense", chunk_size=None),
    )
    return kept_bytes(one)


class FactorBudget:
    """Refuses a loader whose stored factors would not fit, early in the pass.

    Peak memory of a pass over ``B`` batches: the factors of all batches plus one
    batch's forward and backward pass. After each batch ``b``, the factors stored
    so far (:func:`stored_bytes`) are extrapolated to ``stored · B / b`` (without
    ``len(loader)``: one more batch of the mean size); one batch's pass is
    estimated from the first batch with :func:`vivit.memory.estimate_memory`
    (activations, its factors with their temporaries such as unfolded
    convolution inputs, backward transients). The sum must fit into the memory
    available before the first batch; otherwise the run stops with the estimate
    and the alternatives, after the first batch when the loader has a length.
    ``tests/memory/test_data_loader_memory.py`` checks the estimate against the
    measured peak. A request for the dense solver (``num_grams``) also checks,
    after the first batch, that the Gram matrices of all samples will fit
    (``B`` times the first batch's rows). With ``chunk_size`` every chunk is
    accounted to its batch as it comes, one chunk's pass stands for one batch's,
    and the Gram matrices are checked when they are formed.

    Args:
        total: Number of batches ``B`` (``None``: unknown).
        model: The network (its parameters' device).
        options: The request's checked options (its ``chunk_size``: most
            samples per backward pass).
        num_grams: Gram matrices the request forms (``0``: on demand only).
        loss_func: The loss module, for the estimate of one batch's pass.
        param_groups: The request's parameter groups, likewise.
    """

    def __init__(
        self,
        total: int | None,
        model: Module,
        options: CurvatureOptions,
        num_grams: int = 0,
        loss_func: Module | None = None,
        param_groups: Sequence[Sequence[Parameter]] | None = None,
    ):
        self._options = options
        self._loss_func = loss_func
        self._param_groups = param_groups
        self._chunk_size = options.chunk_size
        self._counted: dict[tuple, int] = {}
        self._total = total
        self._num_grams = num_grams
        self._model = model
        self._device = next(model.parameters()).device
        self._available = available_bytes(self._device)
        self._stored = 0
        self._largest = 0
        self._first = True
        self._first_inputs: ModelInputs | None = None
        self._transient = 0

    def _batch_pass(self, stored: int) -> int:
        """One batch's pass, estimated after the first batch ran.

        The estimate is advisory: where :func:`vivit.memory.estimate_memory`
        cannot probe the model (it ran the batch, but e.g. a layer called with
        keyword arguments defeats the probe), the batch's stored factors stand
        in for its pass, and the logger ``"vivit"`` says so.
        """
        try:
            return batch_pass_bytes(
                self._model,
                self._first_inputs,
                self._options,
                self._loss_func,
                self._param_groups,
            )
        except Exception as error:  # noqa: BLE001 (an estimate must not fail a run)
            logger.info(
                "Cannot estimate the memory of one batch's pass (%s: %s); the memory "
                "check counts its stored factors instead.",
                type(error).__name__,
                error,
            )
            return stored

    def admit(
        self, curvature: list[KeptFactors], index: int, inputs: ModelInputs
    ) -> None:
        """Account for a batch's stored factors; raise if the loader cannot fit.

        Args:
            curvature: The batch's (or one of its chunks') curvature of every
                group, factors kept.
            index: The batch's position in the loader.
            inputs: The part's inputs (the first part's give the estimate of
                one batch's pass).

        Raises:
            FactorsTooLargeError: If the estimate exceeds the available memory.
            GramTooLargeError: If the dense solver's Gram matrices of all
                samples would not fit.
        """
        stored = stored_bytes(curvature, self._counted)
        if self._first:  # the first batch's first part
            self._first = False
            self._first_inputs = inputs
            self._transient = self._batch_pass(stored)
            self._first_inputs = None
            if self._num_grams and self._total is not None and not self._chunk_size:
                factors = curvature[0].ggn_factors[0]
                check_gram_fits(
                    factors.num_rows * self._total,
                    self._num_grams,
                    factors.dtype,
                    self._device,
                )
        self._stored += stored
        self._largest += largest_parameter_bytes(curvature)
        done = index + 1
        batches = max(self._total, done) if self._total is not None else done + 1
        factors = self._stored * batches // done
        # after the pass the blocks are merged, one parameter's copy at a time
        merging = (
            self._largest * batches // done if batches > 1 or self._chunk_size else 0
        )
        estimate = factors + max(self._transient, merging)
        if estimate <= self._available:
            return
        whole = "the whole loader" if self._total is not None else "one more batch"
        of = batches if self._total is not None else "an unknown number of"
        raise FactorsTooLargeError(
            f"The layer factors of {whole} and one batch's backward pass need "
            f"about {estimate / 2**20:.1f} MiB (factors {factors / 2**20:.1f} MiB, "
            f"merging them {merging / 2**20:.1f} MiB, "
            f"extrapolated from {self._stored / 2**20:.1f} MiB for the first {done} "
            f"of {of} batches), but only {self._available / 2**20:.1f} MiB were "
            f"available on {self._device}. Store fewer columns: Monte-Carlo sample "
            "the loss Hessian (mc_samples=1 keeps N instead of N·C columns per "
            "layer), pass a loader over fewer samples, or stream over the loader "
            "without storing the factors: vivit.StreamingGGN(model, loss_func, "
            "loader).eigh(top_k=...) recomputes them in every pass "
            "(docs/math.rst, 'Data sets and processes')."
        )
