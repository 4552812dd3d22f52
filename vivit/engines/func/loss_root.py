"""The loss-Hessian square root at the model output, for the func engine.

The exact root follows ``docs/math.rst`` ("The GGN and its square root"): the
loss Hessian with respect to the output is block-diagonal over the samples (each
sample's output enters its own loss term), ``∇²_{f_n} L = R H_n``; each block is
taken from one batched double-backward pass and factored by a symmetric
eigendecomposition, ``R H_n = Q Λ Qᵀ = (Q √Λ)(Q √Λ)ᵀ``. This works for every loss
module whose loss is a sum over samples (every option of MSELoss, CrossEntropyLoss
and BCEWithLogitsLoss) and uses exactly the loss as the module defines it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module

from vivit.engines.base import BatchInfo
from vivit.engines.func.vjp import batched_vjp


def exact_sqrt_hessian(
    loss_func: Module, output: Tensor, targets: Tensor, batch: BatchInfo
) -> Tensor:
    """``√R_S · S_n`` of the GGN samples, BackPACK's layout ``[C, |S|, *out]``.

    Args:
        loss_func: The loss module.
        output: Model output ``[N, *out]`` (detached).
        targets: Targets of the mini-batch.
        batch: The batch context (reduction, GGN samples).

    Returns:
        Columns of the root, one per output entry ``C = out.numel()``.
    """
    output = output.detach().requires_grad_(True)
    with torch.enable_grad():
        gradient = torch.autograd.grad(
            loss_func(output, targets), output, create_graph=True
        )[0]
        entries = output[0].numel()
        eye = torch.eye(entries, dtype=output.dtype, device=output.device)
        # vector j: entry j of every sample's output, so column j of each block
        directions = eye.reshape(entries, 1, *output.shape[1:]).expand(
            entries, *output.shape
        )
        (blocks,) = batched_vjp(gradient, [output], directions, entries)
    samples = torch.as_tensor(batch.ggn_samples, device=output.device)
    blocks = blocks.reshape(entries, output.shape[0], entries)[:, samples]
    blocks = blocks.transpose(0, 1)  # [|S|, j, i], symmetric in (j, i)
    evals, evecs = torch.linalg.eigh((blocks + blocks.transpose(1, 2)) / 2)
    roots = evecs * evals.clamp(min=0).sqrt().unsqueeze(1)  # [|S|, i, c]
    roots = roots * batch.subsampling_scale
    return roots.permute(2, 0, 1).reshape(entries, len(samples), *output.shape[1:])
