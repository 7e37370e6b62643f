"""The one place that picks a ring backend: create a producer's ring, import a consumer's, and
``transport.backend = "auto"`` (:func:`choose_backend`).

Importing this module needs no GPU: the CUDA backends touch CUDA only when a ring is made.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_ipc.control.ring_descriptor import (
    BACKENDS,
    DESCRIPTOR_VERSION,
    RingDescriptor,
)
from dflash_ipc.platform.devices import DeviceLike, as_device, cuda_device
from dflash_ipc.transport.cpu_shm import CpuShmConsumerRing, CpuShmProducerRing
from dflash_ipc.transport.cuda_ipc import CudaIpcConsumerRing, CudaIpcProducerRing
from dflash_ipc.transport.host_pinned import (
    HostPinnedConsumerRing,
    HostPinnedProducerRing,
)
from dflash_ipc.transport.p2p import PAIR_TIMEOUT_S, P2PConsumerRing, P2PProducerRing
from dflash_ipc.transport.ring import ConsumerRing, ProducerRing
from dflash_ipc.transport.slots import SlotLayout


def create_producer_ring(
    backend: str,
    layout: SlotLayout,
    num_slots: int,
    *,
    run_id: str,
    producer_rank: int,
    device: DeviceLike = "cpu",
    host: str = "127.0.0.1",
    timeout_s: float = PAIR_TIMEOUT_S,
) -> ProducerRing:
    """``host``/``timeout_s``: where an ``nccl`` ring's consumers meet it, and how long they may take."""
    if backend == "cpu-shm":
        return CpuShmProducerRing(layout, num_slots, run_id, producer_rank)
    if backend == "cuda-ipc":
        return CudaIpcProducerRing(layout, num_slots, run_id, producer_rank, cuda_device(device))
    if backend == "host-pinned":
        return HostPinnedProducerRing(layout, num_slots, run_id, producer_rank, cuda_device(device))
    if backend == "nccl":
        return P2PProducerRing(layout, num_slots, run_id, producer_rank, as_device(device), host, timeout_s)
    raise ValueError(f"unknown transport backend {backend!r}; use one of {', '.join(BACKENDS)}")


def open_consumer_ring(
    descriptor: RingDescriptor, local_device: DeviceLike = "cpu", *, consumer_rank: int | None = None, timeout_s: float = PAIR_TIMEOUT_S
) -> ConsumerRing:
    """Import a producer's ring once; keep the returned object for the consumer's life. An
    ``nccl`` ring needs ``consumer_rank`` (it joins the pair's group as that consumer)."""
    if descriptor.version != DESCRIPTOR_VERSION:
        raise ValueError(
            f"ring descriptor version {descriptor.version}, this build reads {DESCRIPTOR_VERSION}: "
            "run every process of a run from the same install"
        )
    backend = descriptor.backend
    if backend == "cpu-shm":
        return CpuShmConsumerRing(descriptor)
    if backend == "cuda-ipc":
        return CudaIpcConsumerRing(descriptor, cuda_device(local_device))
    if backend == "host-pinned":
        return HostPinnedConsumerRing(descriptor, cuda_device(local_device))
    if backend == "nccl":
        if consumer_rank is None:
            raise ValueError("opening an nccl ring needs the consumer's rank")
        return P2PConsumerRing(descriptor, consumer_rank, as_device(local_device), timeout_s)
    raise ValueError(f"unknown transport backend {backend!r}; use one of {', '.join(BACKENDS)}")


def choose_backend(producer_device: DeviceLike, consumer_devices: Sequence[DeviceLike]) -> tuple[str, str]:
    """``transport.backend = "auto"``: (backend, reason). cuda-ipc when every consumer GPU is the
    producer's GPU or has peer access with it both ways, host-pinned otherwise; cpu-shm when
    the producer or a consumer is not on a GPU. Never ``nccl``: that one is for consumers on
    other hosts and is asked for by name. The caller logs the reason."""
    pd = as_device(producer_device)
    cds = [as_device(d) for d in consumer_devices]
    if pd.type != "cuda":
        return "cpu-shm", f"producer device is {pd}"
    if not torch.cuda.is_available():
        return "cpu-shm", "CUDA is not available"
    not_gpu = [str(d) for d in cds if d.type != "cuda"]
    if not_gpu:
        return "cpu-shm", f"consumer device(s) {', '.join(not_gpu)} not on a GPU"
    p = cuda_device(pd).index
    peers, missing = set(), []
    for d in cds:
        c = cuda_device(d).index
        if c == p:
            continue
        if torch.cuda.can_device_access_peer(p, c) and torch.cuda.can_device_access_peer(c, p):
            peers.add(c)
        else:
            missing.append(c)
    if missing:
        lst = ", ".join(f"cuda:{p}<->cuda:{c}" for c in sorted(set(missing)))
        return "host-pinned", f"no CUDA peer access for {lst}: staging through page-locked host memory"
    if not peers:
        return "cuda-ipc", f"every consumer is on the producer's GPU cuda:{p}"
    lst = ", ".join(f"cuda:{c}" for c in sorted(peers))
    return "cuda-ipc", f"cuda:{p} has peer access with {lst}" + (" (others on the same GPU)" if len(peers) < len(cds) else "")


def resolve_backend(backend: str, producer_device: DeviceLike, consumer_devices: Sequence[DeviceLike]) -> tuple[str, str]:
    """``transport.backend`` as configured, or auto's choice (:func:`choose_backend`); with the reason to log."""
    if backend != "auto":
        return backend, "transport.backend"
    chosen, reason = choose_backend(producer_device, consumer_devices)
    return chosen, f"transport.backend = auto: {reason}"
