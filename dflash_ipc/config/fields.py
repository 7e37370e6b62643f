"""The field toolkit of every config section: walking a TOML table against a section's dataclass,
coercing each value to its declared type, the errors that name the dotted key, and the field docs.

A field is documented by the string literal right under it (an attribute docstring, as torchtitan
writes its config)::

    @dataclass
    class TransportConfig:
        ring_slots: int = 4
        \"\"\"Slots in each target->drafter ring.\"\"\"

:func:`field_docs` reads them from the source with ``ast`` (nothing is executed), so the class is
the one place a field's type, default and meaning are written; ``docs/CONFIG.md`` is generated
from them (:mod:`dflash_ipc.config.docs`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from typing import Any, Literal

# Seeds are mixed with ranks, steps and sample indices (seed * 1_000_003 + ...) before torch's manual_seed and
# numpy's generators take them: below 2**32 every such mix stays a valid 64-bit seed.
MAX_SEED = 2**32 - 1

# The source of a value given on the command line as ``--set KEY=VALUE``: its errors read ``--set KEY: ...``.
SET_SOURCE = "--set"


class ConfigError(ValueError):
    """A configuration problem, already phrased as ``FILE: dotted.key: what to change`` (``--set dotted.key: ...``
    for a value given with ``--set``).

    Made by :meth:`at`, it also holds the file, key and message apart: the probe process sends
    them back to the supervisor, which raises the same error (:mod:`dflash_ipc.runtime.probe`)."""

    source: str | None = None
    key: str | None = None
    detail: str | None = None

    @classmethod
    def at(cls, source: str, key: str, message: str) -> ConfigError:
        err = cls(f"{source} {key}: {message}" if source == SET_SOURCE else f"{source}: {key}: {message}")
        err.source, err.key, err.detail = source, key, message
        return err


def require(cond: bool, key: str, message: str) -> None:
    """Raise :class:`FieldError` for ``key`` (relative to the section) unless ``cond``."""
    if not cond:
        raise FieldError(key, message)


class FieldError(ValueError):
    """A bad value of one field, its key relative to the section that checks it."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key
        self.message = message


def build_section(cls: type, table: dict[str, Any], prefix: str, source: str) -> Any:
    """``cls(**table)`` with every value coerced to its field's type; errors name ``prefix.key``."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        dotted = f"{prefix}.{key}"
        if key not in fields:
            raise ConfigError.at(source, dotted, f"unknown key{did_you_mean(key, fields)}")
        try:
            kwargs[key] = _coerce(value, hints[key], dotted)
        except FieldError as e:
            raise ConfigError.at(source, e.key, e.message) from None
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ConfigError.at(source, f"{prefix}.{e.key}", e.message) from None


def type_name(tp: Any) -> str:
    """A field's type as a reader would say it: ``int``, ``list of str``, ``'auto' | 'off'``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list,):
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "table"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, dotted: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise FieldError(dotted, f"must be one of {', '.join(repr(c) for c in choices)} (got {value!r})")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise FieldError(dotted, f"must be a {type_name(tp)} (got {type(value).__name__} {value!r})")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(dotted, f"must be a table (got {type(value).__name__})")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        for alt in typing.get_args(tp):
            try:
                return _coerce(value, alt, dotted)
            except FieldError:
                continue
        raise FieldError(dotted, f"must be {type_name(tp)} (got {value!r})")
    if tp is Any:
        return value
    return _coerce_scalar(value, tp, dotted)


def _coerce_scalar(value: Any, tp: Any, dotted: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise FieldError(dotted, f"must be true or false (got {value!r})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(dotted, f"must be an integer (got {type(value).__name__} {value!r})")
        if not -(2**63) <= value < 2**63:  # tomllib reads any length; TOML's integers, like torch's, are 64-bit
            raise FieldError(dotted, f"{value} does not fit a 64-bit integer (TOML integers are 64-bit); use a smaller value")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldError(dotted, f"must be a number (got {type(value).__name__} {value!r})")
        if not math.isfinite(value):
            raise FieldError(dotted, f"must be a finite number (got {value!r})")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise FieldError(dotted, f"must be a string (got {type(value).__name__} {value!r})")
        if "\0" in value:  # no path, name or title holds one: the OS would refuse it later, naming no key
            raise FieldError(dotted, f"must not hold a NUL character (got {value!r})")
        return value
    raise FieldError(dotted, f"unsupported type {tp}")


def did_you_mean(key: str, valid: Any) -> str:
    """``; did you mean 'x'? (valid: ...)`` for an unknown ``key``."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    valid_list = ", ".join(sorted(valid))
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (valid: {valid_list})"


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal under it), read from the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs
