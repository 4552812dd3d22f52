"""The curvature of the union of the shards of a ``torch.distributed`` group.

Every rank computes its shard's curvature and all combine the shards in rank
order (``docs/math.rst``, "Several processes", "Implicit products on several
processes").
"""

from vivit.distributed.agreement import (
    SAMPLE_SHAPE,
    agree_across_ranks,
    request_fingerprint,
)
from vivit.distributed.exchange import ShardExchange
from vivit.distributed.gram import gram_block_owners
from vivit.distributed.group import resolve_group
from vivit.distributed.layout import ExchangeReport, ShardLayout
from vivit.distributed.packing import ALIGNMENT
from vivit.distributed.sharded import ParamPlacement, local_view

__all__ = [
    "ALIGNMENT",
    "SAMPLE_SHAPE",
    "ExchangeReport",
    "ParamPlacement",
    "ShardExchange",
    "ShardLayout",
    "agree_across_ranks",
    "gram_block_owners",
    "local_view",
    "request_fingerprint",
    "resolve_group",
]
