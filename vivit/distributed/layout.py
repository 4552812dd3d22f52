"""Where each rank's samples sit in the union, and what an exchange cost."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from vivit.engines.base import BatchInfo


@dataclass(frozen=True)
class ShardLayout:
    """Where each rank's samples sit in the union (rank order).

    Every result over samples (rows of ``γ`` and ``λ``, Gram-space entries)
    covers the union; these ranges pick a rank's own.

    Attributes:
        rank: This process's rank in the group (``0`` locally; ``world_size`` 1).
        samples: Each rank's samples as positions in the union batch (rows of
            ``γ``; indices for ``subsampling_grad``).
        ggn_samples: Each rank's GGN samples as positions among the union's
            (rows of ``λ``; Gram-space entries ``n·C + c`` of these ``n``).
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
        """The layout of blocks in rank order: one per rank (locally, one spans all)."""
        per_rank = [batches] if world_size == 1 else [[batch] for batch in batches]

        def ranges(size: Callable[[BatchInfo], int]) -> tuple[range, ...]:
            bounds = [0, *accumulate(sum(map(size, owned)) for owned in per_rank)]
            return tuple(map(range, bounds[:-1], bounds[1:]))

        samples = ranges(lambda b: b.batch_size)
        return cls(rank, world_size, samples, ranges(lambda b: len(b.ggn_samples)))


@dataclass
class ExchangeReport:
    """What the ranks exchanged: at construction and, on the implicit route, since.

    All zero in one process; the cost model: ``docs/math.rst``, "Several processes".

    Attributes:
        payload_bytes: Bytes of every rank's tensors (rank order), unpadded.
        buffer_bytes: Length of every rank's buffer in the all-gather (the
            longest payload, tensors aligned to ``ALIGNMENT``).
        metadata_bytes: Pickled bytes of this rank's ``all_gather_object`` messages.
        seconds: Wall time of the agreement rounds and the exchange of the
            blocks (waiting for the slowest rank included).
        gram_buffer_bytes: Length of every rank's buffer of Gram blocks, summed
            over the Gram matrices formed together (``gram_seconds``: their time).
        reductions: ``all_reduce`` calls of the implicit route so far (the
            gradient, then one per product ``G V``); ``reduced_bytes``: this
            rank's bytes in them; ``reduction_seconds``: their time and rounds'.
    """

    world_size: int = 1
    payload_bytes: list[int] = field(default_factory=lambda: [0])
    buffer_bytes: int = 0
    metadata_bytes: int = 0
    seconds: float = 0.0
    gram_buffer_bytes: int = 0
    gram_seconds: float = 0.0
    reductions: int = 0
    reduced_bytes: int = 0
    reduction_seconds: float = 0.0

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends: each buffer to every other rank (no all-reduce)."""
        return (self.buffer_bytes + self.gram_buffer_bytes) * (self.world_size - 1)

    @property
    def received_bytes(self) -> int:
        """Bytes this rank receives: every other rank's buffers."""
        return self.sent_bytes
