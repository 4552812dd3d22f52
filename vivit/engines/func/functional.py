"""Factor forms found at the function level: the calls a parameter goes through.

Calls of ``F.linear``, ``torch.addmm``, ``F.embedding``, ``F.layer_norm`` and
``F.rms_norm`` are recorded; probe vectors tell which sample owns which row of their
outputs (``docs/math.rst``, "Layer structure").
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter
from torch.overrides import TorchFunctionMode

from vivit.engines.func.capture import Recorded
from vivit.engines.func.recurrent import bind, recurrent_weights, stepwise

#: Base of the digits of a sample's index that one probe vector encodes.
PROBE_BASE = 16


def _transparent(function: Callable) -> Callable:
    """A copy of a Python-level functional whose nested calls a mode sees."""
    namespace = dict(function.__globals__)
    namespace["has_torch_function"] = lambda *_: False
    code, name = function.__code__, function.__name__
    copy = types.FunctionType(
        code, namespace, name, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


#: Python-level functionals whose inner calls are recorded, with their copies.
TRANSPARENT = {
    F.multi_head_attention_forward: _transparent(F.multi_head_attention_forward)
}


@dataclass
class FunctionUse(Recorded):
    """One call of a recognized function with a requested parameter.

    ``inputs``: ``[..., P]``, indices or the normalized input; ``kind``:
    ``"linear"`` (weight ``[O, P]``), ``"linear_t"`` (``[P, O]``), ``"embedding"`` or
    ``"norm"``; ``weight``, ``bias``: ``None`` unless requested; ``features``:
    trailing axes of the output that are features; ``padding``: ``padding_idx``.
    """

    kind: str
    weight: Parameter | None
    bias: Parameter | None
    features: int
    padding: int | None = None

    def params(self) -> list[Parameter]:
        """The requested parameters of the call."""
        return [p for p in (self.weight, self.bias) if p is not None]

    def rows(self, tensor: Tensor) -> Tensor:
        """``tensor`` of the output's shape (after leading axes) as ``[..., R, F]``."""
        lead = tensor.dim() - self.output.dim()
        shape = tensor.shape[: lead + self.output.dim() - self.features]
        return tensor.reshape(*tensor.shape[:lead], math.prod(shape[lead:]), -1)

    def input_rows(self) -> Tensor:
        """The recorded input as rows: ``[R, P]`` (indices: ``[R]``)."""
        if self.kind == "embedding":
            return self.inputs.reshape(-1)
        return self.inputs.reshape(self.rows(self.output).shape[0], -1)


def _requested(tensor, requested: set[int]) -> Parameter | None:
    return tensor if isinstance(tensor, Tensor) and id(tensor) in requested else None


class FunctionCapture(TorchFunctionMode):
    """Records (in ``uses``) the requested ``params``' uses in recognized functions."""

    def __init__(self, params: list[Parameter]):
        super().__init__()
        self.requested = {id(p) for p in params}
        self.uses: list[FunctionUse] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func in TRANSPARENT:
            with self:  # back on while the copy runs (it is off during this call)
                return TRANSPARENT[func](*args, **kwargs)
        if any(id(w) in self.requested for w in recurrent_weights(func, args, kwargs)):
            with self:  # the steps' F.linear calls are recorded
                result = stepwise(func, args, kwargs)
            if result is not None:
                return result
        output = func(*args, **kwargs)
        if isinstance(output, Tensor) and torch.is_grad_enabled():
            use = self._use(func, args, kwargs, output)
            if use is not None and use.params():
                self.uses.append(use)
        return output

    def _use(self, func, args, kwargs, output: Tensor) -> FunctionUse | None:
        req = self.requested
        if func is F.linear:
            a = bind(args, kwargs, ("input", "weight", "bias"), {"bias": None})
            return _make("linear", a["input"], output, 1, a["weight"], a["bias"], req)
        if func is torch.addmm:
            a = bind(args, kwargs, ("input", "mat1", "mat2"), {"beta": 1, "alpha": 1})
            if a["beta"] != 1 or a["alpha"] != 1 or a["input"].dim() != 1:
                return None
            return _make("linear_t", a["mat1"], output, 1, a["mat2"], a["input"], req)
        if func is F.embedding:
            names = ("input", "weight", "padding_idx", "max_norm")
            a = bind(args, kwargs, names, {"padding_idx": None, "max_norm": None})
            if a["max_norm"] is not None or kwargs.get("scale_grad_by_freq"):
                return None  # the table changed in place / gradients rescaled
            use = _make("embedding", a["input"], output, 1, a["weight"], None, req)
            padding = a["padding_idx"]
            if use is not None and padding is not None:
                use.padding = padding % a["weight"].shape[0]
            return use
        if func in (F.layer_norm, F.rms_norm):
            layer = func is F.layer_norm
            names = ("input", "normalized_shape", "weight", "bias" if layer else "eps")
            defaults = {"weight": None, "bias": None, "eps": 1e-5 if layer else None}
            a = bind(args, kwargs, names, defaults)
            shape = tuple(a["normalized_shape"])
            x = a["input"].detach()
            no_affine = (None, None) if layer else (None,)  # no weight, no bias
            with torch.no_grad():
                normalized = func(x, shape, *no_affine, a["eps"])
            use = _make("norm", x, output, len(shape), a["weight"], a["bias"], req)
            if use is not None:
                use.inputs = normalized
                use.versions = (normalized._version, output._version)
            return use
        return None


def _make(
    kind, inputs, output, features, weight, bias, requested
) -> FunctionUse | None:
    if not isinstance(inputs, Tensor):
        return None
    weight, bias = _requested(weight, requested), _requested(bias, requested)
    versions = (inputs._version, output._version)
    return FunctionUse(inputs.detach(), output, versions, kind, weight, bias, features)


def probe_vectors(block: Tensor, generator: torch.Generator) -> Tensor:
    """Probes ``[2·(1 + J), B, *out]`` that tell which sample owns each output row.

    ``block``: vectors ``[V, B, *out]`` (``docs/math.rst``, "Layer structure").
    """
    batch = block.shape[1]
    digits = max(1, math.ceil(math.log(max(batch, 2), PROBE_BASE)))
    index = torch.arange(batch, device=block.device)
    probes = []
    for _ in range(2):
        r = torch.randn(
            block.shape[1:], generator=generator, dtype=block.dtype, device=block.device
        )
        probes.append(r)
        for j in range(digits):
            digit = (index // PROBE_BASE**j) % PROBE_BASE
            scale = torch.pow(2.0, digit.to(block.dtype))
            probes.append(r * scale.reshape(batch, *[1] * (r.dim() - 1)))
    return torch.stack(probes)


def sample_rows(probes: Tensor, batch: int) -> Tensor | None:
    """Each sample's rows of an output, from the probes there ``[2·(1 + J), R, F]``.

    Returns:
        Row index ``[B, T]`` (``T ≥ ⌈R / B⌉``; index ``R`` pads, rows no probe
        reaches are left out), or ``None`` where the owners cannot be read off.
    """
    first, second = probes.chunk(2)
    owner, other = _owners(first), _owners(second)
    if owner is None or other is None or not torch.equal(owner, other):
        return None
    rows = len(owner)
    live = owner >= 0
    if live.any() and owner.max() >= batch:
        return None
    owner = torch.where(live, owner, torch.full_like(owner, batch))
    counts = torch.bincount(owner, minlength=batch + 1)[:batch]
    positions = max(1, int(counts.max()), math.ceil(rows / batch))
    order = torch.argsort(owner, stable=True)
    sorted_owner = owner[order]
    starts = torch.cumsum(counts, 0) - counts
    keep = sorted_owner < batch
    slot = torch.arange(rows, device=owner.device)[keep] - starts[sorted_owner[keep]]
    index = torch.full((batch, positions), rows, dtype=torch.long, device=owner.device)
    index[sorted_owner[keep], slot] = order[keep]
    return index


def _owners(family: Tensor) -> Tensor | None:
    """Row owners by one family (``-1``: unreached); ``None`` if one is unclear."""
    base = family[0]
    largest = base.abs().amax(dim=1)
    live = largest > 0
    pick = base.abs().argmax(dim=1, keepdim=True)
    reference = base.gather(1, pick)
    tolerance = torch.finfo(base.dtype).eps ** 0.5
    owner = torch.zeros(len(base), dtype=torch.long, device=base.device)
    for j, probe in enumerate(family[1:]):
        ratio = probe.gather(1, pick) / torch.where(live[:, None], reference, 1)
        digit = torch.log2(ratio.abs()).nan_to_num().round().clamp(0, PROBE_BASE - 1)
        residual = (probe - torch.pow(2.0, digit) * base).abs().amax(dim=1)
        if (residual[live] > tolerance * largest[live]).any():
            return None
        owner += digit[:, 0].long() * PROBE_BASE**j
    return torch.where(live, owner, torch.full_like(owner, -1))
