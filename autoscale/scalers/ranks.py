"""Agreement across ranks: every rank of a process group takes the same scale decision.

Under ``torch.distributed`` each rank's scaler sees its own gradients (unless DDP already averaged
them) and its own loss. :class:`RankAgreement` says which group a scaler agrees over (none when
not distributed, on one rank, or when the gradients are identical and the rule reads no loss),
checks once that the ranks of a group use it alike (instead of hanging in a collective some rank
never joins), and gathers each rank's packed step (:mod:`~autoscale.scalers.step_vector`) with
one collective.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from autoscale.errors import ConfigError

__all__ = ["RankAgreement"]

_DIST = dist.is_available()  # (fixed by the build: asked once, not every step)


class RankAgreement:
    """The process group a scaler agrees over, checked once.

    Args:
        process_group: A ``torch.distributed`` ProcessGroup, or None for the world group.
        identical_grads: The gradients are already identical on every rank: no collective
            unless the rule reads the loss.
    """

    def __init__(self, process_group: Any = None, identical_grads: bool = False) -> None:
        if process_group is not None and not (
            dist.is_available() and isinstance(process_group, dist.ProcessGroup)
        ):
            raise ConfigError(
                f"process_group must be a torch.distributed ProcessGroup (from new_group), got "
                f"{type(process_group).__name__}; or leave it out for the world group"
            )
        self.process_group = process_group
        self.identical_grads = bool(identical_grads)
        self.checked = False  # the one-time handshake of the ranks

    def group(self, device: torch.device, needs_loss: bool) -> Any:
        """The group decisions are agreed over, or None when there is nothing to agree."""
        if not (_DIST and dist.is_initialized()):
            if self.process_group is not None:
                raise ConfigError(
                    "process_group was given but torch.distributed is not initialized; call "
                    "torch.distributed.init_process_group first, or drop process_group"
                )
            return None
        group = self.process_group or dist.group.WORLD
        if not self.checked:
            self._handshake(group, device)
        if dist.get_world_size(group) <= 1 or (self.identical_grads and not needs_loss):
            return None
        return group

    def gather(self, local: torch.Tensor, group: Any) -> list[torch.Tensor]:
        """Every rank's ``local`` (one all_gather over ``group``)."""
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, local, group=group)
        return rows

    @staticmethod
    def max_loss(loss: torch.Tensor, group: Any) -> torch.Tensor:
        """The largest ``|loss|`` over the group, in place (a NaN on any rank counts as inf)."""
        loss = torch.nan_to_num(loss, nan=math.inf)
        dist.all_reduce(loss, op=dist.ReduceOp.MAX, group=group)
        return loss

    def _handshake(self, group: Any, device: torch.device) -> None:
        """Once, over every rank: check that this rank is in its group and that the ranks of a
        group agree on it (its size, and whether gradients are identical); else every rank raises
        the same error instead of hanging in a collective the others never join."""
        self.checked = True
        world, rank = dist.get_world_size(), dist.get_rank()
        size = dist.get_world_size(group)
        member = dist.get_rank(group) >= 0 if group is not dist.group.WORLD else True
        ranks = dist.get_process_group_ranks(group) if member else []
        key = float(sum((r + 1) * 7919**i for i, r in enumerate(ranks)) % 2**40)
        mine = torch.tensor(
            [float(member), float(size), key, float(self.identical_grads)], device=device
        )
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        rows = [t.tolist() for t in gathered]
        if not member:
            raise ConfigError(
                f"rank {rank} is not a member of the process_group given to its scaler; give each "
                "rank a group it belongs to (or none: the world group)"
            )
        peers = [r for r in range(world) if rows[r][2] == key]
        if len(peers) != size:
            raise ConfigError(
                f"the ranks of rank {rank}'s process group ({len(ranks)} ranks: {ranks}) do not all "
                f"use that group for their scaler ({len(peers)} do); every rank of a group must pass "
                "the same process_group"
            )
        flags = {rows[r][3] for r in peers}
        if len(flags) > 1:
            raise ConfigError(
                f"the ranks of process group {ranks} disagree on identical_grads; pass the same value "
                "on every rank (True only where DDP has already averaged the gradients)"
            )
