"""The one place that makes rings: create a producer's ring, import a consumer's, and ``transport.backend =
"auto"`` (:func:`choose_backend`).

A backend's module is named by its row of :data:`~dflash_ipc.config.transport.BACKENDS` and imported when a
ring of it is made; it provides two functions with one signature for every backend::

    create_producer(layout, num_slots, run_id, producer_rank, device, host, timeout_s) -> ProducerRing
    open_consumer(descriptor, device, consumer_rank, timeout_s) -> ConsumerRing

(``host``/``timeout_s``: where an off-host ring's consumers meet its producer, and how long they may take;
``consumer_rank``: the consumer's place in such a ring). Importing this module needs no GPU: the CUDA
backends touch CUDA only when a ring is made.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from dflash_ipc.config.transport import BACKENDS
from dflash_ipc.control.ring_descriptor import DESCRIPTOR_VERSION, RingDescriptor
from dflash_ipc.platform.devices import DeviceLike, as_device, cuda_device
from dflash_ipc.transport.p2p import PAIR_TIMEOUT_S
from dflash_ipc.transport.ring import ConsumerRing, ProducerRing
from dflash_ipc.transport.slots import SlotLayout


def backend_module(backend: str):
    """The transport module that makes ``backend``'s rings."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown transport backend {backend!r}; use one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[backend].module)


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
    """``host``/``timeout_s``: where an off-host ring's consumers meet it (``nccl``), and how long they may take."""
    return backend_module(backend).create_producer(layout, num_slots, run_id, producer_rank, device, host, timeout_s)


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
    return backend_module(descriptor.backend).open_consumer(descriptor, local_device, consumer_rank, timeout_s)


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
