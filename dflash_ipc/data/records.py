"""One data record (a JSON object or table row) as a chat or a text: the shape every loader accepts."""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}


class BadRecord(Exception):
    """A record that cannot be used; the message says why (reported with its place)."""


def parse_record(obj: Any) -> tuple[str, Any]:
    """``("chat", messages)`` or ``("text", str)``; raises :class:`BadRecord` with a reason."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object, got {type(obj).__name__}")
    key = "conversations" if "conversations" in obj else "messages" if "messages" in obj else None
    if key is not None:
        turns = obj[key]
        if not isinstance(turns, list):
            raise BadRecord(f'"{key}" must be a list of messages, got {type(turns).__name__}')
        if not turns:
            raise BadRecord(f'"{key}" is empty')
        messages = []
        for j, m in enumerate(turns):
            if not isinstance(m, dict):
                raise BadRecord(f"{key}[{j}] must be an object, got {type(m).__name__}")
            if "role" in m or "content" in m:
                role, content = m.get("role"), m.get("content")
                rk, ck = "role", "content"
            else:  # ShareGPT
                role, content = m.get("from"), m.get("value")
                rk, ck = "from", "value"
            if role is None:
                raise BadRecord(f'{key}[{j}] has no "role"')
            if not isinstance(role, str) or not role:
                raise BadRecord(f"{key}[{j}].{rk} must be a non-empty string, got {role!r}")
            if content is None:
                raise BadRecord(f'{key}[{j}] has no "content"')
            if not isinstance(content, str):
                raise BadRecord(f"{key}[{j}].{ck} must be a string, got {type(content).__name__}")
            msg = {k: v for k, v in m.items() if k not in ("from", "value")}
            msg["role"] = ROLE_ALIASES.get(role, role)
            msg["content"] = content
            messages.append(msg)
        return "chat", messages
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            raise BadRecord(f'"text" must be a string, got {type(text).__name__}')
        if not text.strip():
            raise BadRecord('"text" is empty')
        return "text", text
    raise BadRecord('missing field: expected "conversations", "messages" or "text"')
