"""Write a derived run config: a base TOML with dotted overrides, validated by the project's loader.

    python tools/derive_config.py BASE.toml OUT.toml target.model_path='"/root/models/smollm2"' training.max_steps=800

Each override is ``section.key=VALUE`` with VALUE in JSON (strings quoted, lists in brackets);
a bare word that is not JSON is taken as a string. The result is checked with
``dflash_ipc.config.load_config`` before this exits 0, so a typo fails here, not in ``up``.
(No TOML writer is a dependency; the values configs hold -- strings, numbers, booleans, lists,
sub-tables such as ``target.spec``, written as inline tables -- are written by hand below.)
"""

from __future__ import annotations

import json
import math
import sys
import tomllib
from pathlib import Path


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{v!r} has no place in a run config")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table: one line, any depth
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as a TOML value")


def dumps(doc: dict) -> str:
    lines: list[str] = []
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise TypeError(f"top-level {section!r} must be a table")
        lines.append(f"[{section}]")
        lines += [f"{json.dumps(str(k))} = {_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[str, str, object]:
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise SystemExit(f"override {text!r}: expected section.key=VALUE")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return section, name, value


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    base, out, *overrides = argv
    doc = tomllib.loads(Path(base).read_text())
    for text in overrides:
        section, name, value = parse_override(text)
        doc.setdefault(section, {})[name] = value
    Path(out).write_text(f"# derived from {base} by tools/derive_config.py\n" + dumps(doc))
    from dflash_ipc.config import ConfigError, load_config

    try:
        load_config(out)
    except ConfigError as e:
        raise SystemExit(f"derived config is invalid: {e}") from None
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
