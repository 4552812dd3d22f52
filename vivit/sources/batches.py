"""One block of samples through an engine: data checks, random state, progress.

A block of samples is one mini-batch, a loader's batch or a chunk of either.
:func:`iterate_batches` checks a loader's batches as they come,
:func:`run_block` runs an engine on one block into the group pipeline
(:mod:`vivit.sources.collector`), :func:`engine_context` gives every run the
caller's random state forked (or a fixed start) with gradients enabled, and
:func:`progress_bar` shows a pass over the data. Combining the blocks is
:mod:`vivit.sources.blocks`'s job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice

import torch
from torch import Tensor
from torch.nn import Conv1d, Conv2d, Conv3d, Linear, Module, Parameter
from tqdm.auto import tqdm

from vivit._validation import check_batch, check_finite, check_inputs_match
from vivit.engines.base import ContributionSink, EngineOutput
from vivit.errors import InvalidArgumentError, NoCurvatureError, VivitError
from vivit.sources.collector import GroupCollector, GroupCurvature

#: Seconds a pass over the data runs before its progress bar appears
#: (``progress=None``): quick passes print nothing.
PROGRESS_DELAY = 2.0


#: Why every block of samples needs targets of one shape per sample, and what to do.
SAMPLE_SHAPE_ADVICE = (
    "The loss on all samples together needs one shape per sample in every batch "
    "and shard: each block's mean normalizes over its own positions, so sequences "
    "of another length cannot be combined (docs/math.rst, 'Data sets and "
    "processes'). Pad every batch to one length (with CrossEntropyLoss, padding "
    "targets set to ignore_index), or compute each length on its own."
)


#: What the progress bar of a pass over a loader without ``len`` says.
UNBOUNDED_NOTE = (
    "the loader has no len: the pass reads until it ends; an infinite "
    "IterableDataset never does, pass max_batches"
)

#: Runs an engine on one block of samples into a sink.
BlockRun = Callable[[ContributionSink], EngineOutput]


@dataclass
class BlockResult:
    """What an engine leaves for one block of samples.

    Attributes:
        curvature: Every group's curvature, in group order, factors kept.
        output: The block's loss and gradient (of the loss on the block alone).
    """

    curvature: list[GroupCurvature]
    output: EngineOutput


def is_batch(data: object) -> bool:
    """Whether ``data`` is one mini-batch rather than an iterable of batches.

    Args:
        data: What the caller passed as data.

    Returns:
        ``True`` for a tensor, or a tuple or list with a tensor in it: a
        mini-batch, possibly malformed (:func:`~vivit._validation.check_batch`
        says how). A loader's items are batches, not tensors.
    """
    return isinstance(data, Tensor) or (
        isinstance(data, tuple | list) and any(isinstance(t, Tensor) for t in data)
    )


def iterate_batches(
    data: object, model: Module, max_batches: int | None = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """The batches of a data loader, each checked like a mini-batch.

    Args:
        data: An iterable of ``(inputs, targets)`` batches (e.g. a ``DataLoader``).
        model: The network (its parameters give the expected dtype and device).
        max_batches: Most batches read (``None``: until the loader ends; a
            loader over an infinite ``IterableDataset`` never does).

    Yields:
        ``(inputs, targets)`` of every batch.

    Raises:
        InvalidArgumentError: If ``data`` is neither a mini-batch nor an iterable of
            them, or a batch is malformed (the message names the batch).
    """
    if isinstance(data, Mapping):
        raise InvalidArgumentError(
            "data must be a pair (inputs, targets) of tensors or an iterable of such "
            f"batches (e.g. a DataLoader), {_dict_summary(data)}."
        )
    if isinstance(data, Tensor | str | bytes) or not isinstance(data, Iterable):
        raise InvalidArgumentError(
            "data must be a pair (inputs, targets) of tensors or an iterable of such "
            f"batches (e.g. a DataLoader), got {type(data).__name__}."
        )
    params = list(model.parameters())
    first_shape = None
    for index, batch in enumerate(islice(data, max_batches)):
        with naming_batch(index):
            if isinstance(batch, Mapping):
                raise InvalidArgumentError(
                    "data must be a pair (inputs, targets) of tensors, "
                    f"{_dict_summary(batch)}."
                )
            check_batched(batch, model)
            batch = check_batch(batch)
            check_inputs_match(batch[0], params)
            shape = tuple(batch[1].shape[1:])
            first_shape = shape if first_shape is None else first_shape
            if shape != first_shape:
                raise InvalidArgumentError(
                    f"Its targets have the shape {shape} per sample, those of batch "
                    f"0 {first_shape}. {SAMPLE_SHAPE_ADVICE}"
                )
        yield batch


#: Layers whose unbatched input is recognisable: dimensions of one sample's input.
_SAMPLE_DIMS = {Linear: 1, Conv1d: 2, Conv2d: 3, Conv3d: 4}


def check_batched(batch: object, model: Module) -> None:
    """Refuse inputs that are one unbatched sample of the model's first layer.

    Torch layers accept one sample without a batch axis (``[I]`` for a Linear
    layer, ``[C, H, W]`` for a 2d convolution); the library reads the first axis
    of the inputs as the samples, so such an input would be taken for a batch of
    its first axis's length and fail deep in an engine, or compute the GGN of
    other samples. The first Linear or convolution layer of the model (in the
    order of ``model.modules()``) tells: inputs with one sample's dimensions
    whose first axis is the layer's input features or channels.

    Runs before :func:`~vivit._validation.check_batch`, whose message about the
    targets' batch axis would not name the cause.

    Args:
        batch: A mini-batch ``(inputs, targets)`` (not yet checked).
        model: The network.

    Raises:
        InvalidArgumentError: For an unbatched sample, saying what to pass.
    """
    inputs = batch[0] if isinstance(batch, tuple | list) and batch else None
    if not isinstance(inputs, Tensor) or not inputs.is_floating_point():
        return
    layer = next((m for m in model.modules() if type(m) in _SAMPLE_DIMS), None)
    if layer is None or inputs.dim() != _SAMPLE_DIMS[type(layer)]:
        return
    features = layer.in_features if isinstance(layer, Linear) else layer.in_channels
    if inputs.shape[0] != features:
        return
    raise InvalidArgumentError(
        f"The inputs have shape {tuple(inputs.shape)}: one sample without a batch "
        f"axis for the model's first layer {layer}, whose batched inputs are "
        f"[N, {', '.join(map(str, inputs.shape))}]. The first axis of inputs and "
        "targets holds the samples: stack the samples into one batch "
        "(torch.stack(inputs), torch.stack(targets)), let a DataLoader(dataset, "
        "batch_size=...) do it, or give each sample a batch axis of one "
        "(x.unsqueeze(0), y.unsqueeze(0))."
    )


def _dict_summary(batch: Mapping) -> str:
    """What a batch given as a dict is, and how to pass it instead."""
    if "labels" in batch:  # a Hugging Face collator's batch
        return (
            f"got a dict with keys {list(batch)}, the labels inside as Hugging Face "
            "collators return: take them out with vivit.huggingface.split_labels("
            "loader, shift=True) for a causal language model's labels (shifted to "
            "the next token), shift=False for labels aligned with the logits (a "
            "classifier's), or split_batch(batch, shift=...) for one batch"
        )
    return (
        f"got a dict with keys {list(batch)}: pass (inputs, targets), e.g. "
        "(batch['inputs'], batch['targets']), or give the DataLoader a collate_fn "
        "that returns that pair"
    )


@contextmanager
def naming_batch(index: int) -> Iterator[None]:
    """Prefix the message of a library error with the loader's batch it concerns.

    Args:
        index: Position of the batch in the loader.

    Raises:
        VivitError: The error raised inside, of the same type, its message
            starting with ``"Batch {index} of the data loader: "``. Any other
            exception (e.g. the model's own shape error) is raised as it is, with
            a note naming the batch (Python 3.11 and later).
    """
    try:
        yield
    except VivitError as error:
        raise type(error)(f"Batch {index} of the data loader: {error}") from None
    except Exception as error:
        if hasattr(error, "add_note"):  # Python ≥ 3.11
            error.add_note(f"(in batch {index} of the data loader)")
        raise


def _random_devices(param_groups: list[list[Parameter]]) -> list[torch.device]:
    """The CUDA device of the requested parameters (at most one), else none."""
    params = [p for group in param_groups for p in group]
    return [p.device for p in params if p.device.type == "cuda"][:1]


@dataclass(frozen=True)
class RandomState:
    """The random state that engine runs start from (CPU and a CUDA device).

    Attributes:
        cpu: The CPU generator's state.
        cuda: ``(device, state)`` of the parameters' CUDA device, if any.
    """

    cpu: Tensor
    cuda: tuple[tuple[torch.device, Tensor], ...]

    @classmethod
    def capture(cls, param_groups: list[list[Parameter]]) -> RandomState:
        """The current random state of the devices the parameters live on.

        Args:
            param_groups: The requested parameters (their device).

        Returns:
            The state.
        """
        devices = _random_devices(param_groups)
        cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        """Set the generators to this state."""
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)


@contextmanager
def engine_context(
    param_groups: list[list[Parameter]], start: RandomState | None = None
) -> Iterator[None]:
    """Where engine runs happen: random state forked, gradients enabled.

    The caller's random state (CPU, and the parameters' CUDA device) is left as
    it was, whatever the engines draw; gradients are on even inside
    ``torch.no_grad()``.

    Args:
        param_groups: The requested parameters (their device).
        start: The random state the runs start from (``None``: the caller's):
            passes over the same data then draw the same random numbers (Dropout
            masks) whatever the caller drew in between.
    """
    with torch.random.fork_rng(devices=_random_devices(param_groups)):
        if start is not None:
            start.restore()
        with torch.enable_grad():
            yield


def run_block(
    run: BlockRun,
    param_groups: list[list[Parameter]],
    gram_dtype: torch.dtype | None,
    keep_gradient_factors: bool = True,
) -> BlockResult:
    """One engine run on a block of samples: every group's curvature, loss, gradient.

    Args:
        run: Runs the engine into a sink.
        param_groups: The parameter groups of the request.
        gram_dtype: Type the factors are cast to for every product (``None``: the
            model's).
        keep_gradient_factors: Keep the per-sample-gradient factors (the request
            must compute them).

    Returns:
        The block's result, every group's factors of ``V`` kept.

    Raises:
        NonFiniteError: If the loss is not finite.
        NoCurvatureError: If a group received no curvature.
    """
    curvature: dict[int, GroupCurvature] = {}
    collector = GroupCollector(
        param_groups,
        curvature.__setitem__,
        keep_factors=True,
        keep_gradient_factors=keep_gradient_factors,
        gram_dtype=gram_dtype,
        keep_gram=False,
    )
    output = run(collector)
    check_finite(output.loss, "loss", batch_axis=False)
    missing = [g for g in range(len(param_groups)) if g not in curvature]
    if missing:
        raise NoCurvatureError(
            f"Parameter group(s) {missing} received no curvature from the backward "
            f"pass ({collector.num_missing(missing[0])} parameter(s) of group "
            f"{missing[0]} missing): their layers are not part of the loss's "
            "computation graph, or not extended with backpack.extend."
        )
    return BlockResult([curvature[g] for g in range(len(curvature))], output)


def num_batches(data: object, max_batches: int | None = None) -> int | None:
    """Batches a pass over a loader reads, if known, else ``None``.

    Args:
        data: The loader.
        max_batches: Most batches a pass reads (``None``: all).

    Returns:
        Its ``len`` (at most ``max_batches``), ``max_batches`` for a loader
        without ``len``, or ``None`` if neither is known.
    """
    if not isinstance(data, Sized):
        return max_batches
    try:
        length = len(data)
    except TypeError:  # e.g. a DataLoader over an IterableDataset
        return max_batches
    return length if max_batches is None else min(length, max_batches)


def progress_bar(
    batches: Iterable, total: int | None, progress: bool | None, description: str
) -> Iterable:
    """Show a pass over a loader's batches as a progress bar on stderr.

    Args:
        batches: The batches of the pass.
        total: Number of batches, if known.
        progress: ``True`` always shows the bar, ``False`` never; ``None`` shows it
            only if stderr is a terminal and the pass takes longer than
            :data:`PROGRESS_DELAY` seconds (and removes it when done). A pass of
            unknown length (``total=None``: a loader without ``len`` and no
            ``max_batches``) may never end: under ``None`` its bar appears after
            the delay whether or not stderr is a terminal, and says why
            (:data:`UNBOUNDED_NOTE`).
        description: Text in front of the bar.

    Returns:
        The batches, wrapped in ``tqdm`` unless ``progress`` is ``False``.
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
