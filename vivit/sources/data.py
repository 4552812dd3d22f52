"""The caller's data, checked once, and every pass over it, part by part.

A *part* runs together: a mini-batch, a loader's batch, or a chunk of either
(``chunk_size``); their losses combine (``docs/math.rst``, "Data sets and processes").
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain

import torch
from torch import Tensor
from torch.nn import CrossEntropyLoss, Module
from tqdm.auto import tqdm

from vivit._validation import check_subsampling
from vivit.engines.base import BatchInfo, EngineOutput
from vivit.errors import (
    InvalidArgumentError,
    ModelChangedError,
    NondeterministicDataError,
)
from vivit.losses import LossNormalization
from vivit.model_inputs import ModelInputs, input_tensors, num_samples, take_samples
from vivit.options import CurvatureOptions
from vivit.sources.batches import checked_batch, iterate_batches, naming_batch
from vivit.sources.union import UnionOutput

#: Seconds a pass runs before its progress bar appears (``progress=None``).
PROGRESS_DELAY = 2.0

#: What the progress bar of a pass over a loader without ``len`` says.
UNBOUNDED_NOTE = (
    "the loader has no len: the pass reads until it ends; an infinite "
    "IterableDataset never does, pass max_batches"
)


@dataclass(frozen=True)
class Part:
    """Samples that run together, with the loss they run with.

    Attributes:
        index: Position of the part in the pass.
        batch: The loader's batch it belongs to (``None``: one mini-batch).
        subsampling: Its curvature samples in the part (``None``: all; ``[0]``
            without any, ``has_curvature`` false); ``samples``: a chunk's in the batch.
        loss_func: The caller's loss, or the summed one where ``weightless``
            (no weight in the loss on all samples; :func:`part_loss`).
    """

    index: int
    batch: int | None
    inputs: ModelInputs
    targets: Tensor
    subsampling: list[int] | None
    has_curvature: bool
    samples: range | None
    loss_func: Module
    weightless: bool

    @property
    def ggn_mask(self) -> Tensor:
        """``[N_part]``: ``True`` for its curvature samples."""
        mask = torch.zeros(len(self.targets), dtype=torch.bool)
        if self.has_curvature:
            mask[self.subsampling or slice(None)] = True
        return mask


#: Handles one part; returns its batch context and loss and gradient (or ``None``).
Visit = Callable[[Part], "tuple[BatchInfo, EngineOutput] | None"]


class Data:
    """The caller's data: one mini-batch or an iterable of batches, checked.

    Walks it part by part (:meth:`walk`): gradients on, a progress bar, errors
    naming the loader's batch, and every pass (and :meth:`peek`) from the random
    state of construction, forked: the global generators and a loader's own are
    left as they were, and each pass yields the same batches (``docs/guide.rst``,
    "The observer's contract"). ``grouped``: the process is a rank of a group
    (its parts combine with others').

    Raises:
        InvalidArgumentError: For a malformed mini-batch, or a subsampling with a
            loader.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: object,
        options: CurvatureOptions,
        *,
        grouped: bool = False,
    ):
        self.single = isinstance(data, Tensor) or (
            isinstance(data, tuple | list) and any(isinstance(t, Tensor) for t in data)
        )
        #: The targets' shape per sample: a mini-batch's, a loader's after a pass.
        self.sample_shape: tuple[int, ...] | None = None
        if self.single:
            data = checked_batch(data, model, list(model.parameters()))
            check_subsampling(options.subsampling, num_samples(data[0]))
            self.sample_shape = tuple(data[1].shape[1:])
            data = [data]
        elif options.subsampling is not None:
            raise InvalidArgumentError(
                "subsampling selects samples of one mini-batch; with a data loader, "
                "pass a loader over the samples whose curvature you want."
            )
        self.passes = 0
        self._model, self._loss_func, self._data = model, loss_func, data
        self._options, self._grouped = options, grouped
        self._reread: str | None = None
        self._digests: list[str] = []
        self._first: tuple[ModelInputs, Tensor] | None = None
        self._start = RandomState(model.parameters(), data)

    def reread(self, front: str) -> None:
        """Let a source pass more than once (called before its first pass).

        The batches and the model of every pass are then checked against the first
        pass's; ``front`` names the caller.

        Raises:
            InvalidArgumentError: For an iterator or generator.
        """
        if isinstance(self._data, Iterator):
            raise InvalidArgumentError(
                f"{front} passes over the data more than once, but an iterator or "
                f"generator ({type(self._data).__name__}) can be passed over once: "
                "pass a list of batches or a DataLoader."
            )
        self._reread = front
        self._model_state = self._model_fingerprint()

    @property
    def source(self) -> object:
        """The data as the caller passed it (a loader), or the mini-batch."""
        return self._data

    def peek(self) -> tuple[ModelInputs, Tensor] | None:
        """The first batch, checked (``None``: none; an iterator's is put back)."""
        if self.single:
            return self._data[0]
        if self._first is None:
            with self._start.forked():
                self._first = next(iterate_batches(self._data, self._model, 1), None)
            if isinstance(self._data, Iterator) and self._first is not None:
                self._data = chain([self._first], self._data)
        return self._first

    def batch_sizes(self) -> tuple[list[int], str]:
        """The samples of each batch (a loader's first's for the others), and in words.

        The words are ``""`` for a mini-batch.
        """
        if self.single:
            return [num_samples(self._data[0][0])], ""
        if isinstance(self._data, Sequence):  # every batch at hand
            batches = iterate_batches(
                self._data, self._model, self._options.max_batches
            )
            sizes = [num_samples(inputs) for inputs, _ in batches]
            largest = max(sizes, default=0)
            words = f"a list of {len(sizes)} batches of {sum(sizes)} samples"
            return sizes, f"{words} (the largest {largest})"
        size = num_samples(self.peek()[0])
        count = self.num_batches()
        if count is None:
            return [size], (
                f"a data loader without len(), judged on its first batch of {size} "
                "samples (more batches add to the Gram route's memory and cost only; "
                "its memory is checked again while its pass runs)"
            )
        return [size] * count, (
            f"a data loader of about {count * size} samples ({count} batches of "
            f"the first batch's {size})"
        )

    def num_batches(self) -> int | None:
        """Batches of a pass, if known (``1`` for a mini-batch)."""
        max_batches = self._options.max_batches
        try:
            length = len(self._data)
        except TypeError:  # no len, e.g. a DataLoader over an IterableDataset
            return max_batches
        return length if max_batches is None else min(length, max_batches)

    def walk(self, visit: Visit, description: str) -> UnionOutput:
        """One pass: ``visit`` every part in order; the union of what they returned.

        ``description``: what the pass computes (its progress bar's text).

        Raises:
            ModelChangedError: On a later pass (``reread``), if the model changed.
            NondeterministicDataError: On a later pass (``reread``), if the loader
                yields other batches.
        """
        if self._reread is not None and self.passes:
            self._check_model_unchanged()
        self.passes += 1
        union, indices = UnionOutput(), itertools.count()
        if self.single:
            batches = iter(self._data)
        else:
            batches = iterate_batches(
                self._data, self._model, self._options.max_batches
            )
        if self._reread is not None:
            batches = self._fingerprinted(batches)
        if not self.single:
            name = self._reread or "LowRankGGN"
            pass_name = f"pass {self.passes}" if self._reread else "pass over the data"
            batches = progress_bar(
                batches,
                self.num_batches(),
                self._options.progress,
                f"{name}: {pass_name} ({description})",
            )
        with self._start.forked(), torch.enable_grad():
            for batch_index, batch in enumerate(batches):
                if self.sample_shape is None:
                    self.sample_shape = tuple(batch[1].shape[1:])
                for part in self._parts(batch, None if self.single else batch_index):
                    part = dataclasses.replace(part, index=next(indices))
                    with naming_batch(part.batch):
                        result = visit(part)
                    if result is not None:
                        union.add(*result)
        return union

    def _parts(self, batch: tuple[ModelInputs, Tensor], batch_index: int | None):
        inputs, targets = batch
        size = num_samples(inputs)
        chunk_size = self._options.chunk_size
        subsampling = self._options.subsampling
        whole = chunk_size is None or chunk_size >= size
        for start in range(0, size, size if whole else chunk_size):
            stop = size if whole else min(start + chunk_size, size)
            samples = None if whole else range(start, stop)
            part_inputs = inputs if whole else take_samples(inputs, slice(start, stop))
            part_targets = targets if whole else targets[start:stop]
            local = None
            if subsampling is not None:
                local = [n - start for n in subsampling if start <= n < stop]
            # a lone mini-batch run whole: its loss is the union's
            combined = not self.single or samples is not None or self._grouped
            loss_func, weightless = part_loss(self._loss_func, part_targets, combined)
            yield Part(
                index=0,
                batch=batch_index,
                inputs=part_inputs,
                targets=part_targets,
                subsampling=local or ([0] if local is not None else None),
                has_curvature=local is None or bool(local),
                samples=samples,
                loss_func=loss_func,
                weightless=weightless,
            )

    def _fingerprinted(self, batches: Iterable) -> Iterator:
        """The batches of a pass, each checked against the first pass's."""
        first, known, count = self.passes == 1, len(self._digests), 0
        for index, (inputs, targets) in enumerate(batches):
            digest = fingerprint([*input_tensors(inputs), targets])
            if first:
                self._digests.append(digest)
            elif index >= known or digest != self._digests[index]:
                extra = f" (pass 1 had only {known} batches)" if index >= known else ""
                raise NondeterministicDataError(
                    f"Batch {index} of the data loader differs between pass 1 and "
                    f"pass {self.passes}{extra}: {self._reread} combines every batch "
                    "of every pass, so the loader must yield the same batches in "
                    "the same order each time. Every pass starts from the random "
                    "state of construction (shuffling and transforms drawn from "
                    "torch repeat), but not Python's random or NumPy's: draw "
                    "random transforms from torch (or pass a fixed list of "
                    "batches), and do not change its tensors in place after "
                    "construction (normalise or augment a copy): a batch changed "
                    "in place since pass 1 is refused, never used."
                )
            count += 1
            yield inputs, targets
        if not first and count != known:
            raise NondeterministicDataError(
                f"The data loader yielded {count} batches in pass {self.passes} but "
                f"{known} in pass 1; {self._reread} needs the same "
                "batches in every pass."
            )

    def _model_fingerprint(self) -> str:
        state = self._model.state_dict().values()
        return fingerprint([value for value in state if isinstance(value, Tensor)])

    def _check_model_unchanged(self) -> None:
        if self._model_fingerprint() != self._model_state:
            raise ModelChangedError(
                f"The model's parameters or buffers changed since this "
                f"{self._reread} was built (before pass {self.passes + 1}): its "
                "loss, gradient and normalization belong to the old values, and a "
                "pass with the new ones would mix two models. Build a new one "
                f"after changing the model."
            )


def part_loss(
    loss_func: Module, targets: Tensor, combined: bool
) -> tuple[Module, bool]:
    """The loss a part runs with, and whether it carries no weight.

    A combined part whose every target a mean cross-entropy ignores (loss ``0/0``
    alone) runs with the summed loss (``0``) and weight ``0`` (:func:`weightless`).
    """
    ignored = (
        isinstance(loss_func, CrossEntropyLoss)
        and loss_func.reduction == "mean"
        and not targets.is_floating_point()
        and bool((targets == loss_func.ignore_index).all())
    )
    if not (combined and ignored):
        return loss_func, False
    summed = CrossEntropyLoss(
        weight=loss_func.weight,
        ignore_index=loss_func.ignore_index,
        reduction="sum",
        label_smoothing=loss_func.label_smoothing,
    )
    return summed, True


def weightless(batch: BatchInfo) -> BatchInfo:
    """A part's batch context with sample weights ``0`` under a mean."""
    weights = (0.0,) * batch.batch_size
    return dataclasses.replace(batch, normalization=LossNormalization("mean", weights))


class RandomState:
    """The random state every pass starts from, as it was when this was built.

    Torch's global generators (the CPU's, the parameters' CUDA device's) and a
    loader's own (``DataLoader(generator=...)``, its sampler's).
    """

    def __init__(self, params: Iterable[Tensor], data: object = None):
        self._devices = [p.device for p in params if p.device.type == "cuda"][:1]
        self._cpu = torch.get_rng_state()
        self._cuda = [torch.cuda.get_rng_state(d) for d in self._devices]
        self._loader = [(g, g.get_state()) for g in _loader_generators(data)]

    @contextmanager
    def forked(self) -> Iterator[None]:
        """Every generator set to this state, and put back as it was on exit."""
        loader = [(g, g.get_state()) for g, _ in self._loader]
        with torch.random.fork_rng(devices=self._devices):
            torch.set_rng_state(self._cpu)
            for device, state in zip(self._devices, self._cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            for generator, state in self._loader:
                generator.set_state(state)
            try:
                yield
            finally:
                for generator, state in loader:
                    generator.set_state(state)


def _loader_generators(data: object) -> list[torch.Generator]:
    """The generators a loader draws its order from (its own, its samplers')."""
    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    owners = [data, sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]
    found = {}
    for owner in owners:
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            found[id(generator)] = generator
    return list(found.values())


@contextmanager
def engine_context(params: Iterable[Tensor]) -> Iterator[None]:
    """The caller's random state forked (left as it was), gradients on."""
    with RandomState(params).forked(), torch.enable_grad():
        yield


def progress_bar(
    batches: Iterable, total: int | None, progress: bool | None, description: str
) -> Iterable:
    """The batches of a pass, shown as a progress bar on stderr.

    ``progress=None``: after :data:`PROGRESS_DELAY` seconds, on a terminal only
    unless the pass's length is unknown.
    """
    if progress is False:
        return batches
    if total is None:
        description += f" ({UNBOUNDED_NOTE})"
    return tqdm(
        batches,
        total=total,
        desc=description,
        unit="batch",
        disable=None if progress is None and total is not None else False,
        delay=PROGRESS_DELAY if progress is None else 0.0,
        leave=progress is True,
    )


def fingerprint(tensors: Iterable[Tensor]) -> str:
    """A digest of tensors: shapes, types and every byte (BLAKE2b, hexadecimal)."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype};".encode())
        data = tensor.detach().contiguous().cpu().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
