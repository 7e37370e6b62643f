"""A chat record as the pieces of one training sample: text (or token ids) and whether it is supervised.

Chats are rendered with the tokenizer's chat template. The loss mask is 1 exactly on the
tokens of assistant contents and the token that closes each assistant turn (``<|im_end|>``
for ChatML templates, else the eos token) and 0 elsewhere. To make that exact, the rendered
string is cut at the assistant spans and each piece is tokenized on its own, so no token
straddles a supervised boundary (this is also how the target sees a reply at inference:
generated after the prompt's ``<|im_start|>assistant\\n``).

A chat whose final assistant turn carries ``token_ids`` (gen-data's answers,
:data:`~dflash_ipc.data.records.ANSWER_IDS_FIELD`) uses them verbatim: the generation prompt the
target answered (the chat template with ``add_generation_prompt``, tokenized as gen-data and eval
tokenize it), the ids (supervised), then what the template writes after an assistant content: the
end token supervised (as above), the rest not. Ids outside the tokenizer's vocabulary, or a
``tokenizer_vocab`` stamp of another vocabulary, make the line bad. A record with
``"finish": "length"`` (an answer cut at gen-data's ``--max-new``) ends at the cut, ids or text:
no end token is appended, since the target never produced one, and a supervised one would teach
the drafter to end turns where the target does not.
"""

from __future__ import annotations

from dflash_ipc.data.records import ANSWER_IDS_FIELD, BadRecord
from dflash_ipc.data.tokenizer import IM_END


def turn_end_token(tokenizer) -> str | None:
    """The token that closes an assistant turn: ``<|im_end|>`` in a ChatML vocabulary, else eos."""
    vocab = tokenizer.get_vocab()
    if IM_END in vocab:
        return IM_END
    return tokenizer.eos_token


def _render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat template's text for ``messages``; a template that fails or renders no string makes the line bad."""
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - jinja errors of arbitrary templates
        raise BadRecord(f"chat template failed: {type(e).__name__}: {e}") from None
    if not isinstance(rendered, str):
        raise BadRecord("chat template did not render to a string")
    return rendered


# A piece of a sample: text to tokenize, or token ids taken as they are; and whether it is supervised.
Piece = tuple[str | list[int], bool]


def chat_segments(messages: list[dict], tokenizer, end_token: str | None, cut_at_end: bool = False) -> list[Piece]:
    """Cut the rendered chat into ``(text, supervised)`` pieces; ``cut_at_end``: the final assistant
    turn was cut short, so the sample ends with its content (no end token, nothing after it)."""
    rendered = _render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = _spans_by_placeholders(messages, tokenizer, rendered)
    if spans is None:
        spans = _spans_by_search(messages, tokenizer, rendered)
    pieces: list[Piece] = []
    pos = 0
    # a non-blank final assistant content always has a span, the last one
    cut = cut_at_end and messages[-1]["role"] == "assistant" and bool(messages[-1]["content"].strip())
    for n, (a, b) in enumerate(spans):
        if b <= a:
            continue
        last = cut and n == len(spans) - 1
        if end_token and rendered.startswith(end_token, b) and not last:
            b += len(end_token)
        if a > pos:
            pieces.append((rendered[pos:a], False))
        pieces.append((rendered[a:b], True))
        pos = b
        if last:
            return pieces
    if pos < len(rendered):
        pieces.append((rendered[pos:], False))
    return pieces


def answer_ids_pieces(messages: list[dict], ids: list[int], tokenizer, end_token: str | None, cut_at_end: bool) -> list[Piece]:
    """A chat whose final assistant turn carries the target's token ids: the prompt the target answered,
    the ids, then the template's text after an assistant content (unless the answer was cut)."""
    prompt = _render_chat(tokenizer, messages[:-1], add_generation_prompt=True)
    pieces: list[Piece] = [(prompt, False), (list(ids), True)]
    if cut_at_end:
        return pieces
    tail = _text_after_answer(messages, tokenizer)
    if end_token and tail.startswith(end_token):
        pieces.append((end_token, True))
        tail = tail[len(end_token) :]
    if tail:
        pieces.append((tail, False))
    return pieces


def _text_after_answer(messages: list[dict], tokenizer) -> str:
    """What the chat template writes after the final assistant content (ChatML: ``<|im_end|>\\n``),
    found by rendering a placeholder in its place."""
    mark = "\ue000answer\ue001"
    last = {k: v for k, v in messages[-1].items() if k != ANSWER_IDS_FIELD}
    skeleton = _render_chat(tokenizer, messages[:-1] + [{**last, "content": mark}], add_generation_prompt=False)
    if skeleton.count(mark) != 1:
        raise BadRecord(
            "the chat template does not write the assistant content as given, so its token_ids have no place; drop them to use the text"
        )
    return skeleton[skeleton.index(mark) + len(mark) :]


def _spans_by_placeholders(messages, tokenizer, rendered) -> list[tuple[int, int]] | None:
    """Exact assistant-content spans when the template inserts contents verbatim: render with
    unique placeholders, substitute the real contents back and check the result is identical."""
    marks = [f"\ue000{j}\ue001" for j in range(len(messages))]
    if any("\ue000" in m["content"] for m in messages):
        return None
    try:
        skeleton = tokenizer.apply_chat_template(
            [{**m, "content": marks[j]} for j, m in enumerate(messages)], tokenize=False, add_generation_prompt=False
        )
    except Exception:  # noqa: BLE001
        return None
    out, spans, pos = [], [], 0
    for j, m in enumerate(messages):
        k = skeleton.find(marks[j], pos)
        if k < 0 or skeleton.find(marks[j], k + 1) >= 0:
            return None
        out.append(skeleton[pos:k])
        start = sum(len(s) for s in out)
        out.append(m["content"])
        if m["role"] == "assistant":
            spans.append((start, start + len(m["content"])))
        pos = k + len(marks[j])
    out.append(skeleton[pos:])
    if "".join(out) != rendered:
        return None
    return spans


def _spans_by_search(messages, tokenizer, rendered) -> list[tuple[int, int]]:
    """Fallback for templates that rewrite contents (e.g. strip them): find each content in
    order in the rendered text, trying the stripped content when the verbatim one is absent.
    An assistant content is searched from the end of the generation prompt that precedes it
    (``messages[:j]`` rendered with ``add_generation_prompt``) when the full rendering starts
    with that prompt, so it cannot match inside the turn header."""
    spans, cursor = [], 0
    for j, m in enumerate(messages):
        c = m["content"]
        if m["role"] == "assistant" and j > 0:
            try:
                prompt = tokenizer.apply_chat_template(messages[:j], tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001
                prompt = None
            if isinstance(prompt, str) and rendered.startswith(prompt):
                cursor = max(cursor, len(prompt))
        found = -1
        for cand in (c, c.strip()):
            if cand:
                k = rendered.find(cand, cursor)
                if k >= 0:
                    found, c = k, cand
                    break
        if found < 0:
            if m["role"] == "assistant" and c.strip():
                raise BadRecord(f"assistant turn {j} not found in the rendered chat template")
            continue
        if m["role"] == "assistant":
            spans.append((found, found + len(c)))
        cursor = found + len(c)
    return spans
