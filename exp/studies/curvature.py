"""vivit calls of the studies: errors explained, eigenvectors compared."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from backpack import extend
from torch import Tensor, nn
from torch.nn import Parameter

from studies.errors import StudyError
from vivit import (
    BatchNormTrainingError,
    GramTooLargeError,
    LowRankGGN,
    SampleCouplingError,
    UnsupportedLayerError,
)
from vivit.model_inputs import ModelInputs, take_samples


def loss_function() -> nn.Module:
    """The studies' loss: mean-reduced cross-entropy, extended for BackPACK.

    Returns:
        ``backpack.extend(nn.CrossEntropyLoss())``.
    """
    return extend(nn.CrossEntropyLoss())


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Evaluation mode inside, the previous mode afterwards.

    BatchNorm must use its running statistics while curvature is computed: in
    training mode it couples the samples and the GGN has no per-sample structure.

    Args:
        model: The model.

    Yields:
        Nothing.
    """
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextmanager
def engine_errors(what: str) -> Iterator[None]:
    """Translate vivit's and BackPACK's errors into explanations for the CLI.

    Args:
        what: What was being computed, for the message.

    Yields:
        Nothing.

    Raises:
        StudyError: For a model or setting the engine cannot handle.
    """
    try:
        yield
    except UnsupportedLayerError as error:
        raise StudyError(
            f"{what}: the model contains a layer vivit's engine cannot handle "
            f"(--engine func handles any model with independent samples).\n{error}"
        ) from None
    except (BatchNormTrainingError, SampleCouplingError) as error:
        raise StudyError(f"{what}: {error}") from None
    except GramTooLargeError as error:
        raise StudyError(
            f"{what}: {error} In the studies: lower --batch-size (or use the "
            "Monte-Carlo approximation)."
        ) from None
    except torch.linalg.LinAlgError as error:
        raise StudyError(
            f"{what}: the eigendecomposition of the Gram matrix failed ({error}). "
            "This happens for degenerate curvature (e.g. a diverged model with dead "
            "ReLUs or a saturated softmax); --dtype float64 is more robust."
        ) from None


def low_rank_ggn(
    model: nn.Module,
    loss_func: nn.Module,
    data: tuple[ModelInputs, Tensor] | Iterable[tuple[ModelInputs, Tensor]],
    what: str = "Computing the GGN",
    engine: str = "auto",
    **kwargs,
) -> LowRankGGN:
    """``LowRankGGN`` of a mini-batch or a data loader, model in evaluation mode.

    Args:
        model: The model (extended in place if it is not yet).
        loss_func: The extended loss function.
        data: ``(inputs, targets)`` of a mini-batch, or an iterable of such
            batches (the GGN of all their samples together).
        what: What is computed, for error messages.
        engine: ``--engine``.
        **kwargs: Passed to :class:`vivit.LowRankGGN` (``mc_samples``,
            ``subsampling``, ``param_groups``, ``generator``).

    Returns:
        The low-rank GGN.
    """
    with eval_mode(model), engine_errors(what):
        return LowRankGGN(model, loss_func, data, engine=engine, **kwargs)


def check_supported(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: ModelInputs,
    targets: Tensor,
    engine: str = "auto",
) -> None:
    """Fail early if vivit cannot compute the model's curvature.

    Runs the whole pipeline (Gram matrix, eigenpairs, directional derivatives) on a
    copy of the model and two samples, before any training.

    Args:
        model: The model.
        loss_func: The extended loss function.
        inputs: At least two inputs (a tensor or a dict of tensors).
        targets: Their labels.
        engine: ``--engine``.

    Raises:
        StudyError: If the engine cannot handle the model.
    """
    probe = copy.deepcopy(model)
    what = "Checking that vivit supports the model"
    batch = (take_samples(inputs, slice(0, 2)), targets[:2])
    ggn = low_rank_ggn(probe, loss_func, batch, what, engine)
    with engine_errors(what):
        ggn.eigvalsh()
        ggn.directional_derivatives(top_k=1)


def embed(
    evecs: Sequence[Tensor], group: Sequence[Parameter], params: Sequence[Parameter]
) -> Tensor:
    """Eigenvectors of a parameter group as vectors over all parameters.

    Args:
        evecs: One ``[K, *p.shape]`` tensor per parameter of ``group``.
        group: The group's parameters.
        params: All parameters, in the order of the flattened vector.

    Returns:
        ``[K, D]`` with zeros outside the group (float64, on the CPU).
    """
    num = evecs[0].shape[0] if evecs else 0
    by_param = {id(p): e for p, e in zip(group, evecs, strict=True)}
    blocks = [
        by_param[id(p)].detach().reshape(num, -1).double().cpu()
        if id(p) in by_param
        else torch.zeros(num, p.numel(), dtype=torch.float64)
        for p in params
    ]
    return torch.cat(blocks, dim=1)


def subspace_overlap(exact: Tensor, approx: Tensor) -> float:
    """Overlap ``‖Q Pᵀ‖_F² / k`` of two sets of orthonormal vectors (rows).

    ``1`` if the approximation spans the exact top-``k`` eigenspace, ``0`` if it is
    orthogonal to it; ``k`` is the number of exact vectors.

    Args:
        exact: ``[k, D]`` orthonormal rows.
        approx: ``[k', D]`` orthonormal rows.

    Returns:
        The overlap in ``[0, 1]``.
    """
    if exact.shape[0] == 0:
        return float("nan")
    return float((exact @ approx.T).pow(2).sum() / exact.shape[0])


def relative_errors(exact: Sequence[float], approx: Sequence[float]) -> list[float]:
    """``|λ̂_i − λ_i| / λ_i`` rank by rank (both sorted descending).

    Args:
        exact: Exact eigenvalues, descending.
        approx: Approximate eigenvalues, descending.

    Returns:
        One error per exact eigenvalue; ``nan`` where the approximation has fewer.
    """
    return [
        abs(approx[i] - value) / value if i < len(approx) else float("nan")
        for i, value in enumerate(exact)
    ]


def descending(values: Tensor) -> list[float]:
    """Eigenvalues as a descending list of floats.

    Args:
        values: Eigenvalues in any order.

    Returns:
        The sorted values.
    """
    return sorted(values.detach().cpu().double().tolist(), reverse=True)
