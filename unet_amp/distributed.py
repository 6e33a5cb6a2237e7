"""torchrun: one process per device. Module-level facts, as nanoGPT's ddp variables: nothing is threaded through."""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world: int = 1

    @property
    def enabled(self):
        return self.world > 1

    @property
    def is_main(self):
        return self.rank == 0


DIST = Dist()


def setup(device_kind):
    """Join the torchrun job (NCCL on CUDA, gloo elsewhere); a single process is left alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DIST
    DIST.rank, DIST.local_rank, DIST.world = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), world
    if device_kind == "cuda":
        torch.cuda.set_device(DIST.local_rank)
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    return DIST


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()
    DIST.rank, DIST.local_rank, DIST.world = 0, 0, 1


def all_reduce_(tensor):
    """Sum `tensor` over the processes in place (a no-op in one process); returns it."""
    if DIST.enabled:
        dist.all_reduce(tensor)
    return tensor


def broadcast_object(obj):
    """Rank 0's `obj` on every process (decisions made once: the CPU probe, the data check)."""
    if not DIST.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gradient_sync(model, now):
    """DDP all-reduces gradients only where `now` (an accumulation group's last micro-batch); elsewhere no-op."""
    if DIST.enabled and not now and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
