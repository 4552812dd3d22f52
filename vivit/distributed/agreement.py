"""Whether the ranks of a group agree: on their requests, their values, success.

On a difference or a failed rank every rank raises the same
:class:`~vivit.errors.DistributedError`, so no rank waits for data that never comes.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from vivit.errors import DistributedError
from vivit.sources.batches import SAMPLE_SHAPE_ADVICE

if TYPE_CHECKING:
    from vivit.options import CurvatureOptions

#: Key of the model's parameter and buffer checksums in a request's fingerprint.
MODEL_STATE = "model state"

#: Key of the targets' shape per sample in a request's fingerprint (``None`` for a
#: loader, whose shape is known after its pass: compared in the shard round).
SAMPLE_SHAPE = "target_shape_per_sample"


@dataclass(frozen=True, eq=False)
class TensorChecksum:
    """Sum and norm in float64, equal within ``1e-9`` of the norm (in any order)."""

    total: float
    norm: float

    @classmethod
    def of(cls, tensor: Tensor) -> TensorChecksum:
        """The checksum of ``tensor`` (no copy of a floating-point tensor)."""
        tensor = tensor.detach()
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        elif not tensor.is_floating_point():
            tensor = tensor.double()
        return cls(
            float(torch.sum(tensor, dtype=torch.float64)),
            float(torch.linalg.vector_norm(tensor, dtype=torch.float64)),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorChecksum):
            return NotImplemented
        tolerance = 1e-9 * max(self.norm, other.norm)
        return (
            abs(self.total - other.total) <= tolerance
            and abs(self.norm - other.norm) <= tolerance
        )

    __hash__ = None


def request_fingerprint(
    loss_func: Module | None,
    param_groups: list[list[Tensor]],
    model: Module | None = None,
    **options: object,
) -> dict[str, object]:
    """What every rank must ask for identically: loss, groups' shapes, model, options.

    Picklable, compared key by key; ``model``: its ``state_dict``'s checksums.
    """
    fingerprint: dict[str, object] = dict(options)
    fingerprint["parameter groups"] = [
        [(tuple(p.shape), str(p.dtype), p.device.type) for p in group]
        for group in param_groups
    ]
    if model is not None:  # the state_dict: caches (non-persistent buffers) may differ
        fingerprint[MODEL_STATE] = {
            name: TensorChecksum.of(tensor)
            for name, tensor in model.state_dict().items()
            if isinstance(tensor, Tensor)
        }
    if loss_func is not None:
        fingerprint["loss"] = (
            type(loss_func).__name__,
            {
                name: value
                for name, value in sorted(vars(loss_func).items())
                if not name.startswith("_")
                and isinstance(value, bool | int | float | str | type(None))
            },
            {name: b.tolist() for name, b in loss_func.named_buffers()},
        )
    return fingerprint


def run_fingerprint(
    model: Module,
    loss_func: Module,
    param_groups: list[list[Tensor]],
    options: CurvatureOptions,
    engine: str,
    sample_shape: tuple[int, ...] | None,
    grouped: bool,
    **extra: object,
) -> dict[str, object]:
    """A construction's :func:`request_fingerprint` (model checksums: ranks only)."""
    return request_fingerprint(
        loss_func,
        param_groups,
        model if grouped else None,
        **extra,
        solver=(options.solver, options.solver_tol, options.solver_seed),
        engine=engine,
        **{SAMPLE_SHAPE: sample_shape},
    )


def agree_across_ranks(group: dist.ProcessGroup, what: str, value: object) -> None:
    """Check that every rank of ``group`` holds the same ``value`` (a collective).

    ``what`` names the value for the message; ``value`` is compared with ``==``.

    Raises:
        DistributedError: On every rank, if a rank's value differs from rank 0's.
    """
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    differences = [
        f"rank {rank} uses {what} {theirs!r}, rank 0 {gathered[0]!r}"
        for rank, theirs in enumerate(gathered)
        if theirs != gathered[0]
    ]
    if differences:
        raise DistributedError(
            "; ".join(differences) + ". Every rank must pass the same options."
        )


def check_requests(fingerprints: Sequence[dict[str, object]]) -> None:
    """Refuse a rank that asks for other than rank 0 (shapes: where both known)."""
    first = fingerprints[0]
    differences = [
        _difference(rank, key, theirs[key], first[key])
        for rank, theirs in enumerate(fingerprints)
        for key in first
        if theirs.get(key) != first[key]
        and not (key == SAMPLE_SHAPE and None in (theirs.get(key), first[key]))
    ]
    if differences:
        raise DistributedError(
            "The ranks of the process group ask for different curvature: "
            + "; ".join(differences)
            + ". Every rank must pass the same options (only the data differ)."
        )


def check_sample_shapes(shapes: Sequence[tuple[int, ...] | None]) -> None:
    """Refuse targets of another shape per sample than rank 0's (rank order)."""
    differences = [
        _difference(rank, SAMPLE_SHAPE, shape, shapes[0])
        for rank, shape in enumerate(shapes)
        if shape != shapes[0]
    ]
    if differences:
        raise DistributedError("; ".join(differences))


def _difference(rank: int, key: str, theirs: object, first: object) -> str:
    """How rank ``rank``'s request differs from rank 0's in ``key``."""
    if key == SAMPLE_SHAPE:
        return (
            f"rank {rank}'s targets have the shape {theirs} per sample, rank 0's "
            f"{first}. {SAMPLE_SHAPE_ADVICE}"
        )
    if key != MODEL_STATE or theirs.keys() != first.keys():
        return f"rank {rank} asks for {key} = {theirs!r}, rank 0 for {first!r}"
    names = [name for name in first if theirs[name] != first[name]]
    return (
        f"rank {rank}'s model differs from rank 0's in {', '.join(names)} (every "
        "rank must run the same model: seed its initialisation alike or load the "
        "same state_dict; DistributedDataParallel broadcasts rank 0's when it "
        "wraps the model)"
    )


@dataclass(frozen=True)
class RankFailure:
    """A rank's error (type and message), sent to the others in its round's message."""

    rank: int
    summary: str

    @classmethod
    def of(cls, rank: int, error: BaseException) -> RankFailure:
        """The failure of ``rank`` with ``error``."""
        return cls(rank, f"{type(error).__name__}: {error}")


def gather_objects(group: dist.ProcessGroup, item: object, report) -> list[object]:
    """Every rank's ``item`` in rank order; its pickled bytes counted in ``report``."""
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, item, group=group)
    report.metadata_bytes += len(pickle.dumps(item))
    return gathered


def raise_failures(gathered: Sequence[object], world_size: int) -> None:
    """Raise :class:`~vivit.errors.DistributedError` naming every failed rank."""
    failures = [g for g in gathered if isinstance(g, RankFailure)]
    if failures:
        raise DistributedError(
            "; ".join(
                f"Rank {f.rank} of {world_size} failed ({f.summary})" for f in failures
            )
            + ". No rank computed the curvature of the union of the shards; "
            "fix the failing rank's input (see its own error)."
        )
