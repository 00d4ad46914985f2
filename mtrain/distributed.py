"""torchrun/DDP plumbing: who am I (rank, world size), process-group setup, and reductions that
fall back to no-ops in a single process, so the training loop reads the same either way."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def from_env() -> DistInfo:
    """Read the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK); one process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    return DistInfo(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))


# How long a collective waits for the other ranks before the run is killed. Rank 0 alone validates
# (decoding the validation split), averages and writes checkpoints while the others wait at the next
# collective; NCCL's default of 10 minutes would kill a run whose validation set or model is large.
TIMEOUT = datetime.timedelta(hours=2)


def setup(info: DistInfo, device: torch.device) -> None:
    """Join the process group: NCCL between GPUs, gloo on CPU, waiting up to TIMEOUT in a collective."""
    if info.enabled and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size, timeout=TIMEOUT)


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor over ranks (in place); identity in a single process."""
    if info.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_flag(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """Rank 0's decision (stop, early-stop) for everyone."""
    if not info.enabled:
        return flag
    tensor = torch.tensor([1 if flag else 0], device=device)
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True when any rank raises the flag (a signal that reached one rank stops all)."""
    if not info.enabled:
        return flag
    tensor = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
