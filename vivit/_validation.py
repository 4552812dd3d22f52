"""Checks on user input shared by every front door, raising :mod:`vivit.errors`."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from vivit.errors import (
    BatchNormTrainingError,
    GradientContextError,
    GroupIndexError,
    InvalidArgumentError,
    InvalidSubsamplingError,
    InvalidTargetsError,
    NonFiniteError,
    RandomForwardWarning,
    UnsupportedDtypeError,
)
from vivit.model_inputs import ModelInputs

#: Floating-point types the computations run in.
SUPPORTED_DTYPES = (torch.float32, torch.float64)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_subsampling(
    subsampling: Sequence[int] | None,
    batch_size: int | None = None,
    name: str = "subsampling",
) -> list[int] | None:
    """Validate sample indices (``None``: all samples) and return them as a list.

    Raises:
        InvalidSubsamplingError: If empty, not integers, repeated, or outside
            ``[0, batch_size)``.
    """
    if subsampling is None:
        return None
    if isinstance(subsampling, Tensor):
        subsampling = subsampling.tolist()
    indices = list(subsampling)
    if not indices:
        raise InvalidSubsamplingError(f"{name} is empty: pass None to use all samples.")
    if not all(_is_int(i) for i in indices):
        raise InvalidSubsamplingError(
            f"{name} must hold integer sample indices, got {indices}."
        )
    if len(set(indices)) != len(indices):
        repeated = sorted({i for i in indices if indices.count(i) > 1})
        raise InvalidSubsamplingError(
            f"{name} repeats the sample indices {repeated}: each sample may occur once."
        )
    outside = [i for i in indices if batch_size is not None and not 0 <= i < batch_size]
    if outside:
        raise InvalidSubsamplingError(
            f"{name} holds indices {outside} outside the mini-batch of "
            f"{batch_size} samples (valid: 0 to {batch_size - 1})."
        )
    return indices


def check_positive_int(
    value: object, name: str, meaning: str = "", none: str | None = None
) -> None:
    """Raise InvalidArgumentError unless ``value`` is a positive int (not a bool).

    ``meaning`` goes into the message; ``none`` says what ``None`` stands for
    (``none=None``: refused).
    """
    if value is None and none is not None:
        return
    if not _is_int(value) or value < 1:
        what = f" ({meaning})" if meaning else ""
        alternative = f" or None ({none})" if none is not None else ""
        raise InvalidArgumentError(
            f"{name} must be a positive integer{what}{alternative}, got {value!r}."
        )


def check_mc_samples(mc_samples: object) -> int:
    """Return ``mc_samples`` (``0``: exact, else ``M``); raise unless an int ``≥ 0``."""
    if not _is_int(mc_samples) or mc_samples < 0:
        raise InvalidArgumentError(
            f"mc_samples must be an integer >= 0, got {mc_samples!r}."
        )
    return mc_samples


def check_damping(damping: object, name: str = "damping") -> None:
    """Raise InvalidArgumentError unless a damping is a number ``≥ 0`` or callable."""
    if not callable(damping) and not (_is_number(damping) and damping >= 0):
        raise InvalidArgumentError(  # NaN fails >= 0
            f"{name} must be a number >= 0 or a callable (evals, gram_evecs, gammas, "
            f"lambdas) -> [K] such as vivit.optim.BootstrapDamping, got {damping!r}."
        )


def check_lr(lr: object, name: str = "lr") -> None:
    """Raise InvalidArgumentError unless ``lr`` is positive and finite (inf: NaN)."""
    if not _is_number(lr) or not 0 < lr < float("inf"):
        raise InvalidArgumentError(
            f"{name} must be a positive finite number, got {lr!r}."
        )


def check_max_decrease(max_decrease: object) -> None:
    """Raise InvalidArgumentError unless ``max_decrease`` is None or a number ≥ 0."""
    if max_decrease is not None and not (
        _is_number(max_decrease) and max_decrease >= 0  # NaN fails >= 0
    ):
        raise InvalidArgumentError(
            "max_decrease must be a number >= 0 (the largest loss decrease the "
            f"quadratic model may predict for the step) or None, got {max_decrease!r}."
        )


def check_group_index(group: object, num_groups: int) -> None:
    """Raise GroupIndexError unless ``group`` indexes one of ``num_groups`` groups."""
    if not _is_int(group) or not 0 <= group < num_groups:
        raise GroupIndexError(
            f"group must be an index in [0, {num_groups}), got {group!r}."
        )


def check_finite(tensor: Tensor, what: str, batch_axis: bool = True) -> None:
    """Refuse a tensor with NaN or infinite entries, naming ``what`` and where.

    ``batch_axis``: the first axis indexes samples, which the message then names.

    Raises:
        InvalidArgumentError: If the tensor is on the meta device (no values).
        NonFiniteError: If an entry is NaN or infinite.
    """
    if tensor.is_meta:
        raise InvalidArgumentError(
            f"The {what} are on the meta device: they have a shape but no values. "
            "Pass tensors with values (vivit.memory.estimate_memory accepts meta "
            "models and inputs)."
        )
    if not tensor.is_floating_point() and not tensor.is_complex():
        return
    values = tensor.detach()
    # a finite sum clears the tensor in one reduction (an overflowing sum takes
    # the entrywise check)
    if bool(torch.isfinite(values.sum())):
        return
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    kinds = [
        k for k, f in (("NaN", torch.isnan), ("inf", torch.isinf)) if f(values).any()
    ]
    if batch_axis and tensor.dim() > 0:
        samples = bad.reshape(tensor.shape[0], -1).any(1).nonzero().flatten().tolist()
        more = f" (and {len(samples) - 5} more)" if len(samples) > 5 else ""
        where = f" at sample(s) {', '.join(map(str, samples[:5]))}{more}"
    else:
        where = f" ({int(bad.sum())} of {tensor.numel()} entries)"
    raise NonFiniteError(
        f"Found {' and '.join(kinds)} in the {what}{where}: the curvature would not "
        "be finite. Remove or fix these values before calling the library."
    )


def check_dtype(tensor: Tensor, what: str) -> None:
    """Raise UnsupportedDtypeError for a floating type not in ``SUPPORTED_DTYPES``."""
    if tensor.is_floating_point() and tensor.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedDtypeError(
            f"Unsupported dtype {tensor.dtype} of the {what}; supported: float32 and "
            "float64. 16-bit types lack the precision and the linear algebra the GGN "
            "needs: compute the curvature on a float32 copy (e.g. "
            "copy.deepcopy(model).float() and inputs.float())."
        )


def check_grad_mode(front_door: str) -> None:
    """Refuse ``torch.inference_mode`` (not ``no_grad``): no backward pass runs.

    Raises:
        GradientContextError: Inside ``torch.inference_mode()``, naming ``front_door``.
    """
    if torch.is_inference_mode_enabled():
        raise GradientContextError(
            f"{front_door} was called inside torch.inference_mode(), where no "
            "backward pass can run: call it outside (torch.no_grad() is fine)."
        )


def check_model(model: object) -> None:
    """Raise InvalidArgumentError unless the model is a ``torch.nn.Module``."""
    if not isinstance(model, Module):
        raise InvalidArgumentError(
            f"model must be a torch.nn.Module, got {type(model).__name__}."
        )


def check_params(
    params: Sequence[Tensor], names: dict[int, str], allow_meta: bool = False
) -> None:
    """Check parameters (``names`` by ``id``) before the forward pass.

    Raises:
        InvalidArgumentError: If a parameter is on the meta device (unless
            ``allow_meta``, for memory estimates).
        GradientContextError: If a parameter was created in inference mode.
        UnsupportedDtypeError: For 16-bit parameters or mixed dtypes.
        NonFiniteError: If a parameter is NaN or infinite (names it).
    """
    for param in params:
        name = names.get(id(param), f"parameter of shape {tuple(param.shape)}")
        if param.is_meta and not allow_meta:
            raise InvalidArgumentError(
                f"The {name} is on the meta device: it has a shape but no values. "
                "Materialize the model first (e.g. model.to_empty(device='cpu'), then "
                "load its weights); vivit.memory.estimate_memory accepts meta models."
            )
        if param.is_inference():
            raise GradientContextError(
                f"The {name} was created inside torch.inference_mode() and cannot "
                "enter a backward pass: create the model outside it."
            )
        check_dtype(param, name)
        if not param.is_meta:
            check_finite(param, name, batch_axis=False)
    dtypes = {param.dtype for param in params}
    if len(dtypes) > 1:
        raise UnsupportedDtypeError(
            f"The parameters have different dtypes {sorted(map(str, dtypes))}: cast "
            "the model to one of float32 or float64 (model.float() or model.double())."
        )


def check_batch(data: object) -> tuple[ModelInputs, Tensor]:
    """Check a mini-batch ``(inputs, targets)`` before the forward pass; return it.

    Raises:
        InvalidArgumentError: If it is not a pair of inputs and a targets tensor,
            or the inputs are malformed (:func:`check_inputs`).
        InvalidTargetsError: If inputs and targets differ in batch size.
        GradientContextError: If a tensor was created in inference mode.
        UnsupportedDtypeError: For 16-bit inputs.
        NonFiniteError: If an input is NaN or infinite (names the samples).
    """
    if (
        not isinstance(data, tuple | list)
        or len(data) != 2
        or not isinstance(data[0], Tensor | Mapping)
        or not isinstance(data[1], Tensor)
    ):
        raise InvalidArgumentError(
            f"data must be a pair (inputs, targets) of tensors (the inputs may be a "
            f"dict of tensors, the model's keyword arguments), got "
            f"{_type_summary(data)}."
        )
    inputs, targets = data
    named = check_inputs(inputs)
    first_name, first = named[0]
    if targets.dim() == 0 or targets.shape[0] != first.shape[0]:
        raise InvalidTargetsError(
            f"{first_name} hold {first.shape[0]} samples (shape "
            f"{tuple(first.shape)}) but targets have shape {tuple(targets.shape)}: "
            "one target per sample is expected along the first axis."
        )
    for name, tensor in (*named, ("targets", targets)):
        if tensor.is_inference():
            raise GradientContextError(
                f"The {name} were created inside torch.inference_mode() and cannot "
                f"enter a backward pass: pass {name}.clone() made outside it."
            )
    for name, tensor in named:
        check_dtype(tensor, name)
        check_finite(tensor, name)
    return inputs, targets


def check_inputs(inputs: object, name: str = "inputs") -> list[tuple[str, Tensor]]:
    """Check a model's inputs, a tensor or a dict of them; return them, named.

    Raises:
        InvalidArgumentError: If they are neither, a dict holds something else
            or its tensors differ in batch size, or there is no sample.
    """
    if not isinstance(inputs, Tensor | Mapping):
        raise InvalidArgumentError(
            f"{name} must be a tensor of input samples, [n, *input_shape], or a "
            "dict of such tensors (the model's keyword arguments), got "
            f"{type(inputs).__name__}."
        )
    _check_input_dict(inputs)
    named = _named_inputs(inputs)
    first_name, first = named[0]
    if first.dim() == 0 or first.shape[0] == 0:
        raise InvalidArgumentError(
            f"The mini-batch is empty ({first_name} of shape {tuple(first.shape)}): "
            "pass at least one sample, the batch along the first axis."
        )
    return named


def _check_input_dict(inputs: ModelInputs) -> None:
    """A dict of inputs: non-empty, string keys, tensors with one batch size."""
    if not isinstance(inputs, Mapping):
        return
    if not inputs or not all(
        isinstance(key, str) and isinstance(value, Tensor)
        for key, value in inputs.items()
    ):
        kinds = {key: type(value).__name__ for key, value in inputs.items()}
        raise InvalidArgumentError(
            "Inputs given as a dict are the model's keyword arguments "
            f"(model(**inputs)) and must map names to tensors, got {kinds}: drop "
            "the entries that are not tensors (e.g. labels or flags) or bind them "
            "to the model with functools.partial."
        )
    sizes = {
        key: value.shape[0] if value.dim() else None for key, value in inputs.items()
    }
    if len(set(sizes.values())) != 1:
        raise InvalidArgumentError(
            f"The tensors of the inputs differ in their first axis, {sizes}: every "
            "input tensor holds the samples along its first axis."
        )


def _named_inputs(inputs: ModelInputs) -> list[tuple[str, Tensor]]:
    """The input tensors with their names for messages."""
    if isinstance(inputs, Mapping):
        return [(f"inputs[{key!r}]", value) for key, value in inputs.items()]
    return [("inputs", inputs)]


def _type_summary(data: object) -> str:
    if isinstance(data, tuple | list):
        inner = ", ".join(type(d).__name__ for d in data)
        return f"a {type(data).__name__} of {len(data)} ({inner})"
    return f"a {type(data).__name__}"


def check_inputs_match(inputs: ModelInputs, params: Sequence[Tensor]) -> None:
    """Raise InvalidArgumentError for floating inputs off the params' dtype, device."""
    if not params:
        return
    param = params[0]
    for name, tensor in _named_inputs(inputs):
        if not tensor.is_floating_point():
            continue
        if tensor.dtype != param.dtype:
            raise InvalidArgumentError(
                f"The {name} have dtype {tensor.dtype}, the parameters "
                f"{param.dtype}: cast them with {name}.to({param.dtype})."
            )
        if tensor.device != param.device:
            raise InvalidArgumentError(
                f"The {name} are on {tensor.device}, the parameters on "
                f"{param.device}: move them with {name}.to('{param.device}')."
            )


def check_batch_norms(model: Module) -> None:
    """:func:`check_batch_norm` for every module, before a forward pass updates them."""
    for name, module in model.named_modules():
        check_batch_norm(module, name or "The model")


def check_batch_norm(module: Module, name: str = "") -> None:
    """Refuse a BatchNorm layer (named ``name``) that uses the batch's statistics.

    In training mode, or without running statistics (torch's rule); other modules
    pass.

    Raises:
        BatchNormTrainingError: For a BatchNorm layer using batch statistics.
    """
    if not isinstance(module, _BatchNorm):
        return
    if module.training:
        problem = "is in training mode"
        remedy = (
            "Call model.eval() before computing curvature (BatchNorm then uses its "
            "running statistics)"
        )
    elif module.running_mean is None and module.running_var is None:
        problem = (
            "has no running statistics (track_running_stats=False), so it "
            "normalizes with the mini-batch's statistics even in eval mode"
        )
        remedy = (
            "Build it with track_running_stats=True, let it gather running statistics "
            "in training mode, and call model.eval() before computing curvature"
        )
    else:
        return
    layer = f"{name} ({module})" if name else str(module)
    raise BatchNormTrainingError(
        f"{layer} {problem}: its output mixes the samples of the mini-batch, so the "
        f"GGN has no per-sample structure. {remedy}, or use a per-sample "
        "normalization (LayerNorm, GroupNorm)."
    )


def warn_random_forward(module: Module) -> None:
    """Warn if a layer the backward pass reached draws random numbers (Dropout)."""
    if isinstance(module, _DropoutNd) and module.training and module.p > 0:
        warnings.warn(
            f"{module} is in training mode: the GGN is that of the network with "
            "the one random mask of this forward pass and differs at every call. "
            "Call model.eval() for the GGN of the deterministic network.",
            RandomForwardWarning,
            stacklevel=2,
        )
