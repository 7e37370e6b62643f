"""``target.spec`` checked value by value before anything is built.

``target.spec`` is a table of ``Qwen3_5TextConfig`` fields handed to transformers, which keeps
unknown keys as attributes and builds its default shape, warns about a misspelt
``rope_parameters`` key and accepts ``rms_norm_eps = inf`` or ``initializer_range = nan``:
such a run starts every process and then fails, or trains a useless model to exit 0. So every
key is checked against the configuration class (``rope_parameters``' keys against the rope
parameters transformers knows), every value against the field's declared type, every number
for finiteness (anywhere in the table) and for the range its meaning allows. Each refusal is a
:class:`~dflash_ipc.config.ConfigError` naming ``target.spec.<key>`` (``target.spec.rope_parameters.<key>``).
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from typing import Any, NoReturn

from dflash_ipc.config import ConfigError

# Integers the configs store must fit a C int64: torch sizes and ids are int64.
INT64_MAX = 2**63 - 1

# Sizes and counts of the model: whole numbers >= 1.
_SIZE = re.compile(r"(_size|_dim|_heads|_layers|^max_position_embeddings)$")
# (low, high, low inclusive, high inclusive, why): numbers outside are refused.
_RANGES: dict[str, tuple[float, float, bool, bool, str]] = {
    "rms_norm_eps": (0.0, 1.0, False, False, "the RMSNorm epsilon, e.g. 1e-6"),
    "initializer_range": (0.0, 10.0, False, True, "the std of the random init, e.g. 0.02"),
    "attention_dropout": (0.0, 1.0, True, False, "a dropout probability"),
    "rope_theta": (0.0, math.inf, False, False, "the RoPE base, e.g. 10000.0"),
    "partial_rotary_factor": (0.0, 1.0, False, True, "the share of each head rotated, e.g. 0.25"),
    "factor": (0.0, math.inf, False, False, "the RoPE scaling factor"),
}
_LAYER_TYPES = ("linear_attention", "full_attention")


def spec_fields() -> dict[str, inspect.Parameter]:
    """The keys ``target.spec`` accepts: the init parameters of ``Qwen3_5TextConfig``."""
    from transformers import Qwen3_5TextConfig

    params = inspect.signature(Qwen3_5TextConfig.__init__).parameters.values()
    return {p.name: p for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def rope_parameter_keys() -> set[str] | None:
    """The keys transformers reads in ``rope_parameters`` (all rope types), plus the model's own;
    None where this transformers does not list them (its own validation then warns)."""
    from transformers import Qwen3_5TextConfig

    try:
        from transformers.modeling_rope_utils import RopeParameters
    except ImportError:
        return None
    return set(RopeParameters.__annotations__) | set(getattr(Qwen3_5TextConfig, "ignore_keys_at_rope_validation", ()) or ())


def check_spec(source: str, spec: dict[str, Any]) -> None:
    """Refuse the first key or value of ``spec`` that would not build the model it says."""
    fields = spec_fields()
    for key, value in spec.items():
        dotted = f"target.spec.{key}"
        if key not in fields:
            # Qwen3_5TextConfig keeps unknown keyword arguments as attributes and ignores them:
            # a typo would silently build a model of the default (4096-wide) shape.
            _fail(source, dotted, f"unknown Qwen3_5TextConfig field{_did_you_mean(key, fields)}")
        _check_numbers(source, dotted, value)
        _check_type(source, dotted, value, fields[key].annotation)
        _check_value(source, dotted, key, value, spec)
    rope = spec.get("rope_parameters")
    if isinstance(rope, dict):
        valid = rope_parameter_keys()
        for key, value in rope.items():
            dotted = f"target.spec.rope_parameters.{key}"
            if valid is not None and key not in valid:
                _fail(source, dotted, f"unknown rope parameter{_did_you_mean(key, valid)}")
            _check_value(source, dotted, key, value, spec)
        _check_rope_type(source, rope.get("rope_type", "default"))


def _check_rope_type(source: str, rope_type: Any) -> None:
    """transformers looks the RoPE initialisation up by this name when the model is built, in every process."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = ["default", *ROPE_INIT_FUNCTIONS]
    if rope_type not in known:
        dotted = "target.spec.rope_parameters.rope_type"
        _fail(source, dotted, f"{rope_type!r} is not a RoPE type transformers knows{_did_you_mean(str(rope_type), known)} (valid: {known})")


def check_spec_vocab(source: str, spec: dict[str, Any], vocab: int) -> None:
    """The spec's token ids against the vocabulary a random-weight target gets: its tokenizer's size."""
    if "vocab_size" in spec and spec["vocab_size"] != vocab:
        _fail(
            source,
            "target.spec.vocab_size",
            f"{spec['vocab_size']} would be ignored: a random-weight target's vocabulary is its tokenizer's "
            f"({vocab} ids, target.tokenizer); remove the key",
        )
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = spec.get(key)
        ids = value if isinstance(value, list) else [value]
        bad = [i for i in ids if isinstance(i, int) and i >= vocab]
        if bad:
            _fail(source, f"target.spec.{key}", f"{bad[0]} is outside the target's vocabulary [0, {vocab}) (the tokenizer's size)")


def _check_numbers(source: str, dotted: str, value: Any) -> None:
    """Every number, at any depth, is finite and an integer fits int64."""
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        _fail(source, dotted, f"must be a finite number (got {value!r})")
    if isinstance(value, int) and abs(value) > INT64_MAX:
        _fail(source, dotted, f"{value} does not fit a 64-bit integer")
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_numbers(source, f"{dotted}[{i}]", v)
    if isinstance(value, dict):
        for k, v in value.items():
            _check_numbers(source, f"{dotted}.{k}", v)


def _annotation_kinds(annotation: Any) -> set[str] | None:
    """The value kinds an init parameter's annotation allows (None: anything, or unknown)."""
    if annotation is inspect.Parameter.empty:
        return None
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    kinds: set[str] = set()
    for part in _split_union(text):
        base = part.split("[", 1)[0].rsplit(".", 1)[-1]
        kind = {"int": "int", "float": "float", "bool": "bool", "str": "str", "Literal": "str", "list": "list", "dict": "dict"}.get(base)
        if kind is None and base in ("None", "NoneType"):
            continue
        if kind is None and base == "RopeParameters":
            kind = "dict"
        if kind is None:
            return None  # a type this check does not model: transformers judges it
        kinds.add(kind)
    return kinds or None


def _split_union(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    return {int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(type(value), type(value).__name__)


def _check_type(source: str, dotted: str, value: Any, annotation: Any) -> None:
    kinds = _annotation_kinds(annotation)
    if kinds is None:
        return
    kind = _kind_of(value)
    if kind in kinds or (kind == "int" and "float" in kinds):
        return
    want = " or ".join(sorted("a number" if k == "float" else {"int": "an integer"}.get(k, f"a {k}") for k in kinds))
    _fail(source, dotted, f"must be {want} (got {kind} {value!r})")


def _check_value(source: str, dotted: str, key: str, value: Any, spec: dict[str, Any]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, list, str)):
        return
    if _SIZE.search(key) and isinstance(value, int) and value < 1:
        _fail(source, dotted, f"must be >= 1 (got {value})")
    if key in _RANGES and isinstance(value, (int, float)):
        low, high, low_in, high_in, what = _RANGES[key]
        if not ((value >= low if low_in else value > low) and (value <= high if high_in else value < high)):
            interval = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
            _fail(source, dotted, f"must be in {interval} (got {value!r}): {what}")
    if key == "head_dim" and isinstance(value, int) and value % 2:
        _fail(source, dotted, f"must be even for RoPE (got {value})")
    if key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = value if isinstance(value, list) else [value]
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            _fail(source, dotted, f"token ids must be integers >= 0 (got {value!r})")
    if key == "layer_types" and isinstance(value, list):
        for i, t in enumerate(value):
            if t not in _LAYER_TYPES:
                _fail(source, f"{dotted}[{i}]", f"{t!r} is not a layer type{_did_you_mean(str(t), _LAYER_TYPES)}")
        n = spec.get("num_hidden_layers")
        if isinstance(n, int) and len(value) != n:
            _fail(source, dotted, f"lists {len(value)} layer types but target.spec.num_hidden_layers is {n}: give one per layer")
    if key == "hidden_act" and isinstance(value, str):
        from transformers.activations import ACT2FN

        if value not in ACT2FN:
            _fail(source, dotted, f"{value!r} is not an activation transformers knows{_did_you_mean(value, ACT2FN)}")
    if key == "mrope_section" and isinstance(value, list) and any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in value):
        _fail(source, dotted, f"must be a list of integers >= 0 (got {value!r})")


def _did_you_mean(key: str, valid: Any) -> str:
    close = difflib.get_close_matches(key, sorted(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _fail(source: str, key: str, message: str) -> NoReturn:
    raise ConfigError.at(source, key, message)
