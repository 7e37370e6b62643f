"""The drafters' process group: rendezvous (loopback-bound for one host, env:// across hosts), rank info.

Every drafter of every node joins one torch.distributed group (NCCL on GPU, gloo on CPU);
:class:`DistInfo` is what the trainer and checkpoints need to know of it.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dflash_ipc.transport.rendezvous import is_loopback, tcp_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the drafter data-parallel group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> DistInfo:
        """A world of one, no process group."""
        device = torch.device(device)
        return cls(0, 1, 0, device, "nccl" if device.type == "cuda" else "gloo")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Device of tensors used for small control collectives."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        if self.is_distributed:
            if self.backend == "nccl" and self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def init_distributed(
    backend: str = "gloo",
    timeout_s: float = 1800.0,
    *,
    device: str | torch.device | None = None,
) -> DistInfo:
    """Join the drafter process group through the standard env rendezvous.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT`` through
    ``init_method="env://"``, so the group may span nodes). With ``WORLD_SIZE`` unset or 1 no
    process group is created. ``device`` overrides the default device (``cuda:LOCAL_RANK`` for
    nccl, ``cpu`` for gloo); for nccl the device is made current and passed as ``device_id``.

    With a loopback ``MASTER_ADDR`` (single-host runs: the supervisor sets 127.0.0.1) nothing listens
    beyond the host: the store binds ``MASTER_ADDR`` (torch's listens on ``::``), gloo binds ``lo``.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl' (got {backend!r})")
    if not (timeout_s > 0):
        raise ValueError(f"timeout_s must be > 0 (got {timeout_s})")
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if world_size < 1 or not (0 <= rank < world_size):
        raise ValueError(f"invalid RANK={rank} / WORLD_SIZE={world_size}")
    if device is None:
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"nccl needs a cuda device (got {device}); use backend='gloo'")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    info = DistInfo(rank, world_size, local_rank, device, backend)
    if world_size == 1:
        return info
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a process group already exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"but the environment says {rank}/{world_size}"
            )
        return info
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(var):
            raise RuntimeError(f"WORLD_SIZE={world_size} but {var} is not set; set MASTER_ADDR and MASTER_PORT")
    kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size, "timeout": timedelta(seconds=timeout_s)}
    master_addr, master_port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0)
    if is_loopback(master_addr):
        store = tcp_store(master_addr, master_port, rank == 0, kwargs["timeout"], world_size=world_size)
        kwargs["store"] = dist.PrefixStore("default_pg", store)  # the key prefix init_method="env://" would use
        if backend == "gloo":  # else gloo binds the hostname's address, often a LAN one; a user's setting wins
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        kwargs["init_method"] = "env://"  # several hosts: the store must be reachable from them
    if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    log.debug("joined %s process group: rank %d/%d on %s", backend, rank, world_size, device)
    return info


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
