"""Reading a chat template's output: where a turn's content lands in the rendered text, and which
tokens close a turn.

The chat template is the only description of a model's chat format that every model ships, and
templates rewrite what they are given (Llama 3 and Gemma trim contents, Qwen3 and DeepSeek-R1 strip
earlier turns' reasoning, gpt-oss wraps an answer in channel headers). So nothing here parses a
format: a turn's place is found by rendering the chat twice, once with the turn's content replaced
by a mark that occurs nowhere else, and reading where the two renderings part and meet again.
"""

from __future__ import annotations

from dflash_ipc.data.records import ANSWER_IDS_FIELD, BadRecord

# Private-use characters: a mark built from one that the rendered text does not hold cannot be
# confused with text the template or a message wrote.
_PRIVATE_USE = range(0xE000, 0xF900)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat template's text for ``messages``; a template that fails or renders no string makes the record bad."""
    try:
        rendered = tokenizer.apply_chat_template(
            [without_answer_ids(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # noqa: BLE001 - jinja errors of arbitrary templates
        raise BadRecord(f"chat template failed: {type(e).__name__}: {e}") from None
    if not isinstance(rendered, str):
        raise BadRecord("chat template did not render to a string")
    return rendered


def without_answer_ids(message: dict) -> dict:
    """``message`` without the generated ids gen-data stores on an answer (no template reads them)."""
    return {k: v for k, v in message.items() if k != ANSWER_IDS_FIELD}


def unused_mark(*texts: str) -> str:
    """A placeholder content whose characters occur in none of ``texts``."""
    for code in _PRIVATE_USE:
        c = chr(code)
        if not any(c in t for t in texts):
            return f"{c}turn{c}"
    raise BadRecord("the chat uses every private-use character, so no placeholder can stand for a turn's content")


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (bisected: slices compare in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_suffix(a: str, b: str) -> int:
    """The length of the longest common suffix of ``a`` and ``b``."""
    return common_prefix(a[::-1], b[::-1])


def with_content(messages: list[dict], j: int, content: str) -> list[dict]:
    """``messages`` with turn ``j``'s content replaced."""
    return [{**m, "content": content} if k == j else m for k, m in enumerate(messages)]


def content_span(tokenizer, messages: list[dict], j: int, rendered: str, add_generation_prompt: bool) -> tuple[int, int]:
    """Where turn ``j``'s content sits in ``rendered`` (``messages`` rendered with ``add_generation_prompt``):
    as the template wrote it, trimmed or stripped of reasoning as the template does. Raises
    :class:`BadRecord` when the template writes the turn more than once or its content changes other text."""
    mark = unused_mark(rendered)
    marked = render(tokenizer, with_content(messages, j, mark), add_generation_prompt)
    start = common_prefix(rendered, marked)
    tail = common_suffix(rendered[start:], marked[start:])
    if marked[start : len(marked) - tail] != mark:
        raise BadRecord(
            f"the chat template does not write assistant turn {j}'s content in one place independent of the other turns, "
            "so its tokens cannot be told apart"
        )
    return start, len(rendered) - tail


def closing_texts(tokenizer, stop_ids: set[int]) -> tuple[str, ...]:
    """The text of each stop token that is an added token (a special token's text tokenizes to exactly
    that id), longest first: the tokens that close a turn where the target stops generating."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {str(getattr(added[i], "content", added[i])) for i in stop_ids if i in added}
    return tuple(sorted((t for t in texts if t), key=len, reverse=True))


def closing_at(text: str, pos: int, closings: tuple[str, ...]) -> str:
    """The closing token that ``text`` holds at ``pos``, or ``""``."""
    return next((c for c in closings if text.startswith(c, pos)), "")
