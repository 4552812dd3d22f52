"""Dense float64 ground truth for the GGN, computed without BackPACK.

Everything here follows ``docs/math.rst``:

    L(θ) = R · Σ_n ℓ_n(θ),   R = 1/N ("mean") or 1 ("sum"),
    G = R · Σ_n J_nᵀ H_n J_n,   G_n = J_nᵀ H_n J_n,

with J_n the Jacobian of sample n's model output w.r.t. the flattened parameters and
H_n the Hessian of ℓ_n w.r.t. that output. Only ``torch.func`` is used
(``functional_call``, ``jacrev``, ``hessian``); the model is always evaluated on the
whole batch at once, and every computation runs in float64 whatever the model's dtype
(parameters, floating buffers, inputs and floating targets are upcast). A float32
problem is therefore compared against the float64 value of the *same* numbers.

Parameters are flattened in the order they are given (default: the parameters with
``requires_grad`` in ``model.parameters()`` order), each one row-major.

Modules extended by BackPACK carry hooks that store module inputs/outputs in the
forward pass and delete them in the backward pass. The references run with all
module hooks temporarily removed, so they neither depend on BackPACK nor disturb the
I/O a pending ``backpack`` backward pass relies on.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import chain

import torch
from torch import Tensor
from torch.func import functional_call, hessian, jacrev
from torch.nn import Module

DTYPE = torch.float64

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)


# ----------------------------------------------------------------------------------
# Parameter bookkeeping
# ----------------------------------------------------------------------------------


def flatten_params(params: Sequence[Tensor]) -> Tensor:
    """Concatenate tensors into one vector (each flattened row-major)."""
    return torch.cat([p.reshape(-1) for p in params])


def unflatten(vec: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """Split a vector into tensors shaped like ``params`` (inverse of flattening)."""
    numels = [p.numel() for p in params]
    if vec.numel() != sum(numels):
        raise ValueError(f"Vector has {vec.numel()} entries, params {sum(numels)}.")
    chunks = vec.split(numels)
    return [c.reshape(p.shape) for c, p in zip(chunks, params, strict=True)]


def default_params(model: Module) -> list[Tensor]:
    """The parameters with ``requires_grad``, in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def _param_names(model: Module, params: Sequence[Tensor]) -> list[str]:
    """Qualified names of ``params`` inside ``model``."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    try:
        return [names[id(p)] for p in params]
    except KeyError as e:
        raise ValueError("A tensor in params is not a parameter of model.") from e


def reduction_factor(loss_func: Module, batch_size: int) -> float:
    """R in L = R Σ_n ℓ_n: 1/N for reduction "mean", 1 for "sum"."""
    reduction = getattr(loss_func, "reduction", None)
    if reduction == "mean":
        return 1.0 / batch_size
    if reduction == "sum":
        return 1.0
    raise ValueError(f"Unsupported reduction {reduction!r} of {loss_func}.")


# ----------------------------------------------------------------------------------
# Functional set-up
# ----------------------------------------------------------------------------------


@contextmanager
def _hooks_removed(*modules: Module) -> Iterator[None]:
    """Temporarily remove all forward/backward hooks of the modules (recursively)."""
    saved = []
    for module in chain.from_iterable(m.modules() for m in modules):
        for attr in _HOOK_DICTS:
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, OrderedDict())
    try:
        yield
    finally:
        for module, attr, hooks in saved:
            setattr(module, attr, hooks)


def _loss64(loss_func: Module) -> Module:
    """The loss module with float64 buffers (class weights), hooks not copied.

    Call inside ``_hooks_removed``: the copy then carries no BackPACK hooks.
    """
    buffers = [b for b in loss_func.buffers() if b.is_floating_point()]
    if all(b.dtype == DTYPE for b in buffers):
        return loss_func
    return copy.deepcopy(loss_func).to(DTYPE)


def _to64(t: Tensor) -> Tensor:
    """Detached float64 copy of floating tensors; other dtypes unchanged."""
    return t.detach().to(DTYPE) if t.is_floating_point() else t.detach()


def _output_fn(
    model: Module, params: Sequence[Tensor] | None, inputs: Tensor
) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """Model output as a function of the flat float64 parameters ``θ``.

    Returns:
        The function θ ↦ model(inputs) (whole batch, float64) and θ at the model's
        current parameters.
    """
    params = default_params(model) if params is None else list(params)
    if not params:
        raise ValueError("No parameters to differentiate.")
    names = _param_names(model, params)
    state = {
        name: _to64(t)
        for name, t in chain(model.named_parameters(), model.named_buffers())
    }
    x = _to64(inputs)

    def output(theta: Tensor) -> Tensor:
        new = dict(zip(names, unflatten(theta, params), strict=True))
        return functional_call(model, {**state, **new}, (x,))

    theta = flatten_params([_to64(p) for p in params])
    return output, theta


def _per_sample_loss(loss_func: Module, output_n: Tensor, target_n: Tensor) -> Tensor:
    """ℓ_n: the loss function applied to a batch holding sample n only."""
    return loss_func(output_n.unsqueeze(0), target_n.unsqueeze(0))


# ----------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------


def dense_ggn(
    model: Module,
    loss_func: Module,
    inputs: Tensor,
    targets: Tensor,
    params: Sequence[Tensor] | None = None,
    subsampling: Sequence[int] | None = None,
) -> Tensor:
    """Dense GGN G = Jᵀ H J of ``loss_func(model(inputs), targets)``, shape [D, D].

    J is the Jacobian of the (whole-batch) model output w.r.t. the flattened params,
    H the Hessian of the loss w.r.t. that output (it contains R).

    Args:
        model: The model (may be BackPACK-extended or a converted GraphModule).
        loss_func: Loss module with reduction "mean" or "sum".
        inputs: Mini-batch inputs, first axis the batch axis.
        targets: Mini-batch targets.
        params: Parameters to differentiate (default: all with ``requires_grad``).
        subsampling: Sample indices. If given, the GGN of ``loss_func`` applied to
            these samples alone (mean over them for "mean"); the forward pass still
            uses the whole batch.

    Returns:
        The float64 GGN.
    """
    with _hooks_removed(model, loss_func):
        loss_func = _loss64(loss_func)
        output_fn, theta = _output_fn(model, params, inputs)
        y = _to64(targets)
        if subsampling is not None:
            idx = torch.as_tensor(list(subsampling), dtype=torch.long)
            full_output_fn = output_fn

            def output_fn(theta: Tensor) -> Tensor:
                return full_output_fn(theta)[idx]

            y = y[idx]

        output = output_fn(theta)
        J = jacrev(output_fn)(theta).reshape(output.numel(), theta.numel())
        H = hessian(lambda f: loss_func(f, y))(output)
        H = H.reshape(output.numel(), output.numel())
    return J.T @ H @ J


def dense_hessian(
    model: Module,
    loss_func: Module,
    inputs: Tensor,
    targets: Tensor,
    params: Sequence[Tensor] | None = None,
) -> Tensor:
    """Dense Hessian of the batch loss w.r.t. the flattened params, shape [D, D].

    Equals the GGN when the model is linear in its parameters.
    """
    with _hooks_removed(model, loss_func):
        loss_func = _loss64(loss_func)
        output_fn, theta = _output_fn(model, params, inputs)
        y = _to64(targets)
        return hessian(lambda t: loss_func(output_fn(t), y))(theta)


def dense_gradient(
    model: Module,
    loss_func: Module,
    inputs: Tensor,
    targets: Tensor,
    params: Sequence[Tensor] | None = None,
) -> Tensor:
    """Gradient ∇L of the batch loss w.r.t. the flattened params, shape [D]."""
    with _hooks_removed(model, loss_func):
        loss_func = _loss64(loss_func)
        output_fn, theta = _output_fn(model, params, inputs)
        y = _to64(targets)
        return jacrev(lambda t: loss_func(output_fn(t), y))(theta)


def per_sample_losses(
    model: Module, loss_func: Module, inputs: Tensor, targets: Tensor
) -> Tensor:
    """The ℓ_n with L = R Σ_n ℓ_n, shape [N] (float64).

    Raises:
        ValueError: If R Σ_n ℓ_n does not reproduce the batch loss (e.g. class
            weights, which make a "mean" loss non-decomposable).
    """
    with _hooks_removed(model, loss_func):
        loss_func = _loss64(loss_func)
        output_fn, theta = _output_fn(model, None, inputs)
        y = _to64(targets)
        output = output_fn(theta)
        losses = torch.stack(
            [_per_sample_loss(loss_func, f, t) for f, t in zip(output, y, strict=True)]
        )
        batch_loss = loss_func(output, y)
    R = reduction_factor(loss_func, len(losses))
    if not torch.allclose(R * losses.sum(), batch_loss, rtol=1e-10, atol=1e-12):
        raise ValueError("Loss is not of the form R Σ_n ℓ_n.")
    return losses


def per_sample_gradients(
    model: Module,
    loss_func: Module,
    inputs: Tensor,
    targets: Tensor,
    params: Sequence[Tensor] | None = None,
) -> Tensor:
    """Per-sample gradients ∇_θ ℓ_n, shape [N, D], with L = R Σ_n ℓ_n.

    For reduction "mean" this is N times the gradient of sample n's contribution to
    L. Computed as the Jacobian of the vector (ℓ_1, ..., ℓ_N) w.r.t. θ, with the
    model evaluated on the whole batch.
    """
    per_sample_losses(model, loss_func, inputs, targets)  # checks L = R Σ_n ℓ_n
    with _hooks_removed(model, loss_func):
        loss_func = _loss64(loss_func)
        output_fn, theta = _output_fn(model, params, inputs)
        y = _to64(targets)

        def losses(t: Tensor) -> Tensor:
            output = output_fn(t)
            return torch.stack(
                [_per_sample_loss(loss_func, output[n], y[n]) for n in range(len(y))]
            )

        return jacrev(losses)(theta)


def per_sample_ggns(
    model: Module,
    loss_func: Module,
    inputs: Tensor,
    targets: Tensor,
    params: Sequence[Tensor] | None = None,
) -> Tensor:
    """Per-sample GGNs G_n = J_nᵀ H_n J_n, shape [N, D, D], with R Σ_n G_n = G.

    H_n is the Hessian of ℓ_n w.r.t. sample n's output.
    """
    per_sample_losses(model, loss_func, inputs, targets)  # checks L = R Σ_n ℓ_n
    with _hooks_removed(model, loss_func):
        loss_func = _loss64(loss_func)
        output_fn, theta = _output_fn(model, params, inputs)
        y = _to64(targets)
        output = output_fn(theta)
        N, K = output.shape[0], output[0].numel()
        J = jacrev(output_fn)(theta).reshape(N, K, theta.numel())
        H = torch.stack(
            [
                hessian(lambda f, yn=yn: _per_sample_loss(loss_func, f, yn))(fn)
                for fn, yn in zip(output, y, strict=True)
            ]
        ).reshape(N, K, K)
    return torch.einsum("nkd,nkl,nle->nde", J, H, J)


def eigh_reference(G: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors (columns) of symmetric G in float64."""
    G = G.to(DTYPE)
    return torch.linalg.eigh((G + G.T) / 2)
