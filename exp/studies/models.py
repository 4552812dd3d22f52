"""Models for the studies: the built-in MLP and CNN, user factories, checkpoints.

A study's model maps a batch's inputs (a tensor, or a dict of tensors passed as
keyword arguments) to logits ``[N, C, *T]``. A model with a structured output
(a Hugging Face ``ModelOutput``) gets :class:`OutputField` as a forward hook.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import pickle
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import Parameter

from studies.data import Dataset
from studies.errors import StudyError
from vivit.engines.base import select_output
from vivit.model_inputs import ModelInputs, call_model, input_tensors


def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """A multi-layer perceptron with two hidden layers of 32 ReLU units.

    Args:
        input_shape: Shape of one input sample (flattened by the first layer).
        num_classes: Number of outputs ``C``.

    Returns:
        The model (about 3,500 parameters on the digits).
    """
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, num_classes),
    )


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """A small convolutional network with BatchNorm and max-pooling.

    ``conv(8) → BatchNorm → ReLU → maxpool → conv(16) → ReLU → maxpool → linear``.

    Args:
        input_shape: ``(channels, height, width)`` of one image, height and width
            at least 4.
        num_classes: Number of outputs ``C``.

    Returns:
        The model (about 1,900 parameters on the digits).

    Raises:
        StudyError: If the inputs are not images of at least 4x4 pixels.
    """
    if len(input_shape) != 3 or min(input_shape[1:]) < 4:
        raise StudyError(
            f"--model cnn needs image inputs [channels, height, width] with height "
            f"and width >= 4, but one input has shape {list(input_shape)}; use "
            "--model mlp or your own --model MODULE:FACTORY."
        )
    channels, height, width = input_shape
    features = 16 * (height // 4) * (width // 4)
    return nn.Sequential(
        nn.Conv2d(channels, 8, kernel_size=3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(features, num_classes),
    )


class PreNormTransformer(nn.Module):
    """A pre-norm transformer encoder block classifying sequences by mean pooling.

    ``x + attention(norm(x))``, then ``x + mlp(norm(x))`` (GELU), mean over the
    positions, linear classifier.

    Args:
        features: Features per position.
        num_classes: Number of outputs ``C``.
        heads: Attention heads (must divide ``features``; 1 if it does not).
    """

    def __init__(self, features: int, num_classes: int, heads: int = 2):
        super().__init__()
        heads = heads if features % heads == 0 else 1
        self.norm1 = nn.LayerNorm(features)
        self.attention = nn.MultiheadAttention(features, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(features)
        self.mlp = nn.Sequential(
            nn.Linear(features, 2 * features),
            nn.GELU(),
            nn.Linear(2 * features, features),
        )
        self.head = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


def transformer(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A pre-norm transformer block for sequences ``[T, features]``.

    Args:
        input_shape: ``(positions, features)`` of one input.
        num_classes: Number of outputs ``C``.

    Returns:
        The model.

    Raises:
        StudyError: If the inputs are not sequences of feature vectors.
    """
    if len(input_shape) != 2:
        raise StudyError(
            f"--model transformer needs sequence inputs [positions, features], but "
            f"one input has shape {list(input_shape)}."
        )
    return PreNormTransformer(input_shape[1], num_classes)


class CharLSTM(nn.Module):
    """Embedding → LSTM → per-position classifier; logits ``[N, C, T]``.

    Args:
        vocabulary: Number of tokens (and of classes).
        features: Embedding and hidden size.
    """

    def __init__(self, vocabulary: int, features: int = 16):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, features)
        self.lstm = nn.LSTM(features, features, batch_first=True)
        self.head = nn.Linear(features, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        hidden, _ = self.lstm(self.embedding(x))
        return self.head(hidden).transpose(1, 2)


def char_lstm(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A character-level LSTM for token sequences ``[T]`` and targets ``[N, T]``.

    Args:
        input_shape: ``(positions,)`` of one input.
        num_classes: Number of tokens, which are also the classes.

    Returns:
        The model.

    Raises:
        StudyError: If the inputs are not token sequences.
    """
    if len(input_shape) != 1:
        raise StudyError(
            f"--model char-lstm needs integer token inputs [N, positions], but one "
            f"input has shape {list(input_shape)}."
        )
    return CharLSTM(num_classes)


def takes_tokens(model: nn.Module) -> bool:
    """Whether the model's first layer with parameters is an embedding.

    Args:
        model: The model.

    Returns:
        ``True`` if it expects integer token inputs.
    """
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            return isinstance(module, nn.Embedding)
    return False


BUILTIN: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "char-lstm": char_lstm,
}


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """Resolve ``MODULE:FACTORY`` (module name or ``.py`` path) to the callable.

    Args:
        spec: The ``--model`` value.

    Returns:
        The factory.

    Raises:
        StudyError: If the module or the callable cannot be found.
    """
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise StudyError(
            f"--model {spec!r}: use 'mlp', 'cnn' or 'MODULE:FACTORY' (e.g. "
            "'my_models:make_net' or 'path/to/models.py:make_net')."
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise StudyError(f"--model {spec!r}: no such file {path}.")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.append(str(Path.cwd()))
            module = importlib.import_module(module_name)
    except StudyError:
        raise
    except Exception as error:
        raise StudyError(
            f"--model {spec!r}: importing {module_name} failed: "
            f"{type(error).__name__}: {error}"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise StudyError(
            f"--model {spec!r}: {module_name} has no callable {attribute}."
        )
    return factory


def build_model(spec: str, data: Dataset) -> nn.Module:
    """Create the model of ``--model`` (initialised from torch's global RNG).

    Args:
        spec: ``mlp``, ``cnn`` or ``MODULE:FACTORY``.
        data: The data set (its input shape and classes size the built-in models).

    Returns:
        The model.

    Raises:
        StudyError: If the factory fails or does not return a module.
    """
    if spec in BUILTIN:
        return BUILTIN[spec](data.input_shape, data.num_classes)
    factory = load_factory(spec)
    try:
        model = factory()
    except Exception as error:
        raise StudyError(
            f"--model {spec!r}: calling the factory failed: "
            f"{type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, nn.Module):
        raise StudyError(
            f"--model {spec!r}: the factory returned {type(model).__name__}, not a "
            "torch.nn.Module."
        )
    return model


class OutputField:
    """The forward hook of ``--output-field``: a structured output as logits.

    Hugging Face models return a ``ModelOutput`` whose ``logits`` hold the classes
    on the last axis: ``[N, C]`` for a sequence or image classifier, ``[N, T, C]``
    per token for a language model or token classifier. The hook replaces the
    model's output by the field (:func:`vivit.engines.base.select_output`) with
    its last axis moved to dim 1, where ``CrossEntropyLoss`` wants the classes
    (``[N, C]`` unchanged, ``[N, T, C]`` to ``[N, C, T]`` as
    :func:`vivit.huggingface.token_logits` does). As a hook it leaves the model's
    parameter names and ``state_dict`` as they are.

    Args:
        field: The key or attribute of the logits in the model's output.
    """

    def __init__(self, field: str):
        self.field = field

    def __call__(self, module: nn.Module, args: tuple, output: object) -> torch.Tensor:
        """The selected logits, classes on dim 1.

        Args:
            module: The model.
            args: Its positional inputs.
            output: What it returned.

        Returns:
            The logits ``[N, C, *T]``.
        """
        return select_output(output, self.field).movedim(-1, 1)


def with_output_field(model: nn.Module, spec: str, field: str | None) -> nn.Module:
    """The model of ``--model`` with its logits selected by ``--output-field``.

    Args:
        model: The model (a checkpoint already loaded into it).
        spec: The ``--model`` value.
        field: The ``--output-field`` value, or ``None``.

    Returns:
        The model, with :class:`OutputField` as a forward hook if a field is given.

    Raises:
        StudyError: For a field with a built-in model, which returns its logits.
    """
    if field is None:
        return model
    if spec in BUILTIN:
        raise StudyError(
            f"--output-field {field} selects the logits of a model with a structured "
            f"output (a Hugging Face model), but the built-in --model {spec} returns "
            "its logits: drop --output-field."
        )
    model.register_forward_hook(OutputField(field))
    return model


def load_checkpoint(model: nn.Module, path: Path, spec: str) -> None:
    """Load a ``state_dict`` into the model, explaining any mismatch.

    Args:
        model: The model of ``--model``.
        path: The checkpoint file.
        spec: The ``--model`` value, for messages.

    Raises:
        StudyError: If the file is missing, not a state_dict, or does not match.
    """
    if not path.is_file():
        raise StudyError(f"--checkpoint {path}: no such file.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # weights_only refuses pickled classes: a whole model, an optimizer, ...
        pickled = re.search(r"GLOBAL ([\w.]+)", str(error))
        if pickled:
            raise StudyError(
                f"--checkpoint {path} holds a pickled {pickled.group(1)} (a whole "
                "model saved with torch.save(model)?), not a state_dict: save "
                "`model.state_dict()` instead, torch.save(model.state_dict(), FILE), "
                "and pass that file."
            ) from None
        raise StudyError(
            f"--checkpoint {path} is damaged or not a PyTorch checkpoint; save one "
            "with torch.save(model.state_dict(), FILE)."
        ) from None
    except Exception as error:
        raise StudyError(
            f"--checkpoint {path} cannot be read with torch.load: "
            f"{plain_text(str(error))}"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(
        isinstance(value, torch.Tensor) for value in state.values()
    ):
        raise StudyError(
            f"--checkpoint {path} is not a state_dict; save one with "
            "torch.save(model.state_dict(), FILE)."
        )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        details = str(error).replace("\n\t", "\n  ").strip()
        raise StudyError(
            f"--checkpoint {path} does not match --model {spec}: {details}\nPass the "
            "--model (and --data, which sets the built-in models' input and output "
            "sizes) the checkpoint was trained with."
        ) from None


def plain_text(message: str) -> str:
    """A message without terminal escape codes (colours, bold) and spare lines.

    Args:
        message: The message.

    Returns:
        The cleaned message.
    """
    return re.sub(r"\x1b\[[0-9;]*m", "", message).strip()


def _shapes(inputs: ModelInputs) -> str:
    """The per-sample shapes of the inputs, for messages."""
    if isinstance(inputs, torch.Tensor):
        return f"inputs of shape {list(inputs.shape[1:])} per sample"
    shapes = ", ".join(
        f"{key} {list(value.shape[1:])}" for key, value in inputs.items()
    )
    return f"keyword inputs ({shapes} per sample)"


def check_model_fits(
    model: nn.Module,
    sample: ModelInputs,
    num_classes: int,
    positions: tuple[int, ...] = (),
) -> int:
    """Check that the model maps the inputs to logits that fit the labels.

    Args:
        model: The model (on the device of ``sample``).
        sample: A few inputs ``[n, *shape]``, or a dict of them.
        num_classes: Largest label + 1.
        positions: Shape ``T`` of the per-position targets ``[N, *T]`` (``()``
            for one label per sample).

    Returns:
        The number of model outputs ``C``.

    Raises:
        StudyError: If the forward pass fails or the output has the wrong shape.
    """
    was_training = model.training
    model.eval()
    count = input_tensors(sample)[0].shape[0]
    try:
        with torch.no_grad():
            output = call_model(model, sample)
    except Exception as error:
        raise StudyError(
            f"The model cannot process {_shapes(sample)}: {type(error).__name__}: "
            f"{error}. Check --data against --model (and --output-field)."
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(output, torch.Tensor):
        raise StudyError(
            f"The model returns {type(output).__name__}, not a tensor of logits: "
            "name the field of its output that holds the logits with --output-field "
            "(e.g. --output-field logits for a Hugging Face model)."
        )
    if output.shape[:1] != (count,):
        raise StudyError(
            "The model must return one row of logits per sample, [N, C]; got "
            f"{list(output.shape)} for N={count}."
        )
    if tuple(output.shape[2:]) != tuple(positions) or output.ndim < 2:
        expected = "[N, C" + "".join(f", {t}" for t in positions) + "]"
        raise StudyError(
            f"The model must return logits of shape {expected} for targets of shape "
            f"[N{''.join(f', {t}' for t in positions)}], got {list(output.shape)}."
        )
    num_outputs = output.shape[1]
    if num_classes > num_outputs:
        raise StudyError(
            f"The labels go up to {num_classes - 1}, but the model has only "
            f"{num_outputs} outputs: labels must be class indices in [0, "
            f"{num_outputs})."
        )
    return num_outputs


def layer_groups(model: nn.Module) -> list[tuple[str, list[Parameter]]]:
    """The trainable parameters, grouped by the layer that owns them.

    Args:
        model: The model.

    Returns:
        ``("name (Type)", parameters)`` pairs in the order of ``model.modules()``;
        a parameter shared by several layers (tied weights, e.g. an embedding and
        the output layer) belongs to the first of them, so that every parameter
        is in one group.
    """
    groups = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        params = [
            p
            for p in module.parameters(recurse=False)
            if p.requires_grad and id(p) not in seen
        ]
        seen.update(id(p) for p in params)
        if params:
            kind = type(module).__name__
            groups.append((f"{name} ({kind})" if name else kind, params))
    return groups


def trainable_parameters(model: nn.Module) -> list[Parameter]:
    """The trainable parameters in ``model.parameters()`` order.

    Args:
        model: The model.

    Returns:
        The parameters that require gradients.
    """
    return [p for p in model.parameters() if p.requires_grad]


def has_batchnorm(model: nn.Module) -> bool:
    """Whether the model has BatchNorm layers (whose train mode couples samples).

    Args:
        model: The model.

    Returns:
        ``True`` if it has one.
    """
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def describe(model: nn.Module, spec: str) -> dict:
    """Facts about the model for ``results.json``.

    Args:
        model: The model.
        spec: The ``--model`` value.

    Returns:
        Name, parameter count, layers with parameters, BatchNorm presence.
    """
    return {
        "name": spec,
        "num_parameters": sum(p.numel() for p in trainable_parameters(model)),
        "layers": [
            {"name": name, "num_parameters": sum(p.numel() for p in params)}
            for name, params in layer_groups(model)
        ],
        "batchnorm": has_batchnorm(model),
    }
