"""The pre-query prefix of a chat template: its text up to where a user's words start.

Rendered by the tokenizer's own template (a conversation ending in a sentinel user message, cut at
the sentinel), so nothing is hard-coded per model and a default system prompt the template injects
is kept. Prompt synthesis (:mod:`dflash_ipc.datagen.synth`) samples user requests from it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pre_query_template", "user_turn_stops"]

_SENTINEL = "\ue000dflash-ipc-user-turn\ue001"


def _render_cut(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """The chat template's text of ``messages`` + a sentinel user turn, cut at the sentinel: (before, after)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: prompt synthesis samples user turns from the template's "
            "pre-query prefix; use an instruction-tuned target's tokenizer or give --prompts a file"
        )
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False)
    if not isinstance(text, str) or text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not write a user message verbatim, so it has no pre-query prefix to sample from")
    before, _, after = text.partition(_SENTINEL)
    return before, after


def pre_query_template(tokenizer, system: str | None = None, history: list[dict] | None = None) -> str:
    """The template's text up to where a user's words start (after ``history``, with ``system`` if given;
    else whatever system prompt the template injects by default)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    return _render_cut(tokenizer, msgs)[0]


def user_turn_stops(tokenizer, generation_config: Any = None) -> set[int]:
    """Ids that end a user turn: the assistant stops, plus the special token the template closes a user turn with."""
    from dflash_ipc.data.tokenizer import stop_token_ids

    stops = stop_token_ids(tokenizer, generation_config)
    after = _render_cut(tokenizer, [])[1]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if ids and ids[0] in set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {}):
        stops.add(int(ids[0]))
    return stops
