"""The ``[chat_template]`` config section: keyword arguments every chat-template rendering gets.

::

    [chat_template]
    kwargs = { enable_thinking = false }     # e.g. Qwen3-family templates

Set once here, they reach every place that renders a chat with the tokenizer's template, through
:func:`dflash_ipc.data.tokenizer.config_tokenizer`: gen-data's prompts, the training corpus (the
rendered text decides the loss mask: template text is never supervised), the supervisor's data
plan, and eval's prompts. The export records them (``chat_template_kwargs`` in
``export/drafter/config.json``) and eval refuses a drafter whose recorded kwargs differ from the
config's: a drafter trained with thinking on and served with it off sees other prompts than it
learned (a known cause of collapsed acceptance).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dflash_ipc.config_fields import require

__all__ = ["RESERVED_KWARGS", "ChatTemplateConfig"]

# Names ``apply_chat_template`` takes itself or passes to every template: a kwarg of the same name
# would silently replace the conversation, the generation prompt or a special token.
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
    }
)


@dataclass
class ChatTemplateConfig:
    # Keyword arguments of the tokenizer's chat template (template variables), e.g. enable_thinking.
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, value in self.kwargs.items():
            require(key.isidentifier(), "kwargs", f"{key!r} is not a template variable name (letters, digits, _)")
            require(key not in RESERVED_KWARGS, "kwargs", f"{key!r} is set by apply_chat_template itself; remove it")
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                require(False, "kwargs", f"{key} = {value!r}: only strings, numbers, booleans, arrays and tables")
