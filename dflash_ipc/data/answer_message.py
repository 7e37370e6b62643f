"""The assistant message of a generated answer: the fields the chat template reads back into the text
the target generated.

gen-data stores an answer twice: its token ids (what trains) and a message (what people read, what a
later turn sends back as history, what trains when the ids are dropped). The message is the first of
these shapes whose layout as a final turn (:func:`~dflash_ipc.data.chat_pieces.final_turn`) gives
back exactly the generated text, decoded with its special tokens:

1. gpt-oss's harmony channels split into the fields its template reads: the analysis message as
   ``thinking``, the final message as ``content``
   (``<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…``);
2. the text as ``content`` (ChatML, Llama 3, Gemma; Qwen3 reads its ``<think>`` block back out of it);
3. the text after what the generation prompt opened, as ``content`` (DeepSeek-R1's prompt ends with
   ``<think>\\n``, which its template strips from the turn with the reasoning).

When none does (an answer cut mid-reasoning, a template that trims what the target wrote), the content
is the text without special tokens, for people: the ids still train.
"""

from __future__ import annotations

import re

from dflash_ipc.data.chat_pieces import final_turn
from dflash_ipc.data.records import BadRecord

__all__ = ["answer_message"]

_HARMONY_CHANNEL = re.compile(r"<\|channel\|>(\w+)<\|message\|>(.*?)(?:<\|end\|><\|start\|>assistant(?=<\|channel\|>)|\Z)", re.DOTALL)


def _harmony_fields(text: str) -> dict[str, str] | None:
    """``{"thinking": …, "content": …}`` of a harmony answer (an analysis message, then the final one), or
    ``{"content": …}`` of a final message alone; None for any other text."""
    messages, pos = [], 0
    for m in _HARMONY_CHANNEL.finditer(text):
        if m.start() != pos:
            return None
        messages.append((m.group(1), m.group(2)))
        pos = m.end()
    if pos != len(text) or not messages:
        return None
    channels = [c for c, _ in messages]
    if channels == ["analysis", "final"]:
        return {"thinking": messages[0][1], "content": messages[1][1]}
    if channels == ["final"]:
        return {"content": messages[0][1]}
    return None


def answer_message(tokenizer, prompt_messages: list[dict], ids: list[int]) -> dict:
    """The assistant message whose rendering after ``prompt_messages`` is the text of ``ids`` (see the module docstring)."""
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    shapes = [fields] if (fields := _harmony_fields(text)) is not None else []
    shapes.append({"content": text})
    try:  # what the generation prompt opened, for a template that strips it from the turn (R1)
        opened = final_turn(tokenizer, [*prompt_messages, {"role": "assistant", "content": ""}]).opened
    except BadRecord:
        opened = ""
    if opened:
        shapes.append({"content": opened + text})
    for shape in shapes:
        message = {"role": "assistant", **shape}
        try:
            if final_turn(tokenizer, [*prompt_messages, message]).generated == text:
                return message
        except BadRecord:  # a template that refuses the shape (gpt-oss: channel tags in a content)
            continue
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
