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


# The message fields chat templates read an answer's reasoning from: Qwen3's "reasoning_content",
# gpt-oss's "thinking" (its analysis channel). Passed to the template as they are, like any other field.
REASONING_FIELDS = ("reasoning_content", "thinking")


class BadRecord(Exception):
    """A record that cannot be used; the message says why (reported with its place)."""


def _unicode(text: str, what: str) -> str:
    """``text`` if every character is one (JSON's ``"\\ud800"`` decodes to a lone surrogate, which no
    tokenizer takes: the Rust tokenizers refuse the whole batch with a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end]
        raise BadRecord(f"{what} holds a lone surrogate {bad!r} at character {e.start} (not a Unicode character)") from None
    return text


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
            # None is absent: a table's message struct gives every turn every field, and a template tests
            # a field's presence (gpt-oss renders an analysis message for any "thinking" key)
            msg = {k: v for k, v in m.items() if k not in ("from", "value") and v is not None}
            msg["role"] = ROLE_ALIASES.get(role, role)
            msg["content"] = _unicode(content, f"{key}[{j}].{ck}")
            _unicode(role, f"{key}[{j}].{rk}")
            for field in REASONING_FIELDS:
                if field in msg:
                    if not isinstance(msg[field], str):
                        raise BadRecord(f"{key}[{j}].{field} must be a string, got {type(msg[field]).__name__}")
                    _unicode(msg[field], f"{key}[{j}].{field}")
            messages.append(msg)
        return "chat", messages
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            raise BadRecord(f'"text" must be a string, got {type(text).__name__}')
        if not text.strip():
            raise BadRecord('"text" is empty')
        return "text", _unicode(text, '"text"')
    raise BadRecord('missing field: expected "conversations", "messages" or "text"')


# gen-data's records keep the target's own tokens: the text re-tokenizes to other ids often enough
# (BPE merges across tokens the model emitted apart, decode's cleanup, special tokens) that the ids,
# not the text, are what a drafter must learn to predict (docs/EVAL.md "gen-data").
ANSWER_IDS_FIELD = "token_ids"  # on the final assistant message: the answer's generated ids, stop token excluded
VOCAB_FIELD = "tokenizer_vocab"  # on the record: data.tokenizer.vocab_identity of the tokenizer those ids belong to


def answer_token_ids(messages: list[dict], vocab_size: int) -> list[int] | None:
    """The ids stored on a chat's final assistant turn, checked against a vocabulary of ``vocab_size``
    ids; None when the chat stores none (its text is tokenized). Raises :class:`BadRecord`."""
    # None is absent: a table's message struct gives every turn every field (Parquet, datasets)
    for j, m in enumerate(messages[:-1]):
        if m.get(ANSWER_IDS_FIELD) is not None:
            raise BadRecord(f'turn {j} carries "{ANSWER_IDS_FIELD}": token ids are read only on the final (assistant) turn')
    ids = messages[-1].get(ANSWER_IDS_FIELD)
    if ids is None:
        return None
    last = messages[-1]
    if last["role"] != "assistant":
        raise BadRecord(f'the final turn carries "{ANSWER_IDS_FIELD}" but is a {last["role"]!r} turn, not an assistant answer')
    if not isinstance(ids, list):
        raise BadRecord(f'"{ANSWER_IDS_FIELD}" must be a list of token ids, got {type(ids).__name__}')
    for k, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise BadRecord(f'"{ANSWER_IDS_FIELD}"[{k}] must be an integer token id, got {t!r}')
        if not 0 <= t < vocab_size:
            raise BadRecord(
                f'"{ANSWER_IDS_FIELD}"[{k}] = {t} is outside the tokenizer\'s vocabulary (ids 0..{vocab_size - 1}): '
                "the answer was generated with another tokenizer"
            )
    return ids
