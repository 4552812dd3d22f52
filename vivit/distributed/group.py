"""Which process group a construction exchanges over."""

from __future__ import annotations

import torch.distributed as dist

from vivit.errors import InvalidArgumentError


def resolve_group(process_group: object) -> dist.ProcessGroup | None:
    """The process group whose shards form the union, or ``None`` to run locally.

    ``process_group``: ``None`` for the default group if ``torch.distributed`` is
    initialised (else local), ``False`` for local, or a ``ProcessGroup`` (local
    if of one rank).

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
