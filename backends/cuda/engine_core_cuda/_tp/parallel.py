"""The tensor-parallel process group: ``nccl`` on CUDA devices (or ``gloo`` when asked, e.g. two
ranks sharing one GPU), ``gloo`` on the CPU; rendezvous through a file store in the engine's
private directory (no TCP port on one node)."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from engine_core_cuda._device import apply_cpu_threads, resolve_cpu_threads

__all__ = ["DISTRIBUTED_BACKENDS", "TensorParallel", "init_distributed", "share_cpu"]

logger = logging.getLogger(__name__)

DISTRIBUTED_BACKENDS = ("nccl", "gloo")
STARTUP_TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallel:
    """One rank's view of the group: its rank, the size, the two collectives the sharded model
    needs, and the broadcast of rank 0's sampled ids."""

    def __init__(self, rank: int, size: int, backend: str) -> None:
        self.rank = rank
        self.size = size
        self.backend = backend

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (on the current stream with NCCL: the ranks'
        later work on the stream sees it without a host synchronization); returns it."""
        dist.broadcast(x, src=0)
        return x

    def gather_columns(self, local: torch.Tensor, total: int) -> torch.Tensor:
        """``[rows, size * cols]`` from every rank's ``[rows, cols]`` slice, cut to ``total``
        columns. An all-reduce of zero-padded slices (exact: it adds zeros), because gloo has
        no all-gather for CUDA tensors."""
        rows, cols = local.shape
        full = local.new_zeros(rows, self.size * cols)
        full[:, self.rank * cols : (self.rank + 1) * cols] = local
        return self.all_reduce(full)[:, :total]

    def abort(self) -> None:
        """Unblock this rank from a collective whose peer died (NCCL); gloo's collectives fail
        by themselves when a peer's sockets close."""
        if self.backend == "nccl":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def share_cpu(device: torch.device, size: int, cpu_threads: int | None = None) -> None:
    """Ranks on the CPU share its cores: more threads than cores make OpenMP's spinning threads
    starve the peer a collective waits for (a step then takes ~100x longer). Call it on the
    thread that runs the model (OpenMP's thread count is per thread); ``cpu_threads``: the
    ``backend_options`` value, per rank."""
    if device.type == "cpu":
        apply_cpu_threads(resolve_cpu_threads(cpu_threads, size).threads)


def init_distributed(
    rank: int, size: int, directory: str, device: torch.device, backend: str | None
) -> TensorParallel:
    """Join the group of ``size`` ranks whose store lives in ``directory``."""
    chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
    if chosen not in DISTRIBUTED_BACKENDS:
        raise ValueError(
            f"distributed backend must be one of {DISTRIBUTED_BACKENDS}, got {chosen!r}"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(str(Path(directory, "store")), size)
    dist.init_process_group(
        chosen,
        store=store,
        rank=rank,
        world_size=size,
        timeout=STARTUP_TIMEOUT,
        device_id=device if chosen == "nccl" else None,
    )
    logger.info("tensor-parallel rank %d of %d joined (%s on %s)", rank, size, chosen, device)
    return TensorParallel(rank, size, chosen)
