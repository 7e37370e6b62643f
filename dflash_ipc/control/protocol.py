"""Every message on the control plane, as a typed struct, msgpack on the wire.

Frames are msgpack maps ``{"v": PROTOCOL_VERSION, "t": <type tag>, <fields>...}``. Decoding
validates the version, the tag, every field's presence and type, and ranges that can be
checked without context (non-negative ranks and slots). A frame that fails is rejected with
:class:`ProtocolError` carrying a short ``kind`` used for counting; the receiving process
logs each kind once, counts it, and keeps running (:class:`RejectCounter`). Context checks
(slot index past the ring size, a SlotFree for a slot that is not held) happen in the
handler that knows the context and are counted the same way. Nothing is ever unpickled.

Payloads are typed too (:class:`Struct`, defined in ``dflash_ipc.control.wire``): a
heartbeat carries :class:`~dflash_ipc.control.stats.TargetStats` or ``DrafterStats`` in the
field named after its role, so a renamed or mistyped key anywhere inside is rejected with its
dotted path (``heartbeat.drafter.work.step``) instead of turning into ``None`` at the reader.

Who sends what::

    child      -> supervisor  Hello, Ready, Heartbeat, Done, Dead
    supervisor -> child       Start, Shutdown
    target     -> drafter     SlotReady, EndOfData
    drafter    -> target      SlotFree, Load

Handshake (owned by the supervisor, see ``dflash_ipc.runtime.supervisor``)::

    child: start ──Hello(ring descriptor)──▶ supervisor (waits for all, run.handshake_timeout_s)
    supervisor ──Start(all rings, all endpoints)──▶ every child
    child: import rings once, connect ──Ready──▶ supervisor ──▶ RUNNING (systemd READY=1)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack

from dflash_ipc.control.ring_descriptor import RingDescriptor
from dflash_ipc.control.stats import ChildInfo, ConsumerSummary, DrafterStats, DrafterSummary, ProducerSummary, ResumePoint, TargetStats
from dflash_ipc.control.wire import ProtocolError, RejectCounter, Struct, build_struct, from_wire, to_wire, wire_fields

__all__ = ["ProtocolError", "RejectCounter", "Struct", "from_wire", "to_wire"]  # the codec, re-exported for message users

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Message:
    TAG: ClassVar[str] = ""
    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset(
        {
            "rank",
            "slot",
            "producer",
            "consumer",
            "n_tokens",
            "n_seqs",
            "seq",
            "outstanding",
            "received",
            "bucket",
            "batches_sent",
            "holdout_pass_batches",
            "loop_age_s",
        }
    )


@dataclass(frozen=True)
class Hello(Message):
    TAG: ClassVar[str] = "hello"
    role: str
    rank: int
    pid: int
    device: str
    protocol: int = PROTOCOL_VERSION
    ring: RingDescriptor | None = None  # target only: its ring
    endpoint: str = ""  # the address this child binds for data-plane messages
    info: ChildInfo | None = None  # drafters: the checkpoint they resume from; targets: their kernels


@dataclass(frozen=True)
class Start(Message):
    TAG: ClassVar[str] = "start"
    rings: list[RingDescriptor]  # one per target rank
    target_endpoints: list
    drafter_endpoints: list
    resume: ResumePoint | None = None  # the checkpoint drafter 0 resumes from (None: a fresh run)


@dataclass(frozen=True)
class Ready(Message):
    TAG: ClassVar[str] = "ready"
    role: str
    rank: int


def _one_payload(msg: Message, roles: tuple[str, ...]) -> None:
    """Role-tagged payloads: exactly the field named after the sender's role is set."""
    given = [r for r in roles if getattr(msg, r) is not None]
    if given != [msg.role]:
        raise ValueError(f"a {msg.role!r} sends its payload in the field {msg.role!r} (one of {', '.join(roles)}), got {given or 'none'}")


@dataclass(frozen=True)
class Heartbeat(Message):
    """Live figures of one child; the payload field is the one named by ``role``.

    A thread of the child sends it every run.heartbeat_interval_s whatever its loop does, so a
    long step (the first one compiles) never silences it; ``loop_age_s`` is how long ago the
    loop last completed an iteration (the supervisor's stall rule, run.stall_timeout_s)."""

    TAG: ClassVar[str] = "heartbeat"
    ROLES: ClassVar[tuple[str, ...]] = ("target", "drafter")
    role: str
    rank: int
    target: TargetStats | None = None
    drafter: DrafterStats | None = None
    loop_age_s: float = 0.0

    def __post_init__(self) -> None:
        _one_payload(self, self.ROLES)

    @property
    def stats(self) -> TargetStats | DrafterStats:
        return getattr(self, self.role)


@dataclass(frozen=True)
class Done(Message):
    """A child's final report; the payload field is the one named by ``role``. Targets send one
    only in the forward-only benchmark; producer/consumer are the transport benchmark's roles."""

    TAG: ClassVar[str] = "done"
    ROLES: ClassVar[tuple[str, ...]] = ("target", "drafter", "producer", "consumer")
    role: str
    rank: int
    target: TargetStats | None = None
    drafter: DrafterSummary | None = None
    producer: ProducerSummary | None = None
    consumer: ConsumerSummary | None = None

    def __post_init__(self) -> None:
        _one_payload(self, self.ROLES)

    @property
    def summary(self) -> TargetStats | DrafterSummary | ProducerSummary | ConsumerSummary:
        return getattr(self, self.role)


@dataclass(frozen=True)
class Dead(Message):
    """A child's failure: ``error`` is "ExceptionType: message"; ``cause`` the exception's type
    (e.g. CheckpointDiskFull); ``failed_unix`` when it failed, so the supervisor names the first
    failure of a group (its peers' failures follow it: "connection closed by peer")."""

    TAG: ClassVar[str] = "dead"
    role: str
    rank: int
    error: str
    cause: str = ""
    failed_unix: float = 0.0


@dataclass(frozen=True)
class Shutdown(Message):
    TAG: ClassVar[str] = "shutdown"
    reason: str
    checkpoint: bool = False


@dataclass(frozen=True)
class SlotReady(Message):
    TAG: ClassVar[str] = "slot_ready"
    producer: int
    slot: int
    batch_id: list  # [epoch, shard, index]
    bucket: int
    n_tokens: int
    n_seqs: int
    seq: int  # per (producer, consumer) sequence number, for load accounting
    sent_ns: int = 0  # producer's time.monotonic_ns() at send, for hand-off latency
    meta: dict = field(default_factory=dict)
    # A held-out batch (training.holdout_every), batch_id [pass, producer, index]: drafter 0 measures tau on it,
    # never trains on it; holdout_pass_batches: how many batches, of all producers, make up its pass.
    holdout: bool = False
    holdout_pass_batches: int = 0


@dataclass(frozen=True)
class SlotFree(Message):
    TAG: ClassVar[str] = "slot_free"
    producer: int
    slot: int
    consumer: int
    outstanding: int  # consumer's held + queued batches after this release, all producers
    received: int  # SlotReady messages the consumer has received from this producer so far


@dataclass(frozen=True)
class Load(Message):
    TAG: ClassVar[str] = "load"
    consumer: int
    outstanding: int
    received: list  # per producer rank: SlotReady messages received so far


@dataclass(frozen=True)
class EndOfData(Message):
    TAG: ClassVar[str] = "end_of_data"
    producer: int
    batches_sent: int  # SlotReady messages this producer sent to the receiving consumer


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TAG: cls for cls in (Hello, Start, Ready, Heartbeat, Done, Dead, Shutdown, SlotReady, SlotFree, Load, EndOfData)
}


def encode(msg: Message) -> bytes:
    d = {"v": PROTOCOL_VERSION, "t": msg.TAG}
    for f in wire_fields(type(msg)):
        d[f.name] = to_wire(getattr(msg, f.name))
    return msgpack.packb(d, use_bin_type=True)


def decode(frame: bytes) -> Message:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("not_bytes", f"frame of type {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"{len(frame)} bytes > {MAX_FRAME_BYTES}")
    try:
        d = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("undecodable", f"{type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise ProtocolError("not_a_map", f"top level is {type(d).__name__}")
    version = d.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:  # 1.0 and True compare equal to 1
        raise ProtocolError("bad_version", f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    tag = d.pop("t", None)
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError("unknown_type", f"message type {tag!r}")
    msg = build_struct(cls, d, tag)
    if cls is SlotReady:
        bid = msg.batch_id
        if len(bid) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in bid):
            raise ProtocolError("bad_field_type", f"slot_ready.batch_id = {bid!r}")
        if msg.holdout != (msg.holdout_pass_batches > 0):
            raise ProtocolError("bad_field_type", f"slot_ready.holdout {msg.holdout} with holdout_pass_batches {msg.holdout_pass_batches}")
    return msg
