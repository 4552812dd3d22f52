"""Dense float64 columns of ``V`` and Papyan's parts of a cross-entropy GGN.

Independent of vivit's engines: the per-sample Jacobians ``J_n`` from
``torch.func.jacrev`` (``tests/fixtures/reference.py``) and the roots
``S_n = diag(√p) − p √pᵀ`` of ``docs/math.rst`` ("Losses") from the float64
softmax, checked against ``torch.func.hessian`` of the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import hessian, jacrev
from torch.nn import Module

from tests.fixtures.reference import (
    _hooks_removed,
    _output_fn,
    _per_sample_loss,
    _to64,
    reduction_factor,
)


def dense_columns(
    model: Module, loss_func: Module, inputs: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor]:
    """``V`` as ``[D, N, C]`` (column ``(n, c)`` is ``√R J_nᵀ s_nc``) and ``p [N, C]``.

    Raises:
        AssertionError: If ``S_n S_nᵀ`` is not the Hessian of ``ℓ_n``.
    """
    with _hooks_removed(model, loss_func):
        output_fn, theta = _output_fn(model, None, inputs)
        output = output_fn(theta)
        N, C = output.shape
        J = jacrev(output_fn)(theta).reshape(N, C, theta.numel())
        p = output.softmax(dim=1)
        roots = torch.diag_embed(p.sqrt()) - p[:, :, None] * p.sqrt()[:, None, :]
        y = _to64(targets)
        for n in range(N):
            H = hessian(lambda f, n=n: _per_sample_loss(loss_func, f, y[n]))(output[n])
            torch.testing.assert_close(roots[n] @ roots[n].T, H, rtol=0, atol=1e-14)
    R = reduction_factor(loss_func, N)
    return R**0.5 * torch.einsum("ncd,nck->dnk", J, roots), p


def dense_parts(
    columns: Tensor, labels: Tensor, probabilities: Tensor | None
) -> dict[str, Tensor]:
    """Papyan's parts built as he writes them, ``[D, D]`` each.

    Plain means (``probabilities=None``): ``m_ac`` the mean of ``v_nc`` over the
    samples of label ``a``, ``G_class = Σ_a N_a m_aa m_aaᵀ``, ``G_cross`` the same
    over ``c ≠ a``, ``G_within = Σ_{n,c} (v_nc − m_{y_n c})(v_nc − m_{y_n c})ᵀ``.
    Probability-weighted (Papyan 2019): ``Δ_nc = v_nc / √p_nc`` (``√R J_nᵀ(e_c −
    p_n)``), ``δ_ac = Σ_{n∈a} p_nc Δ_nc / P_ac`` with ``P_ac = Σ_{n∈a} p_nc``,
    ``G_class = Σ_a P_aa δ_aa δ_aaᵀ``, likewise cross, and ``G_within =
    Σ p_nc (Δ_nc − δ_{y_n c})(Δ_nc − δ_{y_n c})ᵀ``.
    """
    D, N, C = columns.shape
    parts = {
        name: columns.new_zeros(D, D)
        for name in ("class_means", "cross_class", "within_class")
    }
    for a in range(C):
        members = (labels == a).nonzero().flatten()
        if not len(members):
            continue
        for c in range(C):
            v = columns[:, members, c]
            if probabilities is None:
                weight = torch.ones(len(members), dtype=v.dtype)
                vectors = v
            else:
                weight = probabilities[members, c]
                vectors = v / weight.sqrt()
            total = weight.sum()
            mean = (vectors * weight).sum(1) / total
            name = "class_means" if c == a else "cross_class"
            parts[name] += total * torch.outer(mean, mean)
            deviation = vectors - mean[:, None]
            parts["within_class"] += (deviation * weight) @ deviation.T
    return parts
