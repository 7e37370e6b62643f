"""A chat record as the pieces of one training sample: text (or token ids) and whether it is supervised.

The drafter learns to predict what the target generates, so the loss mask covers what the target
would have written after the chat template's generation prompt, and the token it stops at. Chats
are rendered with the tokenizer's own chat template (:mod:`~dflash_ipc.data.chat_render` finds each
turn in the rendered text); each piece is tokenized on its own, so no token straddles a supervised
boundary.

**The answer** (a final assistant turn) is laid out as the target produced it: the generation prompt
it answered (``messages[:-1]`` rendered with ``add_generation_prompt``, unsupervised), then what it
wrote after that prompt (supervised), then what the template writes after the turn: the end-of-turn
token supervised when the target stops at it (a stop id: :func:`~dflash_ipc.data.tokenizer.stop_token_ids`,
eos, ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, the target's generation-config eos ids), the rest
not. What the target wrote is, in order:

* the answer's ``token_ids`` when it stores them (gen-data's records), verbatim;
* else the template's own rendering of the turn after the generation prompt, when the template writes it
  there whole: reasoning it places (Qwen3's ``<think>`` block from ``reasoning_content`` or the content,
  gpt-oss's analysis message from ``thinking``, with the channel headers between) is supervised with
  the content. When the record carries no reasoning, the text the template writes before a bare content
  (an empty think block, gpt-oss's final-channel header) is template text, not the target's: unsupervised;
* else, when the template drops part of the answer (DeepSeek-R1 strips the reasoning of every turn), the
  content itself, less what the generation prompt already opened (R1's ``<think>\\n``) when it starts so;
* else the turn as the template renders it, like an earlier turn. An answer the template writes apart from
  a generation prompt that opened nothing (reasoning after a prompt that closed it: thinking turned off)
  is a bad record: the target never writes it.

**Earlier assistant turns** are context the template rewrites (reasoning stripped, ``<|end|>`` where
gpt-oss's answer ended with ``<|return|>``): their content as the template writes it is supervised, and
the token that closes them when it is a stop token.

A record with ``"finish": "length"`` (an answer cut at gen-data's ``--max-new``) ends at the cut, ids or
text: no end token is appended, since the target never produced one, and a supervised one would teach
the drafter to end turns where the target does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ipc.data.chat_render import (
    closing_at,
    common_prefix,
    content_span,
    render,
    unused_mark,
    with_content,
)
from dflash_ipc.data.records import BadRecord

# A piece of a sample: text to tokenize, or token ids taken as they are; and whether it is supervised.
Piece = tuple[str | list[int], bool]


@dataclass(frozen=True)
class FinalTurn:
    """A final assistant turn as the target produced it."""

    prompt: str  # the chat before it, with the generation prompt: what the target answered
    scaffold: str  # what the template writes between the prompt and a bare content ("" when nothing)
    generated: str | None  # the text the target wrote after the prompt; None when the record cannot say
    tail: str  # what the template writes after the turn's content (its end-of-turn token first)
    opened: str  # what the generation prompt writes beyond a bare turn's start (R1: "<think>\n"), the target's to close
    unfit: str = ""  # why the record's text cannot be the target's answer ("": it can); its token_ids still can


def _holds(rendered: str, content: str) -> bool:
    """Whether ``rendered`` holds all of ``content``'s text, whitespace aside (templates trim and re-space)."""
    return "".join(content.split()) in "".join(rendered.split())


def final_turn(tokenizer, messages: list[dict]) -> FinalTurn:
    """The final assistant turn of ``messages`` as the target produced it (see the module docstring)."""
    history, answer = messages[:-1], messages[-1]
    prompt = render(tokenizer, history, add_generation_prompt=True)
    full = render(tokenizer, messages, add_generation_prompt=False)
    mark = unused_mark(prompt, full)
    marked = render(tokenizer, with_content(messages, len(messages) - 1, mark), add_generation_prompt=False)
    if marked.count(mark) != 1:
        raise BadRecord("the chat template does not write the answer's content once, so the answer has no place in the chat")
    tail = marked[marked.index(mark) + len(mark) :]
    bare = render(tokenizer, [*history, {"role": "assistant", "content": mark}], add_generation_prompt=False)
    at = bare.find(mark)
    scaffold = bare[len(prompt) : at] if bare.startswith(prompt) and at >= len(prompt) else ""
    opened = prompt[common_prefix(prompt, bare) :]
    content, end = answer["content"], len(full) - len(tail)
    if full.startswith(prompt):
        written = full[len(prompt) : end] if full.endswith(tail) and end >= len(prompt) else ""
        # the template writes the turn after the prompt; where it drops some of the content (R1's reasoning), the
        # content is the answer as the target wrote it
        return FinalTurn(prompt, scaffold, written if _holds(written, content) else content, tail, opened)
    if not opened:
        unfit = (
            "the chat template writes this answer apart from the generation prompt the target answers (reasoning where "
            "the prompt has closed it: thinking turned off in [chat_template] kwargs?), so the target never writes it"
        )
        return FinalTurn(prompt, scaffold, None, tail, opened, unfit)
    return FinalTurn(prompt, scaffold, content[len(opened) :] if content.startswith(opened) else None, tail, opened)


def chat_pieces(
    messages: list[dict], tokenizer, closings: tuple[str, ...], cut_at_end: bool = False, answer_ids: list[int] | None = None
) -> list[Piece]:
    """The pieces of a chat; ``closings``: the texts of the stop tokens (:func:`~dflash_ipc.data.chat_render.closing_texts`);
    ``cut_at_end``: the answer was cut short; ``answer_ids``: the ids the target generated for the answer."""
    if messages[-1]["role"] == "assistant" and len(messages) > 1:
        turn = final_turn(tokenizer, messages)
        if answer_ids is not None or turn.generated is not None:
            pieces = _turn_pieces(tokenizer, messages[:-1], turn.prompt, True, closings)
            pieces += [(list(answer_ids), True)] if answer_ids is not None else _answer_text_pieces(turn)
            return pieces if cut_at_end else pieces + _tail_pieces(turn.tail, closings)
        if turn.unfit:
            raise BadRecord(turn.unfit)
    if answer_ids is not None:
        raise BadRecord("the answer carries token_ids but no prompt precedes it")
    rendered = render(tokenizer, messages, add_generation_prompt=False)
    return _turn_pieces(tokenizer, messages, rendered, False, closings, cut_last=cut_at_end)


def _answer_text_pieces(turn: FinalTurn) -> list[Piece]:
    text = turn.generated or ""
    if turn.scaffold and text.startswith(turn.scaffold):  # the record carries no reasoning: template text, not the target's
        return [(turn.scaffold, False), (text[len(turn.scaffold) :], True)]
    return [(text, True)]


def _tail_pieces(tail: str, closings: tuple[str, ...]) -> list[Piece]:
    closing = closing_at(tail, 0, closings)
    pieces: list[Piece] = [(closing, True)] if closing else []
    return pieces + [(tail[len(closing) :], False)] if tail[len(closing) :] else pieces


def _turn_pieces(
    tokenizer, messages: list[dict], rendered: str, add_generation_prompt: bool, closings: tuple[str, ...], cut_last: bool = False
) -> list[Piece]:
    """``rendered`` (``messages`` rendered with ``add_generation_prompt``) cut at the assistant turns: each
    content supervised with the stop token that closes it; ``cut_last``: the sample ends with the final content."""
    pieces: list[Piece] = []
    pos = 0
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = content_span(tokenizer, messages, j, rendered, add_generation_prompt)
        if start < pos:
            raise BadRecord(f"the chat template writes assistant turn {j} before the turns that precede it")
        last = cut_last and j == len(messages) - 1
        if not last:
            end += len(closing_at(rendered, end, closings))
        if start > pos:
            pieces.append((rendered[pos:start], False))
        pieces.append((rendered[start:end], True))
        pos = end
        if last:
            return pieces
    if pos < len(rendered):
        pieces.append((rendered[pos:], False))
    return pieces
