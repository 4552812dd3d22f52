"""Checks on user input shared by every front door."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from vivit.errors import InvalidSubsamplingError, NonFiniteError, ParamGroupError


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


def check_mc_samples(mc_samples: object) -> int:
    """Check the number of Monte-Carlo samples of the loss Hessian.

    Args:
        mc_samples: ``0`` for the exact loss Hessian, else ``M``.

    Returns:
        The number, unchanged.

    Raises:
        ValueError: If it is not an integer ``>= 0``.
    """
    if (
        isinstance(mc_samples, bool)
        or not isinstance(mc_samples, int)
        or mc_samples < 0
    ):
        raise ValueError(f"mc_samples must be an integer >= 0, got {mc_samples!r}.")
    return mc_samples


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
    seen: set[int] = set()
    for index, group in enumerate(param_groups):
        if not isinstance(group, dict):
            raise ParamGroupError(
                f"Group {index} is a {type(group).__name__}, expected a dict."
            )
        missing = [key for key in required_keys if key not in group]
        if missing:
            raise ParamGroupError(f"Group {index} does not specify {missing}.")
        params = list(group["params"])
        if not params:
            raise ParamGroupError(f"Group {index} has no parameters.")
        for param in params:
            if id(param) in seen:
                raise ParamGroupError(
                    f"A parameter of shape {tuple(param.shape)} occurs in more than "
                    "one "
                    "group (found again in group "
                    f"{index}): each parameter may belong to one group only."
                )
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
        ValueError: If it is neither.
    """
    if callable(damping):
        return
    if (
        isinstance(damping, int | float)
        and not isinstance(damping, bool)
        and damping >= 0
    ):
        return
    raise ValueError(
        f"{name} must be a number >= 0 or a callable (evals, gram_evecs, gammas, "
        f"lambdas) -> [K] such as vivit.optim.BootstrapDamping, got {damping!r}."
    )


def check_finite(tensor: Tensor, what: str, batch_axis: bool = True) -> None:
    """Refuse a tensor with NaN or infinite entries, naming where they are.

    Args:
        tensor: The tensor to check (integer tensors are always finite).
        what: What the tensor is, for the message (``"inputs"``, a parameter name).
        batch_axis: Whether the first axis indexes samples (the message then names
            the first sample with a non-finite entry).

    Raises:
        NonFiniteError: If an entry is NaN or infinite.
    """
    if not tensor.is_floating_point() and not tensor.is_complex():
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
        f"The {what} contain {' and '.join(kinds)}{where}: the curvature would not "
        "be finite. Remove or fix these values before calling the library."
    )
