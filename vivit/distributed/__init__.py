"""The curvature of the union of the shards of a ``torch.distributed`` group.

Every rank of a process group computes the curvature of its own shard (one block
of samples, :class:`~vivit.sources.runs.PartResult`; a loader's batches
combined into one); :class:`ShardExchange` hands every rank's block to every other
with ``torch.distributed`` collectives, and each rank combines the blocks in rank
order (:func:`~vivit.sources.union.combine_curvatures`), exactly
as a single process combines the batches of a loader over the same shards.
``docs/math.rst`` ("Data sets and processes", "Several processes") gives the
scalings and the cost model.

Protocol of one construction:

1. *Route round* (``all_gather_object``): every rank sends the solver it asked
   for and the route it chose from its own shard; every rank runs the route
   :func:`~vivit.sources.route.agreed_route` decides from all of them
   (:meth:`ShardExchange.decide`).
2. *Request round* (``all_gather_object``, before the backward pass): every rank
   sends a fingerprint of its request (MC samples, ``gram_dtype``, loss options,
   parameter shapes, solver, checksums of the model's parameters and buffers)
   and its Monte-Carlo seed. A mismatch is refused on
   every rank; all ranks use rank 0's seed.
3. *Shard round* (``all_gather_object``, after the local backward pass): every
   rank sends whether it succeeded and, if so, the description of its block
   (batch context, factor types and tensor shapes, byte offsets) and its
   targets' shape per sample (a loader's is known only now). A failure on
   any rank is raised on every rank (the failing rank re-raises its own error,
   the others :class:`~vivit.errors.DistributedError` naming it), so no rank
   waits for data that never comes.
4. *Data* (``all_gather`` of one byte buffer per rank, padded to the longest):
   the tensors of every block (factors of ``V`` in the model's type, per-sample
   gradient factors, the loss), bit for bit
   (:mod:`~vivit.distributed.packing`). The gradient of each block's loss is
   ``R_b Σ_n ∇ℓ_n`` of its per-sample gradient factors
   (:func:`~vivit.distributed.packing.shard_gradient`).
5. *Gram matrices* (one ``all_gather_object`` of whether they fit on each rank,
   then one ``all_gather`` per group, :meth:`ShardExchange.gram`): each rank
   forms its share of the blocks ``V_aᵀ V_b``
   (:func:`~vivit.distributed.gram.gram_block_owners`); skipped for the
   matrix-free solver.

The implicit route (:mod:`vivit.sources.implicit`) exchanges no factors: its
shard round carries each rank's batch context and loss
(:meth:`ShardExchange.shard_contexts`), one ``all_reduce`` sums the gradients,
and after the construction every product, ``γ``/``λ`` pass and memory check is
a call all ranks make together (:mod:`~vivit.distributed.lockstep`).

On the Gram route every rank rebuilds every block, its own included, from the
gathered bytes, and assembles the same Gram matrices. Everything that follows
(eigenpairs, ``γ``, ``λ``, Newton steps) each rank computes from the same bytes
with the same operations: the results are identical on every rank (given the
same library versions, device type and number of threads), without any further
communication, so later calls may come in any order and number on each rank.

Modules, one job each: :mod:`~vivit.distributed.group` (which group, which
module), :mod:`~vivit.distributed.agreement` (fingerprints, agreement, failures
raised on every rank), :mod:`~vivit.distributed.layout` (where each rank's
samples sit, what an exchange cost), :mod:`~vivit.distributed.packing` (blocks as
byte buffers), :mod:`~vivit.distributed.gram` (the Gram matrix formed together),
:mod:`~vivit.distributed.exchange` (the rounds of collectives of a
construction) and :mod:`~vivit.distributed.lockstep` (the implicit route's
calls after it).
"""

from vivit.distributed.agreement import (
    SAMPLE_SHAPE,
    agree_across_ranks,
    request_fingerprint,
)
from vivit.distributed.exchange import ShardExchange
from vivit.distributed.gram import gram_block_owners
from vivit.distributed.group import local_module, resolve_group
from vivit.distributed.layout import ExchangeReport, ShardLayout
from vivit.distributed.packing import ALIGNMENT

__all__ = [
    "ALIGNMENT",
    "SAMPLE_SHAPE",
    "ExchangeReport",
    "ShardExchange",
    "ShardLayout",
    "agree_across_ranks",
    "gram_block_owners",
    "local_module",
    "request_fingerprint",
    "resolve_group",
]
