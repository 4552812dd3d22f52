"""Checks on user input shared by every front door.

Each check raises one of the exceptions of :mod:`vivit.errors` with a message that
says what was given and what is expected.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor
from torch.nn import Module, Parameter
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
    ParamGroupError,
    RandomForwardWarning,
    UnsupportedDtypeError,
)
from vivit.model_inputs import ModelInputs

#: Floating-point types the computations run in.
SUPPORTED_DTYPES = (torch.float32, torch.float64)


def check_subsampling(
    subsampling: Sequence[int] | None,
    batch_size: int | None = None,
    name: str = "subsampling",
) -> list[int] | None:
    """Validate sample indices and return them as a list of ints.

    Args:
        subsampling: Sample indices, or ``None`` for all samples.
        batch_size: If known, the mini-batch size the indices must lie below.
        name: Argument name used in error messages.

    Returns:
        The indices as a list, or ``None``.

    Raises:
        InvalidSubsamplingError: If the indices are empty, not integers, repeated,
            or outside ``[0, batch_size)``.
    """
    if subsampling is None:
        return None
    if isinstance(subsampling, Tensor):
        subsampling = subsampling.tolist()
    indices = list(subsampling)
    if not indices:
        raise InvalidSubsamplingError(f"{name} is empty: pass None to use all samples.")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise InvalidSubsamplingError(
            f"{name} must hold integer sample indices, got {indices}."
        )
    if len(set(indices)) != len(indices):
        repeated = sorted({i for i in indices if indices.count(i) > 1})
        raise InvalidSubsamplingError(
            f"{name} repeats the sample indices {repeated}: each sample may occur once."
        )
    if batch_size is not None:
        outside = [i for i in indices if not 0 <= i < batch_size]
        if outside:
            raise InvalidSubsamplingError(
                f"{name} holds indices {outside} outside the mini-batch of "
                f"{batch_size} samples (valid: 0 to {batch_size - 1})."
            )
    return indices


def check_chunk_size(chunk_size: int | None) -> None:
    """Check that ``chunk_size`` is a positive integer or ``None``.

    Args:
        chunk_size: Most samples per backward pass (``None``: the whole batch).

    Raises:
        InvalidArgumentError: Otherwise.
    """
    check_positive_int(
        chunk_size, "chunk_size", "samples per backward pass", "the whole batch"
    )


def check_positive_int(
    value: object, name: str, meaning: str = "", none: str | None = None
) -> None:
    """Check that ``value`` is a positive ``int`` (not a bool), or ``None``.

    Args:
        value: The argument.
        name: Its name in the message.
        meaning: What it counts, for the message.
        none: What ``None`` stands for; ``None`` refuses ``None``.

    Raises:
        InvalidArgumentError: Otherwise.
    """
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = f" ({meaning})" if meaning else ""
        alternative = f" or None ({none})" if none is not None else ""
        raise InvalidArgumentError(
            f"{name} must be a positive integer{what}{alternative}, got {value!r}."
        )


def check_mc_samples(mc_samples: object) -> int:
    """Check the number of Monte-Carlo samples of the loss Hessian.

    Args:
        mc_samples: ``0`` for the exact loss Hessian, else ``M``.

    Returns:
        The number, unchanged.

    Raises:
        InvalidArgumentError: If it is not an integer ``>= 0``.
    """
    if (
        isinstance(mc_samples, bool)
        or not isinstance(mc_samples, int)
        or mc_samples < 0
    ):
        raise InvalidArgumentError(
            f"mc_samples must be an integer >= 0, got {mc_samples!r}."
        )
    return mc_samples


#: What one Monte-Carlo draw of a cross-entropy output ``[N, C, *T]`` covers.
MC_PER = ("token", "sequence")


def check_mc_per(mc_per: object) -> str:
    """Check what a Monte-Carlo draw covers: a position or a whole sample.

    Args:
        mc_per: ``"token"`` or ``"sequence"``.

    Returns:
        The value, unchanged.

    Raises:
        InvalidArgumentError: If it is neither.
    """
    if not isinstance(mc_per, str) or mc_per not in MC_PER:
        raise InvalidArgumentError(
            f"mc_per must be one of {MC_PER}, got {mc_per!r}: 'token' draws one "
            "column per position of a sequence (N·M·T Gram rows), 'sequence' one "
            "per sample (N·M)."
        )
    return mc_per


def check_param_groups(
    param_groups: Iterable[dict], required_keys: Sequence[str]
) -> None:
    """Check that groups carry the required keys and share no parameter.

    Args:
        param_groups: Groups as dictionaries, each with a ``"params"`` list.
        required_keys: Keys every group must specify.

    Raises:
        ParamGroupError: If a key is missing, a group is empty, or a parameter
            occurs in more than one group.
    """
    if isinstance(param_groups, dict | Tensor) or not isinstance(
        param_groups, Sequence
    ):
        raise ParamGroupError(
            f"param_groups must be a list of dicts, got {type(param_groups).__name__}"
            ": pass e.g. [{'params': list(model.parameters()), ...}]."
        )
    if not param_groups:
        raise ParamGroupError(
            "param_groups is empty: pass at least one group, e.g. "
            "[{'params': list(model.parameters()), ...}]."
        )
    seen: set[int] = set()
    for index, group in enumerate(param_groups):
        if not isinstance(group, dict):
            raise ParamGroupError(
                f"Group {index} is a {type(group).__name__}, expected a dict with "
                "the key 'params' (as torch.optim's param_groups)."
            )
        missing = [key for key in required_keys if key not in group]
        if missing:
            raise ParamGroupError(f"Group {index} does not specify {missing}.")
        if "criterion" in required_keys and not callable(group["criterion"]):
            raise ParamGroupError(
                f"The 'criterion' of group {index} is a "
                f"{type(group['criterion']).__name__}, expected a function "
                "evals -> indices of the eigenvalues to keep."
            )
        if not isinstance(group["params"], Sequence | Tensor):
            raise ParamGroupError(
                f"The 'params' of group {index} are a {type(group['params']).__name__}"
                ", which can be read only once: pass a list, e.g. "
                "list(model.parameters())."
            )
        params = _group_params(group["params"], index)
        for param in params:
            if id(param) in seen:
                raise ParamGroupError(
                    f"A parameter of shape {tuple(param.shape)} occurs in more than "
                    "one "
                    "group (found again in group "
                    f"{index}): each parameter may belong to one group only."
                )
            check_dtype(param, f"parameter of shape {tuple(param.shape)}")
            if not param.requires_grad:
                raise ParamGroupError(
                    f"Group {index} holds a parameter of shape {tuple(param.shape)} "
                    "that does not require gradients: the backward pass gives it "
                    "no curvature."
                )
            seen.add(id(param))


def check_damping(damping: object, name: str = "damping") -> None:
    """Check that a damping is a number ``≥ 0`` or a callable rule.

    Args:
        damping: The damping.
        name: Argument name used in error messages.

    Raises:
        InvalidArgumentError: If it is neither.
    """
    if callable(damping):
        return
    if (
        isinstance(damping, int | float)
        and not isinstance(damping, bool)
        and damping >= 0
        and damping == damping  # not NaN
    ):
        return
    raise InvalidArgumentError(
        f"{name} must be a number >= 0 or a callable (evals, gram_evecs, gammas, "
        f"lambdas) -> [K] such as vivit.optim.BootstrapDamping, got {damping!r}."
    )


def check_lr(lr: object, name: str = "lr") -> None:
    """Check that a step's scale is a positive finite number.

    Args:
        lr: The scale of the step.
        name: Argument name used in error messages.

    Raises:
        InvalidArgumentError: If it is not (an infinite ``lr`` makes the step NaN).
    """
    if (
        isinstance(lr, bool)
        or not isinstance(lr, int | float)
        or not 0 < lr < float("inf")
    ):
        raise InvalidArgumentError(
            f"{name} must be a positive finite number, got {lr!r}."
        )


def check_max_decrease(max_decrease: object) -> None:
    """Check a bound on a step's predicted loss decrease: ``None`` or a number ``≥ 0``.

    Args:
        max_decrease: The largest decrease of the loss the quadratic model may
            predict (``inf``: no bound, as ``None``).

    Raises:
        InvalidArgumentError: If it is neither (NaN, negative, not a number).
    """
    if max_decrease is None:
        return
    if (
        isinstance(max_decrease, bool)
        or not isinstance(max_decrease, int | float)
        or not max_decrease >= 0  # also refuses NaN
    ):
        raise InvalidArgumentError(
            "max_decrease must be a number >= 0 (the largest loss decrease the "
            f"quadratic model may predict for the step) or None, got {max_decrease!r}."
        )


def check_finite(tensor: Tensor, what: str, batch_axis: bool = True) -> None:
    """Refuse a tensor with NaN or infinite entries, naming where they are.

    Args:
        tensor: The tensor to check (integer tensors are always finite).
        what: What the tensor is, for the message (``"inputs"``, a parameter name).
        batch_axis: Whether the first axis indexes samples (the message then names
            the first sample with a non-finite entry).

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
    # a non-finite entry makes the sum non-finite: a finite sum clears the tensor
    # in one reduction (an overflowing sum takes the entrywise check)
    if bool(torch.isfinite(tensor.detach().sum())):
        return
    finite = torch.isfinite(tensor.detach())
    if bool(finite.all()):
        return
    bad = ~finite
    kinds = []
    if bool(torch.isnan(tensor.detach()).any()):
        kinds.append("NaN")
    if bool(torch.isinf(tensor.detach()).any()):
        kinds.append("inf")
    where = ""
    if batch_axis and tensor.dim() > 0:
        samples = bad.reshape(tensor.shape[0], -1).any(1).nonzero().flatten().tolist()
        shown = ", ".join(str(n) for n in samples[:5])
        more = f" (and {len(samples) - 5} more)" if len(samples) > 5 else ""
        where = f" at sample(s) {shown}{more}"
    else:
        where = f" ({int(bad.sum())} of {tensor.numel()} entries)"
    raise NonFiniteError(
        f"Found {' and '.join(kinds)} in the {what}{where}: the curvature would not "
        "be finite. Remove or fix these values before calling the library."
    )


def _group_params(params: object, index: int) -> list[Tensor]:
    """A group's parameters as a list, refusing what is not a list of parameters."""
    if isinstance(params, Tensor):
        raise ParamGroupError(
            f"Group {index} is a single tensor of shape {tuple(params.shape)}, "
            "expected a list of parameters: wrap it as [param]."
        )
    if isinstance(params, str | bytes | dict) or not isinstance(params, Iterable):
        raise ParamGroupError(
            f"Group {index} is a {type(params).__name__}, expected a list of "
            "parameters (torch.nn.Parameter)."
        )
    params = list(params)
    if not params:
        raise ParamGroupError(f"Group {index} has no parameters.")
    for param in params:
        if not isinstance(param, Tensor):
            raise ParamGroupError(
                f"Group {index} holds a {type(param).__name__} ({param!r:.40}), "
                "expected parameters (torch.nn.Parameter)."
            )
        if not param.is_leaf:
            raise ParamGroupError(
                f"Group {index} holds a tensor of shape {tuple(param.shape)} that "
                "is computed from other tensors, not a parameter: pass the model's "
                "parameters (e.g. list(model.parameters()))."
            )
    return params


def param_group_lists(
    param_groups: object, model: Module | None = None
) -> list[list[Parameter]]:
    """Validate ``param_groups`` given as lists of parameters and return them.

    Args:
        param_groups: A list of lists of parameters, or ``None``.
        model: The model the parameters must belong to, if known; ``None`` groups
            then mean one group of all its trainable parameters.

    Returns:
        The groups as lists.

    Raises:
        ParamGroupError: If ``param_groups`` is empty, a flat list of parameters,
            a list of dicts, holds something that is not a parameter, a parameter
            of another model, a frozen parameter, or one parameter twice.
    """
    if param_groups is None:
        if model is None:
            raise ParamGroupError("param_groups is required: pass [[param, ...]].")
        param_groups = [[p for p in model.parameters() if p.requires_grad]]
        if not param_groups[0]:
            raise ParamGroupError(
                "The model has no parameter that requires gradients: there is no "
                "curvature to compute."
            )
    if isinstance(param_groups, Tensor | dict | str) or not isinstance(
        param_groups, Iterable
    ):
        raise ParamGroupError(
            f"param_groups must be a list of lists of parameters, got "
            f"{type(param_groups).__name__}: e.g. [list(model.parameters())]."
        )
    groups = list(param_groups)
    if not groups:
        raise ParamGroupError(
            "param_groups is empty: pass None for one group of all trainable "
            "parameters, or a list of lists of parameters."
        )
    if any(isinstance(g, Tensor) for g in groups):
        raise ParamGroupError(
            "param_groups is a flat list of parameters, expected a list of lists "
            "(one list per GGN block): wrap it as [params] for one group."
        )
    if any(isinstance(g, dict) for g in groups):
        raise ParamGroupError(
            "param_groups holds dicts (torch.optim style), expected a list of lists "
            "of parameters: pass [group['params'] for group in param_groups]."
        )
    groups = [_group_params(group, index) for index, group in enumerate(groups)]
    check_param_groups([{"params": g} for g in groups], ("params",))
    if model is not None:
        owned = {id(p) for p in model.parameters()}
        for index, group in enumerate(groups):
            for param in group:
                if id(param) not in owned:
                    raise ParamGroupError(
                        f"Group {index} holds a parameter of shape "
                        f"{tuple(param.shape)} that is not a parameter of the model."
                    )
    return groups


def check_dtype(tensor: Tensor, what: str) -> None:
    """Refuse floating-point types the computations do not support.

    Args:
        tensor: A floating-point tensor (others pass).
        what: What the tensor is, for the message.

    Raises:
        UnsupportedDtypeError: For 16-bit (or other unsupported) floating types.
    """
    if tensor.is_floating_point() and tensor.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedDtypeError(
            f"Unsupported dtype {tensor.dtype} of the {what}; supported: float32 and "
            "float64. "
            "16-bit types lack the precision and the linear algebra the GGN "
            "needs: compute the curvature on a float32 copy (e.g. "
            "copy.deepcopy(model).float() and inputs.float())."
        )


def check_grad_mode(front_door: str) -> None:
    """Refuse ``torch.inference_mode``, in which no backward pass can run.

    ``torch.no_grad()`` is fine: the library enables gradients for its own
    forward and backward pass.

    Args:
        front_door: Name of the calling function, for the message.

    Raises:
        GradientContextError: Inside ``torch.inference_mode()``.
    """
    if torch.is_inference_mode_enabled():
        raise GradientContextError(
            f"{front_door} was called inside torch.inference_mode(), where no "
            "backward pass can run: call it outside (torch.no_grad() is fine)."
        )


def check_batch(data: object) -> tuple[ModelInputs, Tensor]:
    """Check a mini-batch ``(inputs, targets)`` before the forward pass.

    Args:
        data: The mini-batch; its inputs a tensor or a dict of tensors, the
            model's keyword arguments (:mod:`vivit.model_inputs`).

    Returns:
        ``inputs, targets``.

    Raises:
        InvalidArgumentError: If it is not a pair of inputs and a targets tensor,
            a dict of inputs holds something other than tensors or its tensors
            differ in batch size, or the batch is empty.
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
    _check_input_dict(inputs)
    named = _named_inputs(inputs)
    first_name, first = named[0]
    if first.dim() == 0 or first.shape[0] == 0:
        raise InvalidArgumentError(
            f"The mini-batch is empty ({first_name} of shape {tuple(first.shape)}): "
            "pass at least one sample, the batch along the first axis."
        )
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


def check_model(model: object) -> None:
    """Check that the model is a ``torch.nn.Module``.

    Args:
        model: The model.

    Raises:
        InvalidArgumentError: If it is not a module.
    """
    if not isinstance(model, Module):
        raise InvalidArgumentError(
            f"model must be a torch.nn.Module, got {type(model).__name__}."
        )


def check_params(
    params: Sequence[Tensor], names: dict[int, str], allow_meta: bool = False
) -> None:
    """Check parameters before the forward pass: one dtype, supported, finite.

    Args:
        params: The parameters whose curvature is computed.
        names: Names of the parameters by ``id`` (missing ones are described by
            their shape).
        allow_meta: Accept parameters on the meta device (shapes without values,
            enough for memory estimates).

    Raises:
        InvalidArgumentError: If a parameter is on the meta device (and that is
            not allowed).
        GradientContextError: If a parameter was created in inference mode.
        UnsupportedDtypeError: For 16-bit parameters or mixed dtypes.
        NonFiniteError: If a parameter is NaN or infinite (names it).
    """
    dtypes = set()
    for param in params:
        name = names.get(id(param), f"parameter of shape {tuple(param.shape)}")
        if param.is_meta and not allow_meta:
            raise InvalidArgumentError(
                f"The {name} is on the meta device: it has a shape but no values. "
                "Materialize the model first (e.g. model.to_empty(device='cpu'), "
                "then load its weights); vivit.memory.estimate_memory accepts "
                "meta models."
            )
        if param.is_inference():
            raise GradientContextError(
                f"The {name} was created inside torch.inference_mode() and cannot "
                "enter a backward pass: create the model outside it."
            )
        check_dtype(param, name)
        if not param.is_meta:
            check_finite(param, name, batch_axis=False)
        dtypes.add(param.dtype)
    if len(dtypes) > 1:
        raise UnsupportedDtypeError(
            f"The parameters have different dtypes {sorted(map(str, dtypes))}: cast "
            "the model to one of float32 or float64 (model.float() or "
            "model.double())."
        )


def check_inputs_match(inputs: ModelInputs, params: Sequence[Tensor]) -> None:
    """Check that floating inputs have the parameters' dtype and device.

    Args:
        inputs: The mini-batch inputs (a tensor or a dict of tensors).
        params: The model's parameters.

    Raises:
        InvalidArgumentError: If the dtype or device differs.
    """
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


def check_generator(generator: object) -> None:
    """Check that a random generator is ``None`` or a ``torch.Generator``.

    Args:
        generator: The generator.

    Raises:
        InvalidArgumentError: If it is something else.
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InvalidArgumentError(
            f"generator must be a torch.Generator or None, got "
            f"{type(generator).__name__}: e.g. torch.Generator().manual_seed(0)."
        )


def check_batch_norms(model: Module) -> None:
    """:func:`check_batch_norm` for every module of the network, by name.

    Called before a forward pass, which would update the running statistics of
    a layer then refused.

    Args:
        model: The network.

    Raises:
        BatchNormTrainingError: For a BatchNorm layer using batch statistics.
    """
    for name, module in model.named_modules():
        check_batch_norm(module, name or "The model")


def check_batch_norm(module: Module, name: str = "") -> None:
    """Refuse a BatchNorm layer that normalizes with the mini-batch's statistics.

    It does so in training mode and, without running statistics
    (``track_running_stats=False``), in eval mode too (torch's rule); its output
    for one sample then depends on the others, and the GGN has no per-sample
    structure. Other modules pass.

    Args:
        module: A module of the network.
        name: Its name in the network, for the message (``""``: unknown).

    Raises:
        BatchNormTrainingError: For a BatchNorm layer using batch statistics.
    """
    if not isinstance(module, _BatchNorm):
        return
    layer = f"{name} ({module})" if name else str(module)
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
            "Build it with track_running_stats=True, let it gather running "
            "statistics in training mode, and call model.eval() before computing "
            "curvature"
        )
    else:
        return
    raise BatchNormTrainingError(
        f"{layer} {problem}: its output mixes the samples of the mini-batch, so the "
        f"GGN has no per-sample structure. {remedy}, or use a per-sample "
        "normalization (LayerNorm, GroupNorm)."
    )


def warn_random_forward(module: Module) -> None:
    """Warn if a layer draws random numbers in the forward pass (Dropout).

    Args:
        module: A layer the backward pass reached.
    """
    if isinstance(module, _DropoutNd) and module.training and module.p > 0:
        warnings.warn(
            f"{module} is in training mode: the GGN is that of the network with "
            "the one random mask of this forward pass and differs at every call. "
            "Call model.eval() for the GGN of the deterministic network.",
            RandomForwardWarning,
            stacklevel=2,
        )


def optimizer_param_groups(params: object) -> list:
    """Check an optimizer's ``params``: parameters, or dicts with ``"params"``.

    Args:
        params: What is passed to a ``torch.optim.Optimizer``.

    Returns:
        The parameters or groups as a list (``torch.optim`` takes it from there).

    Raises:
        ParamGroupError: If it is a single tensor, empty, mixes parameters and
            dicts, or holds something else.
    """
    if isinstance(params, Tensor):
        raise ParamGroupError(
            "params is a single tensor, expected an iterable of parameters (e.g. "
            "model.parameters()) or of dicts with 'params'."
        )
    if isinstance(params, dict | str) or not isinstance(params, Iterable):
        raise ParamGroupError(
            f"params must be an iterable of parameters or of dicts, got "
            f"{type(params).__name__}."
        )
    items = list(params)
    if not items:
        raise ParamGroupError(
            "params is empty (a model.parameters() generator already consumed, or a "
            "model without parameters?): pass the parameters to optimize."
        )
    if all(isinstance(item, dict) for item in items):
        groups = []
        for index, group in enumerate(items):
            if "params" not in group:
                raise ParamGroupError(f"Group {index} does not specify ['params'].")
            params_of_group = group["params"]
            if isinstance(params_of_group, Tensor):
                params_of_group = [params_of_group]
            groups.append({**group, "params": _group_params(params_of_group, index)})
        return groups
    return _group_params(items, 0)


def check_group_index(group: object, num_groups: int) -> None:
    """Check that ``group`` indexes one of ``num_groups`` parameter groups.

    Raises:
        GroupIndexError: Otherwise.
    """
    if not isinstance(group, int) or not 0 <= group < num_groups:
        raise GroupIndexError(
            f"group must be an index in [0, {num_groups}), got {group!r}."
        )


def check_progress(progress: object) -> None:
    """Raise unless ``progress`` is ``True``, ``False`` or ``None``.

    Raises:
        InvalidArgumentError: Otherwise.
    """
    if progress is not None and not isinstance(progress, bool):
        raise InvalidArgumentError(
            f"progress must be True, False or None (automatic), got {progress!r}."
        )


def check_max_batches(max_batches: object) -> None:
    """Check that ``max_batches`` is a positive integer or ``None``.

    Args:
        max_batches: Most batches of a data loader a pass reads (``None``: all).

    Raises:
        InvalidArgumentError: Otherwise.
    """
    check_positive_int(
        max_batches,
        "max_batches",
        "the most batches of the data loader a pass reads",
        "until the loader ends",
    )
