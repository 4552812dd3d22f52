"""Checks of parameter groups: lists of parameters, or dicts as ``torch.optim``'s."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_dtype
from vivit.errors import ParamGroupError


def _group_params(params: object, index: int) -> list[Tensor]:
    """Group ``index``'s parameters as a list, refusing what is not parameters."""
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


def check_param_groups(
    param_groups: Iterable[dict], required_keys: Sequence[str]
) -> None:
    """Check dict groups (``"params"`` a list): ``required_keys``, no overlap.

    Raises:
        ParamGroupError: For a missing key, an empty group or a shared parameter.
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
        _check_distinct(_group_params(group["params"], index), index, seen)


def _check_distinct(params: list[Tensor], index: int, seen: set[int]) -> None:
    """Group ``index``: no parameter ``seen`` before (adds them), trainable ones."""
    for param in params:
        shape = tuple(param.shape)
        if id(param) in seen:
            raise ParamGroupError(
                f"A parameter of shape {shape} occurs in more than one group (found "
                f"again in group {index}): each parameter may belong to one group only."
            )
        check_dtype(param, f"parameter of shape {shape}")
        if not param.requires_grad:
            raise ParamGroupError(
                f"Group {index} holds a parameter of shape {shape} that does not "
                "require gradients: the backward pass gives it no curvature."
            )
        seen.add(id(param))


def param_group_lists(
    param_groups: object, model: Module | None = None
) -> list[list[Parameter]]:
    """Validate lists of parameters (``None``: all trainable ones of ``model``).

    Raises:
        ParamGroupError: If ``param_groups`` is empty, flat, a list of dicts, or
            holds a non-parameter, another model's, a frozen one or one twice.
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
    seen: set[int] = set()
    for index, group in enumerate(groups):
        _check_distinct(group, index, seen)
    owned = {id(p) for p in model.parameters()} if model is not None else None
    for index, group in enumerate(groups):
        for param in group:
            if owned is not None and id(param) not in owned:
                raise ParamGroupError(
                    f"Group {index} holds a parameter of shape "
                    f"{tuple(param.shape)} that is not a parameter of the model."
                )
    return groups


def optimizer_param_groups(params: object) -> list:
    """Check an optimizer's ``params`` (parameters, or dicts with ``"params"``).

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
    if not all(isinstance(item, dict) for item in items):
        return _group_params(items, 0)
    groups = []
    for index, group in enumerate(items):
        if "params" not in group:
            raise ParamGroupError(f"Group {index} does not specify ['params'].")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else params
        groups.append({**group, "params": _group_params(params, index)})
    return groups
