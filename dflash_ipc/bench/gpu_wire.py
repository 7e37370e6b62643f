"""Typed messages of the GPU ring harness, sent as msgpack over a ``multiprocessing.Pipe``.

Every message is a :class:`~dflash_ipc.control.protocol.Struct`, framed as
``{"t": <class name>, "m": <fields>}`` and validated on receipt like any control-plane payload;
nothing is ever pickled (the ring descriptor included). Who sends what::

    parent -> both          Scenario list (spawn arguments, msgpack bytes)
    producer -> consumer    RingOpen(descriptor), SlotFilled, EndOfSlots
    consumer -> producer    RingOpened, SlotReturned, ConsumerClosed(figures)
    child -> parent         ProducerDone(figures) / ConsumerDone / ChildFailed(traceback)
    sigkill check           RingOpen, SlotFilled -> Copied -> Holding* -> CloseRing -> RingClosed
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

import msgpack

from dflash_ipc.control.protocol import ProtocolError, Struct, from_wire, to_wire
from dflash_ipc.control.ring_descriptor import RingDescriptor, SlotLayoutWire

T = TypeVar("T", bound=Struct)

MODES = ("stream", "lockstep")
SIZES = ("full", "random")
VERIFY = ("full", "sample", "none")
FILLS = ("pattern", "none")


@dataclass(frozen=True)
class Scenario(Struct):
    """One ring scenario (see ``gpu_ring.scenario``). Devices: a CUDA index, or -1 for the CPU."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"num_slots", "iters", "warmup", "depth", "seed", "producer_delay_us"})
    name: str
    backend: str
    producer_device: int
    consumer_device: int
    layout: SlotLayoutWire
    num_slots: int = 4
    iters: int = 100
    warmup: int = 5
    depth: int = 3
    mode: str = "stream"
    sizes: str = "full"
    verify: str = "sample"
    early_return: bool = False
    seed: int = 0
    producer_delay_us: float = 0.0
    fill: str = "pattern"
    in_place: bool = False  # the consumer reads each slot where it lies (read_in_place / reads_done), no copy

    def __post_init__(self) -> None:
        for name, allowed in (("mode", MODES), ("sizes", SIZES), ("verify", VERIFY), ("fill", FILLS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Scenario.{name} = {getattr(self, name)!r}; use one of {', '.join(allowed)}")
        if self.fill == "none" and self.verify != "none":
            raise ValueError("Scenario: fill='none' writes nothing to verify; set verify='none'")
        if self.num_slots < 1 or self.depth < 1:
            raise ValueError("Scenario: num_slots and depth must be >= 1")


@dataclass(frozen=True)
class ScenarioList(Struct):
    scenarios: list[Scenario]


@dataclass(frozen=True)
class RingOpen(Struct):
    descriptor: RingDescriptor


@dataclass(frozen=True)
class RingOpened(Struct):
    pass


@dataclass(frozen=True)
class SlotFilled(Struct):
    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"slot", "seq", "n_tokens", "n_seqs", "committed_ns"})
    slot: int
    seq: int
    n_tokens: int
    n_seqs: int
    committed_ns: int = 0  # the producer's perf_counter_ns() at commit


@dataclass(frozen=True)
class SlotReturned(Struct):
    slot: int
    seq: int


@dataclass(frozen=True)
class EndOfSlots(Struct):
    pass


@dataclass(frozen=True)
class ConsumerFigures(Struct):
    copy_mode: str
    open_s: float
    slots: int
    bytes: int
    errors: int
    gbps: float | None
    handoff_us_p50: float
    handoff_us_p99: float
    copy_out_call_us_p50: float


@dataclass(frozen=True)
class ConsumerClosed(Struct):
    figures: ConsumerFigures


@dataclass(frozen=True)
class ProducerFigures(Struct):
    create_s: float
    stray_frees: int
    commit_us_p50: float
    roundtrip_us_p50: float
    roundtrip_us_p99: float
    consumer: ConsumerFigures


@dataclass(frozen=True)
class ProducerDone(Struct):
    results: list[ProducerFigures]


@dataclass(frozen=True)
class ConsumerDone(Struct):
    pass


@dataclass(frozen=True)
class ChildFailed(Struct):
    error: str


# --- the SIGKILL check


@dataclass(frozen=True)
class Copied(Struct):
    errors: int


@dataclass(frozen=True)
class ConsumerHolding(Struct):
    pid: int
    errors: int


@dataclass(frozen=True)
class ProducerHolding(Struct):
    free0: int
    free1: int
    ring_bytes: int
    consumer_errors: int


@dataclass(frozen=True)
class CloseRing(Struct):
    pass


@dataclass(frozen=True)
class RingClosed(Struct):
    free_before_close: int
    free_after_close: int
    close_s: float
    released_bytes: int


MESSAGES: dict[str, type[Struct]] = {
    cls.__name__: cls
    for cls in (
        ScenarioList,
        RingOpen,
        RingOpened,
        SlotFilled,
        SlotReturned,
        EndOfSlots,
        ConsumerClosed,
        ProducerDone,
        ConsumerDone,
        ChildFailed,
        Copied,
        ConsumerHolding,
        ProducerHolding,
        CloseRing,
        RingClosed,
    )
}


class HarnessError(RuntimeError):
    pass


def pack(msg: Struct) -> bytes:
    return msgpack.packb({"t": type(msg).__name__, "m": to_wire(msg)}, use_bin_type=True)


def unpack(data: bytes, *expected: type[T]) -> T:
    """Decode one frame as one of ``expected``; a ChildFailed becomes a HarnessError with the
    child's traceback, anything else unexpected a HarnessError naming it."""
    try:
        frame = msgpack.unpackb(data, raw=False)
        cls = MESSAGES.get(frame["t"]) if isinstance(frame, dict) and isinstance(frame.get("t"), str) else None
        if cls is None:
            raise ProtocolError("unknown_type", f"not a harness message: {frame!r:.80}")
        msg = from_wire(cls, frame.get("m"))
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("undecodable", f"{type(e).__name__}: {e}") from None
    if isinstance(msg, ChildFailed) and ChildFailed not in expected:
        raise HarnessError(f"the other side failed:\n{msg.error}")
    if not isinstance(msg, expected):
        raise HarnessError(f"expected {' or '.join(c.__name__ for c in expected)}, got {type(msg).__name__}")
    return msg


def send(conn, msg: Struct) -> None:
    conn.send_bytes(pack(msg))


def recv(conn, *expected: type[T], timeout: float | None = None) -> T:
    if timeout is not None and not conn.poll(timeout):
        raise TimeoutError(f"no {' or '.join(c.__name__ for c in expected)} within {timeout} s")
    return unpack(conn.recv_bytes(), *expected)
