"""The curvature of the union of the shards of a ``torch.distributed`` group.

Every rank of a process group computes the curvature of its own shard (one block
of samples, :class:`~vivit.sources.batches.BlockResult`; a loader's batches
combined into one); :class:`ShardExchange` hands every rank's block to every other
with ``torch.distributed`` collectives, and each rank combines the blocks in rank
order (:func:`~vivit.sources.blocks.combine_curvatures`), exactly
as a single process combines the batches of a loader over the same shards.
``docs/math.rst`` ("Data sets and processes", "Several processes") gives the
scalings and the cost model.

Protocol of one construction:

1. *Request round* (``all_gather_object``, before the backward pass): every rank
   sends a fingerprint of its request (MC samples, ``gram_dtype``, loss options,
   parameter shapes, solver, checksums of the model's parameters and buffers)
   and its Monte-Carlo seed. A mismatch is refused on
   every rank; all ranks use rank 0's seed.
2. *Block round* (``all_gather_object``, after the local backward pass): every
   rank sends whether it succeeded and, if so, the description of its block
   (batch context, factor types and tensor shapes, byte offsets) and its
   targets' shape per sample (a loader's is known only now). A failure on
   any rank is raised on every rank (the failing rank re-raises its own error,
   the others :class:`~vivit.errors.DistributedError` naming it), so no rank
   waits for data that never comes.
3. *Data* (``all_gather`` of one byte buffer per rank, padded to the longest):
   the tensors of every block (factors of ``V`` in the model's type, per-sample
   gradient factors, the loss), bit for bit. The gradient of each block's loss
   is ``R_b Σ_n ∇ℓ_n`` of its per-sample gradient factors (:func:`block_gradient`).
4. *Gram matrices* (one ``all_gather_object`` of whether they fit on each rank,
   then one ``all_gather`` per group, :meth:`ShardExchange.gram`): each rank
   forms its share of the blocks ``V_aᵀ V_b``; skipped for the matrix-free
   solver.

Every rank rebuilds every block, its own included, from the gathered bytes, and
assembles the same Gram matrices. Everything that follows (eigenpairs, ``γ``,
``λ``, Newton steps) each rank computes from the same bytes with the same
operations: the results
are identical on every rank (given the same library versions, device type and
number of threads), without any further communication, so later calls may come
in any order and number on each rank.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from vivit.engines.base import BatchInfo, EngineOutput
from vivit.errors import DistributedError, InvalidArgumentError
from vivit.gram import ParamFactors, SampleBlockFactors
from vivit.sources.batches import SAMPLE_SHAPE_ADVICE, BlockResult
from vivit.sources.collector import GroupCurvature

#: Byte alignment of every tensor in an exchanged buffer (whole cache lines).
ALIGNMENT = 64

#: Key of the model's parameter and buffer checksums in a request's fingerprint.
MODEL_STATE = "model state"

#: Key of the targets' shape per sample in a request's fingerprint (``None`` for a
#: loader, whose shape is known after its pass: compared in the block round).
SAMPLE_SHAPE = "target_shape_per_sample"


def resolve_group(process_group: object) -> dist.ProcessGroup | None:
    """The process group whose shards form the union, or ``None`` to run locally.

    Args:
        process_group: ``None``: the default group if ``torch.distributed`` is
            initialised, else local; ``False``: local (each rank on its own
            batch); a ``ProcessGroup``: that group.

    Returns:
        The group, or ``None`` if there is nothing to exchange (local, or a group
        of one rank).

    Raises:
        InvalidArgumentError: If ``process_group`` is none of these, or this
            process is not a member of the group.
    """
    if process_group is False:
        return None
    if (
        dist.is_available()
        and type(process_group) is int
        and process_group == dist.GroupMember.NON_GROUP_MEMBER
    ):  # what torch.distributed.new_group returns on the ranks outside the group
        raise InvalidArgumentError(
            "This process is not a member of process_group (new_group returned "
            "GroupMember.NON_GROUP_MEMBER on this rank): call with process_group "
            "only on the group's ranks, or pass process_group=False here."
        )
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    elif dist.is_available() and isinstance(process_group, dist.ProcessGroup):
        group = process_group
    else:
        raise InvalidArgumentError(
            "process_group must be None (the default group if torch.distributed is "
            "initialised), False (this process alone) or a "
            f"torch.distributed.ProcessGroup, got {type(process_group).__name__}."
        )
    if dist.get_rank(group) < 0:
        raise InvalidArgumentError(
            "This process is not a member of process_group: pass a group it "
            "belongs to, or process_group=False."
        )
    return group if dist.get_world_size(group) > 1 else None


def local_module(model: Module) -> Module:
    """The module to run the engines on: a ``DistributedDataParallel``'s ``.module``.

    DDP's forward pass prepares a gradient all-reduce for the next backward pass;
    the curvature's backward pass must not trigger it (the ranks' shards are
    exchanged by :class:`ShardExchange` instead). The wrapped module holds the
    same parameters.

    Args:
        model: The network, possibly wrapped.

    Returns:
        The wrapped module, or ``model`` itself.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


@dataclass(frozen=True, eq=False)
class TensorChecksum:
    """Sum and Euclidean norm of a tensor, in float64.

    Equal tensors match whatever the order of summation (different numbers of
    threads): two checksums match if both agree to ``1e-9`` of the norm.

    Attributes:
        total: Sum of the entries.
        norm: Euclidean norm of the entries.
    """

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
    """What every rank of a group must ask for identically.

    Args:
        loss_func: The loss module (its type, options and weights), if any.
        param_groups: The parameter groups (their shapes and types).
        model: The network, if any: the values of its ``state_dict`` (parameters
            and persistent buffers; :class:`TensorChecksum`) must agree too,
            since each rank runs its shard through its own replica.
        **options: Further options that shape the results (MC samples,
            ``gram_dtype``, solver, engine).

    Returns:
        A picklable description, compared key by key across the ranks.
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


@dataclass(frozen=True)
class ShardLayout:
    """Where each rank's samples sit in the union (rank order).

    Every result over samples (rows of ``γ`` and ``λ``, Gram-space entries)
    covers the union; these ranges pick a rank's own.

    Attributes:
        rank: This process's rank in the group (``0`` locally).
        world_size: Number of ranks (``1`` locally).
        samples: Each rank's samples as positions in the union batch (rows of
            ``γ`` with ``subsampling_grad=None``; indices for
            ``subsampling_grad``).
        ggn_samples: Each rank's GGN samples (its subsampling) as positions among
            the union's GGN samples (rows of ``λ``; Gram-space entries
            ``n·C + c`` of these ``n``).
    """

    rank: int
    world_size: int
    samples: tuple[range, ...]
    ggn_samples: tuple[range, ...]

    @property
    def local_samples(self) -> range:
        """This rank's samples, as positions in the union batch."""
        return self.samples[self.rank]

    @property
    def local_ggn_samples(self) -> range:
        """This rank's GGN samples, as positions among the union's GGN samples."""
        return self.ggn_samples[self.rank]

    @classmethod
    def of_batches(
        cls, batches: Sequence[BatchInfo], rank: int, world_size: int
    ) -> ShardLayout:
        """The layout of blocks in rank order (one block per rank, or one rank).

        Args:
            batches: The blocks' batch contexts, in order.
            rank: This process's rank.
            world_size: Number of ranks.

        Returns:
            The layout; locally a single "rank" spans every block.
        """
        per_rank = [batches] if world_size == 1 else [[batch] for batch in batches]
        samples, ggn_samples = [], []
        start = ggn_start = 0
        for owned in per_rank:
            size = sum(b.batch_size for b in owned)
            ggn_size = sum(len(b.ggn_samples) for b in owned)
            samples.append(range(start, start + size))
            ggn_samples.append(range(ggn_start, ggn_start + ggn_size))
            start, ggn_start = start + size, ggn_start + ggn_size
        return cls(rank, world_size, tuple(samples), tuple(ggn_samples))


@dataclass
class ExchangeReport:
    """What one construction sent and received (all zero locally).

    Attributes:
        world_size: Number of ranks.
        payload_bytes: Bytes of every rank's tensors (rank order), before
            alignment and padding: the cost model of ``docs/math.rst``
            ("Several processes").
        buffer_bytes: Length of every rank's buffer in the all-gather (the
            longest payload with its tensors aligned to :data:`ALIGNMENT`).
        metadata_bytes: Pickled bytes of this rank's messages in the
            ``all_gather_object`` rounds.
        seconds: Wall time of the agreement rounds and of packing, exchanging
            and rebuilding the blocks on this rank (includes waiting for the
            slowest rank's backward pass).
        gram_buffer_bytes: Length of every rank's buffer of Gram blocks, summed
            over the Gram matrices formed together.
        gram_seconds: Wall time of forming them (this rank's blocks and the
            all-gather).
    """

    world_size: int = 1
    payload_bytes: list[int] = field(default_factory=lambda: [0])
    buffer_bytes: int = 0
    metadata_bytes: int = 0
    seconds: float = 0.0
    gram_buffer_bytes: int = 0
    gram_seconds: float = 0.0

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends, each buffer to every other rank (factors, Grams)."""
        return (self.buffer_bytes + self.gram_buffer_bytes) * (self.world_size - 1)

    @property
    def received_bytes(self) -> int:
        """Bytes this rank receives: every other rank's buffers."""
        return self.sent_bytes


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in an exchanged byte buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Failure:
    """A rank's error, as the other ranks report it."""

    rank: int
    summary: str


class _Packer:
    """Lays out tensors in one byte buffer and describes them by slots."""

    def __init__(self) -> None:
        self.tensors: list[tuple[int, Tensor]] = []
        self.size = 0
        self.payload = 0

    def add(self, tensor: Tensor) -> _Slot:
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        slot = _Slot(self.size, nbytes, tensor.dtype, tuple(tensor.shape))
        self.tensors.append((self.size, tensor))
        self.payload += nbytes
        self.size += -(-nbytes // ALIGNMENT) * ALIGNMENT
        return slot

    def fill(self, buffer: Tensor) -> None:
        for offset, tensor in self.tensors:
            data = tensor.contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + data.numel()].copy_(data)


def _unpack(slot: _Slot, buffer: Tensor) -> Tensor:
    data = buffer[slot.offset : slot.offset + slot.nbytes]
    return data.view(slot.dtype).reshape(slot.shape)


def _pack_factors(factors: ParamFactors, dtype: torch.dtype, packer: _Packer) -> tuple:
    """Describe factors by their class and attributes, tensors cast to ``dtype``.

    The factors are held in ``gram_dtype``; they were computed in the model's
    type ``dtype``, so casting back is exact and halves the bytes of float32
    factors accumulated in float64. Factors held per block of samples (a rank's
    batches whose factors took different forms) describe each block.
    """
    if isinstance(factors, SampleBlockFactors):
        blocks = [_pack_factors(block, dtype, packer) for block in factors.blocks]
        return SampleBlockFactors, blocks, list(factors.scales)
    state = {
        name: packer.add(value.to(dtype) if value.is_floating_point() else value)
        if isinstance(value, Tensor)
        else value
        for name, value in vars(factors).items()
    }
    return type(factors), factors.dtype, state


def _unpack_factors(description: tuple, buffer: Tensor) -> ParamFactors:
    cls, held_dtype, state = description
    if cls is SampleBlockFactors:  # (cls, blocks, scales)
        blocks = [_unpack_factors(block, buffer) for block in held_dtype]
        return SampleBlockFactors(blocks, state)
    factors = cls.__new__(cls)
    factors.__dict__.update(
        {
            name: _unpack(value, buffer) if isinstance(value, _Slot) else value
            for name, value in state.items()
        }
    )
    return factors.to(held_dtype)


def _pack_block(block: BlockResult, packer: _Packer) -> dict:
    groups = []
    for curvature in block.curvature:
        dtype = curvature.factor_dtype
        groups.append(
            {
                "batch": curvature.batch,
                "factor_dtype": dtype,
                "ggn": [_pack_factors(f, dtype, packer) for f in curvature.ggn_factors],
                "grad": [
                    _pack_factors(f, dtype, packer) for f in curvature.grad_factors
                ],
            }
        )
    return {"groups": groups, "loss": packer.add(block.output.loss)}


def _unpack_block(
    description: dict, buffer: Tensor, param_groups: list[list[Tensor]]
) -> BlockResult:
    curvature = [
        GroupCurvature(
            params=params,
            batch=group["batch"],
            factor_dtype=group["factor_dtype"],
            gram=None,
            ggn_factors=[_unpack_factors(f, buffer) for f in group["ggn"]],
            grad_factors=[_unpack_factors(f, buffer) for f in group["grad"]],
        )
        for params, group in zip(param_groups, description["groups"], strict=True)
    ]
    gradients = [
        block_gradient(factors, group.batch, buffer.device).to(param.dtype)
        for group in curvature
        for factors, param in zip(group.grad_factors, group.params, strict=True)
    ]
    loss = _unpack(description["loss"], buffer)
    return BlockResult(curvature, EngineOutput(loss=loss, gradients=gradients))


def block_gradient(
    grad_factors: ParamFactors, batch: BatchInfo, device: torch.device
) -> Tensor:
    """``∇L_b = R_b Σ_n ∇ℓ_n`` of a block from its per-sample gradient factors.

    The per-sample gradients are those of ``ℓ_n`` (``docs/math.rst``, "Losses"),
    so the gradient of the block's loss needs no exchange of its own.

    Args:
        grad_factors: One parameter's per-sample gradient factors (one column per
            sample).
        batch: The block's batch context (its ``R``).
        device: The factors' device.

    Returns:
        The gradient, shaped like the parameter.
    """
    ones = torch.full(
        (1, grad_factors.num_rows),
        batch.reduction_factor(),
        dtype=grad_factors.dtype,
        device=device,
    )
    return grad_factors.vmp(ones)[0]


def gram_block_owners(num_blocks: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Which rank forms which Gram block ``(a, b)``, ``a ≤ b``: round robin.

    Row-major order over the upper triangle, block ``i`` to rank ``i mod W``: a
    diagonal block (half the work, symmetric) alternates with cross blocks.

    Args:
        num_blocks: Number of sample blocks (ranks).
        world_size: Number of ranks.

    Returns:
        Each rank's blocks, in order.
    """
    pairs = [(a, b) for a in range(num_blocks) for b in range(a, num_blocks)]
    return [pairs[rank::world_size] for rank in range(world_size)]


def gram_block_entries(rows: Sequence[int], a: int, b: int) -> int:
    """Numbers sent for Gram block ``(a, b)``: a diagonal block's upper triangle.

    Args:
        rows: Gram rows of every sample block.
        a: Row block.
        b: Column block, ``b ≥ a``.

    Returns:
        ``rows[a]·(rows[a]+1)/2`` if ``a == b``, else ``rows[a]·rows[b]``.
    """
    return rows[a] * (rows[a] + 1) // 2 if a == b else rows[a] * rows[b]


def agree_across_ranks(group: dist.ProcessGroup, what: str, value: object) -> None:
    """Check that every rank of ``group`` holds the same ``value``.

    One ``all_gather_object``; every rank must call it.

    Args:
        group: The process group.
        what: What the value is, for the message.
        value: This rank's value (picklable, compared with ``==``).

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


class ShardExchange:
    """One construction's agreement and exchange across the ranks of a group.

    Use as a context manager around everything a rank does before the exchange:
    an exception that leaves it before this rank has taken part in both rounds
    is reported to the other ranks in the round they wait in (and re-raised
    here), so that every rank raises instead of waiting.

    Args:
        group: The process group, or ``None`` to run locally (every method then
            passes its input through).
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.report = ExchangeReport(world_size=self.world_size)
        self._rounds_left = 0 if group is None else 2

    def __enter__(self) -> ShardExchange:
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if exc is not None and self._rounds_left:
            self._rounds_left = 0
            summary = f"{type(exc).__name__}: {exc}"
            self._all_gather_object(_Failure(self.rank, summary))
        return False

    def _all_gather_object(self, item: object) -> list[object]:
        gathered: list[object] = [None] * self.world_size
        start = time.perf_counter()
        try:
            dist.all_gather_object(gathered, item, group=self.group)
        except BaseException:  # the group is broken: no further round
            self._rounds_left = 0
            raise
        self.report.metadata_bytes += len(pickle.dumps(item))
        self.report.seconds += time.perf_counter() - start
        return gathered

    def _round(self, item: object) -> list[object]:
        """One agreement round: every rank's item, or raise if a rank failed."""
        self._rounds_left -= 1
        gathered = self._all_gather_object(item)
        failures = [g for g in gathered if isinstance(g, _Failure)]
        if failures:
            self._rounds_left = 0
            raise DistributedError(
                "; ".join(
                    f"Rank {f.rank} of {self.world_size} failed ({f.summary})"
                    for f in failures
                )
                + ". No rank computed the curvature of the union of the shards; "
                "fix the failing rank's input (see its own error)."
            )
        return gathered

    def agree(self, fingerprint: dict[str, object], seed: int | None) -> int | None:
        """Check that every rank asks for the same; the run's MC seed (rank 0's).

        Args:
            fingerprint: This rank's request (:func:`request_fingerprint`).
            seed: This rank's Monte-Carlo base seed (``None`` for the exact GGN).

        Returns:
            Rank 0's seed.

        Raises:
            DistributedError: On every rank, if a rank failed before the backward
                pass or the requests differ (naming the ranks and options).
        """
        if self.group is None:
            return seed
        gathered = self._round((fingerprint, seed))
        first = gathered[0][0]
        differences = [
            _difference(rank, key, theirs[key], first[key])
            for rank, (theirs, _) in enumerate(gathered)
            for key in first
            if theirs.get(key) != first[key]
            and not (key == SAMPLE_SHAPE and None in (theirs.get(key), first[key]))
        ]
        if differences:
            self._rounds_left = 0
            raise DistributedError(
                "The ranks of the process group ask for different curvature: "
                + "; ".join(differences)
                + ". Every rank must pass the same options (only the data differ)."
            )
        return gathered[0][1]

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Element-wise: whether every rank's flag is true (one small collective).

        Args:
            flags: This rank's flags.

        Returns:
            The flags of all ranks, combined with ``and``.
        """
        if self.group is None:
            return flags
        gathered = self._all_gather_object(flags)
        return [all(column) for column in zip(*gathered, strict=True)]

    def gram(self, factors: Sequence[ParamFactors]) -> Tensor:
        """A group's Gram matrix ``Σ_p V_pᵀ V_p`` of the union, formed together.

        Rank ``r`` forms the blocks :func:`gram_block_owners` gives it (summed
        over the group's parameters; of a diagonal block only the upper
        triangle travels), the ranks all-gather them, and every rank assembles
        the same matrix, mirrored from its upper blocks (a collective: every
        rank calls it for the same groups in the same order).

        Args:
            factors: The group's factors of ``V`` over the union, one
                :class:`~vivit.gram.SampleBlockFactors` per parameter with one
                block per rank.

        Returns:
            ``[N·C, N·C]``, identical on every rank.
        """
        start = time.perf_counter()
        per_param = [
            f if isinstance(f, SampleBlockFactors) else SampleBlockFactors([f])
            for f in factors
        ]
        rows = [block.num_rows for block in per_param[0].blocks]
        bounds = [0]
        for size in rows:
            bounds.append(bounds[-1] + size)
        owners = gram_block_owners(len(rows), self.world_size)
        computed = []
        for a, b in owners[self.rank]:
            block = per_param[0].block_gram(a, b)
            for param in per_param[1:]:
                block.add_(param.block_gram(a, b))
            computed.append((a, b, block))
        device = computed[0][2].device
        upper = [torch.triu_indices(n, n, device=device).unbind() for n in rows]
        mine = [
            block[upper[a]] if a == b else block.reshape(-1) for a, b, block in computed
        ]
        # W(W+1)/2 blocks for W ranks: every rank owns at least one
        sizes = [sum(gram_block_entries(rows, a, b) for a, b in o) for o in owners]
        buffer = mine[0].new_zeros(max(sizes))
        buffer[: sizes[self.rank]].copy_(torch.cat(mine))
        gathered = [torch.empty_like(buffer) for _ in range(self.world_size)]
        dist.all_gather(gathered, buffer, group=self.group)
        gram = buffer.new_empty(bounds[-1], bounds[-1])
        for owned, data in zip(owners, gathered, strict=True):
            offset = 0
            for a, b in owned:
                size = gram_block_entries(rows, a, b)
                entries = data[offset : offset + size]
                offset += size
                block = gram[bounds[a] : bounds[a + 1], bounds[b] : bounds[b + 1]]
                if a == b:
                    block[upper[a]] = entries
                    block[upper[a][1], upper[a][0]] = entries
                else:
                    block.copy_(entries.view(rows[a], rows[b]))
                    mirror = gram[bounds[b] : bounds[b + 1], bounds[a] : bounds[a + 1]]
                    mirror.copy_(block.T)
        self.report.gram_buffer_bytes += buffer.numel() * buffer.element_size()
        self.report.gram_seconds += time.perf_counter() - start
        return gram

    def exchange(
        self,
        blocks: list[BlockResult],
        param_groups: list[list[Tensor]],
        sample_shape: tuple[int, ...] | None = None,
    ) -> list[BlockResult]:
        """Every rank's block, in rank order, rebuilt from the exchanged bytes.

        Args:
            blocks: This rank's block (exactly one: its shard, or all its
                loader's batches combined).
            param_groups: The parameter groups, to attach to the rebuilt curvature.
            sample_shape: The shape per sample of this rank's targets, compared
                across the ranks in the block round.

        Returns:
            One block per rank, identical on every rank.

        Raises:
            DistributedError: If another rank failed before the exchange, or
                the ranks' targets differ in shape per sample (on every rank).
        """
        if self.group is None:
            return blocks
        (block,) = blocks
        start, before = time.perf_counter(), self.report.seconds
        packer = _Packer()
        description = _pack_block(block, packer)
        gathered = self._round((description, packer.size, packer.payload, sample_shape))
        shapes = [shape for *_, shape in gathered]
        differences = [
            _difference(rank, SAMPLE_SHAPE, shape, shapes[0])
            for rank, shape in enumerate(shapes)
            if shape != shapes[0]
        ]
        if differences:
            raise DistributedError("; ".join(differences))
        size = max(size for _, size, _, _ in gathered)
        device = block.output.loss.device
        buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        packer.fill(buffer)
        buffers = [torch.empty_like(buffer) for _ in range(self.world_size)]
        dist.all_gather(buffers, buffer, group=self.group)
        rebuilt = [
            _unpack_block(desc, data, param_groups)
            for (desc, *_), data in zip(gathered, buffers, strict=True)
        ]
        self.report.payload_bytes = [payload for _, _, payload, _ in gathered]
        self.report.buffer_bytes = size
        # the whole exchange, the block round (which timed itself) included
        self.report.seconds = before + time.perf_counter() - start
        return rebuilt
