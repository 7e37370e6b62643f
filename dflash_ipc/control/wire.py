"""The typed wire codec: structs of plain fields to msgpack values and back, validated.

Every message (``control.protocol``) and every payload nested in one (``control.stats``,
``control.status``, ``control.ring_descriptor``) is a frozen dataclass whose field annotations
are the schema. :func:`to_wire` turns one into plain values; :func:`from_wire` checks presence,
exact types (``bool`` is never an ``int``), ranges named in ``NON_NEGATIVE`` and nested structs,
recursively, and raises :class:`ProtocolError` naming the dotted path. A rejected frame is
counted by :class:`RejectCounter`, never fatal. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

log = logging.getLogger(__name__)


class ProtocolError(ValueError):
    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


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
def wire_fields(cls: type) -> tuple[_Field, ...]:
    """Each field's wire spec, computed once per message or struct type."""
    hints = typing.get_type_hints(cls)
    extra = getattr(cls, "NON_NEGATIVE", frozenset())
    return tuple(
        _Field(
            f.name, _spec_of(hints[f.name]), f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, f.name in extra
        )
        for f in dataclasses.fields(cls)
        if f.init
    )


def to_wire(value: Any) -> Any:
    """A message field's value as plain msgpack values (structs become maps, recursively)."""
    if isinstance(value, Struct):
        return {f.name: to_wire(getattr(value, f.name)) for f in wire_fields(type(value))}
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
        bad = [k for k in value if type(k) is not str]
        if bad:
            raise ProtocolError("bad_field_type", f"{path} has a non-string key {bad[0]!r:.40}")
        return {k: _check(arg, v, f"{path}.{k}") for k, v in value.items()}
    if type(value) is not dict:  # struct
        raise ProtocolError("bad_field_type", f"{path} is {type(value).__name__}, not a {arg.__name__} map")
    return build_struct(arg, dict(value), path)


def build_struct(cls: type, d: dict, path: str) -> Any:
    kwargs = {}
    for f in wire_fields(cls):
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
