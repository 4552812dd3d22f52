"""Training and evaluation loops of the studies."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from tqdm.auto import tqdm

from studies.curvature import eval_mode
from studies.data import BatchStream, Dataset
from studies.errors import StudyError
from vivit.huggingface import IGNORE_INDEX
from vivit.model_inputs import ModelInputs, call_model, take_samples


def accuracy(logits: Tensor, targets: Tensor) -> float:
    """Fraction of correctly classified targets, ignored ones left out.

    Args:
        logits: ``[N, C]`` or ``[N, C, *T]`` model outputs.
        targets: ``[N]`` or ``[N, *T]`` labels; those equal to
            :data:`~vivit.huggingface.IGNORE_INDEX` do not count.

    Returns:
        The accuracy in ``[0, 1]`` (``nan`` if every target is ignored).
    """
    counted = targets != IGNORE_INDEX
    return float((logits.argmax(1) == targets)[counted].double().mean())


def evaluate(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: ModelInputs,
    targets: Tensor,
    chunk_size: int = 2048,
) -> tuple[float, float]:
    """Mean loss and accuracy on a data set, in evaluation mode.

    Both are means over the counted targets (those not equal to
    :data:`~vivit.huggingface.IGNORE_INDEX`), as the loss's mean reduction.

    Args:
        model: The model.
        loss_func: Mean-reduced loss function.
        inputs: ``[N, *shape]`` inputs, or a dict of them.
        targets: ``[N]`` or ``[N, *T]`` labels.
        chunk_size: Samples per forward pass.

    Returns:
        Loss and accuracy.
    """
    total_loss, correct, total = 0.0, 0.0, 0
    with eval_mode(model), torch.no_grad():
        for start in range(0, len(targets), chunk_size):
            chunk = slice(start, start + chunk_size)
            y = targets[chunk]
            counted = int((y != IGNORE_INDEX).sum())
            if not counted:
                continue
            logits = call_model(model, take_samples(inputs, chunk))
            total_loss += float(loss_func(logits, y)) * counted
            correct += accuracy(logits, y) * counted
            total += counted
    if not total:
        raise StudyError(
            f"Every one of the {len(targets)} targets to evaluate is {IGNORE_INDEX} "
            "(ignored): there is nothing to measure the loss and accuracy on. Give "
            "samples with counted targets (e.g. sequences longer than their padding)."
        )
    return total_loss / total, correct / total


def evaluate_splits(model: nn.Module, loss_func: nn.Module, data: Dataset) -> dict:
    """Loss and accuracy on the training and the test set.

    Args:
        model: The model.
        loss_func: Mean-reduced loss function.
        data: The data set.

    Returns:
        ``train_loss``, ``train_accuracy``, ``test_loss``, ``test_accuracy``.
    """
    train_loss, train_acc = evaluate(
        model, loss_func, data.train_inputs, data.train_targets
    )
    test_loss, test_acc = evaluate(
        model, loss_func, data.test_inputs, data.test_targets
    )
    return {
        "train_loss": train_loss,
        "train_accuracy": train_acc,
        "test_loss": test_loss,
        "test_accuracy": test_acc,
    }


def gradient_step(
    model: nn.Module,
    optimizer: Optimizer,
    loss_func: nn.Module,
    inputs: ModelInputs,
    targets: Tensor,
) -> tuple[float, float]:
    """One step of a first-order optimizer in training mode.

    Args:
        model: The model.
        optimizer: E.g. SGD or Adam over the model's parameters.
        loss_func: Mean-reduced loss function.
        inputs: Mini-batch inputs.
        targets: Mini-batch labels.

    Returns:
        The mini-batch loss and accuracy before the step.
    """
    model.train()
    optimizer.zero_grad()
    logits = call_model(model, inputs)
    loss = loss_func(logits, targets)
    loss.backward()
    optimizer.step()
    return float(loss.detach()), accuracy(logits.detach(), targets)


def refresh_batchnorm(model: nn.Module, inputs: ModelInputs) -> None:
    """Update BatchNorm running statistics on a mini-batch, without gradients.

    Second-order steps need the model in evaluation mode; this forward pass in
    training mode keeps the running statistics current as SGD training would.

    Args:
        model: The model.
        inputs: Mini-batch inputs.
    """
    was_training = model.training
    model.train()
    with torch.no_grad():
        call_model(model, inputs)
    model.train(was_training)


def train_sgd(
    model: nn.Module,
    loss_func: nn.Module,
    data: Dataset,
    batches: BatchStream,
    steps: int,
    lr: float,
    momentum: float,
    progress: bool,
    description: str = "SGD",
) -> list[float]:
    """Train with SGD (momentum) for a number of steps.

    Args:
        model: The model.
        loss_func: Mean-reduced loss function.
        data: Training data.
        batches: Source of mini-batch indices.
        steps: Number of steps.
        lr: Learning rate.
        momentum: Momentum.
        progress: Show a progress bar.
        description: Label of the progress bar.

    Returns:
        The mini-batch loss of every step.

    Raises:
        StudyError: If the loss is not finite (training diverged).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for step in tqdm(range(steps), desc=description, disable=not progress):
        index = batches.next()
        inputs, targets = data.train_batch(index)
        loss, _ = gradient_step(model, optimizer, loss_func, inputs, targets)
        if not math.isfinite(loss):
            raise StudyError(
                f"SGD training diverged at step {step} (loss {loss}); lower --lr."
            )
        losses.append(loss)
    return losses
