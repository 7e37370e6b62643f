"""Every message on the control plane, as a typed struct, msgpack on the wire.

Frames are msgpack maps ``{"v": PROTOCOL_VERSION, "t": <type tag>, <fields>...}``. Decoding
validates the version, the tag, every field's presence and type, and ranges that can be
checked without context (non-negative ranks and slots). A frame that fails is rejected with
:class:`ProtocolError` carrying a short ``kind`` used for counting; the receiving process
logs each kind once, counts it, and keeps running (:class:`RejectCounter`). Context checks
(slot index past the ring size, a SlotFree for a slot that is not held) happen in the
handler that knows the context and are counted the same way. Nothing is ever unpickled.

Payloads are typed too (:class:`Struct`, defined in ``dflash_ipc.control.stats``): a
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

import dataclasses
import functools
import logging
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

if typing.TYPE_CHECKING:  # resolved at run time by _payload_names (control.stats imports this module)
    from dflash_ipc.control.stats import ChildInfo, ConsumerSummary, DrafterStats, DrafterSummary, ProducerSummary, ResumePoint, TargetStats

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20

log = logging.getLogger(__name__)


class ProtocolError(ValueError):
    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class Message:
    TAG: ClassVar[str] = ""


@dataclass(frozen=True)
class Hello(Message):
    TAG: ClassVar[str] = "hello"
    role: str
    rank: int
    pid: int
    device: str
    protocol: int = PROTOCOL_VERSION
    ring: ring_descriptor.RingDescriptor | None = None  # target only: its ring
    endpoint: str = ""  # the address this child binds for data-plane messages
    info: ChildInfo | None = None  # drafters: the checkpoint they resume from; targets: their kernels


@dataclass(frozen=True)
class Start(Message):
    TAG: ClassVar[str] = "start"
    rings: list[ring_descriptor.RingDescriptor]  # one per target rank
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
    """Live figures of one child; the payload field is the one named by ``role``."""

    TAG: ClassVar[str] = "heartbeat"
    ROLES: ClassVar[tuple[str, ...]] = ("target", "drafter")
    role: str
    rank: int
    target: TargetStats | None = None
    drafter: DrafterStats | None = None

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
    TAG: ClassVar[str] = "dead"
    role: str
    rank: int
    error: str


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
    batches_sent: int


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (Hello, Start, Ready, Heartbeat, Done, Dead, Shutdown, SlotReady, SlotFree, Load, EndOfData)
}

_NON_NEGATIVE = {"rank", "slot", "producer", "consumer", "n_tokens", "n_seqs", "seq", "outstanding", "received", "bucket", "batches_sent"}


@dataclass(frozen=True)
class Struct:
    """A typed payload nested inside a message (ring descriptors, heartbeat stats, status).

    Fields are typed with ``int``, ``float``, ``str``, ``bool``, another ``Struct``, ``list[X]``,
    ``dict[str, X]`` or ``X | None``; :func:`to_wire` turns one into plain msgpack values and
    :func:`from_wire` validates every field recursively (the error names the dotted path), so a
    renamed or mistyped key is a :class:`ProtocolError`, never a silent ``None``. Fields named in
    ``NON_NEGATIVE`` are checked ``>= 0``. Subclasses are frozen dataclasses.
    """

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset()


@dataclass(frozen=True)
class _Field:
    name: str
    spec: Any  # a _Spec tree, see _spec_of
    required: bool
    non_negative: bool


def _spec_of(tp: Any) -> tuple:
    """A field annotation as a small tree: ("prim", types) | ("struct", cls) | ("list", spec) |
    ("dict", spec) | ("union", (spec, ...)). ``bool`` is never accepted for ``int``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return ("union", tuple(_spec_of(a) for a in typing.get_args(tp)))
    if tp is type(None):
        return ("prim", (type(None),))
    if tp is float:
        return ("prim", (float, int))
    if tp in (int, str, bool, bytes):
        return ("prim", (tp,))
    if tp in (dict, list):
        return ("prim", (tp,))
    if origin is list:
        (arg,) = typing.get_args(tp)
        return ("list", _spec_of(arg))
    if origin is dict:
        key, arg = typing.get_args(tp)
        if key is not str:
            raise TypeError(f"wire dicts have str keys, not {key!r}")
        return ("dict", _spec_of(arg))
    if isinstance(tp, type) and issubclass(tp, Struct):
        return ("struct", tp)
    raise TypeError(f"unsupported wire type {tp!r}")


@functools.cache
def _payload_names() -> dict[str, Any]:
    # The payload structs (control.stats) subclass Struct, so that module imports this one; the
    # message annotations naming them are resolved here, on first use, not at import.
    from dflash_ipc.control import stats

    return {k: v for k, v in vars(stats).items() if isinstance(v, type) and issubclass(v, Struct)}


@functools.cache
def _fields(cls: type) -> tuple[_Field, ...]:
    """Each field's wire spec, computed once per message or struct type."""
    hints = typing.get_type_hints(cls, localns=_payload_names()) if issubclass(cls, Message) else typing.get_type_hints(cls)
    extra = cls.NON_NEGATIVE if issubclass(cls, Struct) else _NON_NEGATIVE
    return tuple(
        _Field(f.name, _spec_of(hints[f.name]), f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, f.name in extra)
        for f in dataclasses.fields(cls)
        if f.init
    )


def to_wire(value: Any) -> Any:
    """A message field's value as plain msgpack values (structs become maps, recursively)."""
    if isinstance(value, Struct):
        return {f.name: to_wire(getattr(value, f.name)) for f in _fields(type(value))}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


_NONE = ("prim", (type(None),))


def _check(spec: tuple, value: Any, path: str) -> Any:
    kind, arg = spec
    if kind == "prim":
        if type(value) not in arg:
            raise ProtocolError("bad_field_type", f"{path} = {value!r:.80}")
        return float(value) if float in arg and type(value) is int else value
    if kind == "union":
        if value is None and _NONE in arg:
            return None
        options = [o for o in arg if o != _NONE]
        if len(options) == 1:  # X | None: X's own error, with its dotted path
            return _check(options[0], value, path)
        for option in options:
            try:
                return _check(option, value, path)
            except ProtocolError:
                continue
        raise ProtocolError("bad_field_type", f"{path} = {value!r:.80}")
    if kind == "list":
        if type(value) is not list:
            raise ProtocolError("bad_field_type", f"{path} is {type(value).__name__}, not a list")
        return [_check(arg, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if kind == "dict":
        if type(value) is not dict:
            raise ProtocolError("bad_field_type", f"{path} is {type(value).__name__}, not a map")
        return {k: _check(arg, v, f"{path}.{k}") for k, v in value.items() if type(k) is str or _bad_key(path, k)}
    if type(value) is not dict:  # struct
        raise ProtocolError("bad_field_type", f"{path} is {type(value).__name__}, not a {arg.__name__} map")
    return _build(arg, dict(value), path)


def _bad_key(path: str, key: Any) -> bool:
    raise ProtocolError("bad_field_type", f"{path} has a non-string key {key!r:.40}")


def _build(cls: type, d: dict, path: str) -> Any:
    kwargs = {}
    for f in _fields(cls):
        if f.name in d:
            value = d.pop(f.name)
        elif f.required:
            raise ProtocolError("missing_field", f"{path}.{f.name} missing")
        else:
            continue
        kind, arg = f.spec
        if kind == "prim" and type(value) in arg and float not in arg:  # the common case, inline
            pass
        else:
            value = _check(f.spec, value, f"{path}.{f.name}")
        if f.non_negative and type(value) in (int, float) and value < 0:
            raise ProtocolError("out_of_range", f"{path}.{f.name} = {value} < 0")
        kwargs[f.name] = value
    if d:
        raise ProtocolError("unknown_field", f"{path} has unknown fields {sorted(map(str, d))[:3]}")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a struct's __post_init__ refusing a value it cannot hold
        raise ProtocolError("out_of_range", f"{path}: {e}") from None


def from_wire(cls: type, value: Any, path: str | None = None) -> Any:
    """Validate plain msgpack values as a ``Struct`` (or message) type; ProtocolError otherwise."""
    return _check(("struct", cls), value, path or cls.__name__)


def encode(msg: Message) -> bytes:
    d = {"v": PROTOCOL_VERSION, "t": msg.TAG}
    for f in _fields(type(msg)):
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
    msg = _build(cls, d, tag)
    if cls is SlotReady:
        bid = msg.batch_id
        if len(bid) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in bid):
            raise ProtocolError("bad_field_type", f"slot_ready.batch_id = {bid!r}")
    return msg


class RejectCounter:
    """Counts rejected frames by kind; logs the first of each kind only."""

    def __init__(self, who: str, logger: logging.Logger | None = None):
        self.who = who
        self.by_kind: dict[str, int] = {}
        self._log = logger or log

    def reject(self, kind: str, detail: str) -> None:
        n = self.by_kind.get(kind, 0)
        self.by_kind[kind] = n + 1
        if n == 0:
            self._log.warning("%s: rejected a message (%s): %s; further ones of this kind are only counted", self.who, kind, detail)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


# Last: ring_descriptor builds on Struct above; field annotations resolve on first use.
from dflash_ipc.control import ring_descriptor  # noqa: E402
