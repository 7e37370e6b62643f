"""The chat formats of the target families, as test data: each family's chat template written after
the published one (the parts a plain chat renders: system, user and assistant turns, reasoning, the
generation prompt; tool calls left out), the special tokens it uses, the ids its generation config
stops at, and one multi-turn conversation with the text the target generates for its last answer.

The tokenizer is the built-in one with the family's special tokens added (:func:`format_tokenizer`),
so the templates' markers are single tokens as in the real vocabularies and no hub is reached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash_ipc.data.tokenizer import bind_chat_template_kwargs, bind_target_stops, build_builtin_tokenizer

# Llama 3.1 Instruct: a system block with the knowledge and today dates always, contents trimmed,
# every turn closed by <|eot_id|> (the tokenizer's eos).
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma 3: no system role (its text opens the first user turn), the assistant is "model", contents
# trimmed, every turn closed by <end_of_turn> and a newline; roles must alternate.
GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# gpt-oss (harmony): a system message with the model identity, dates and reasoning effort; the system
# turn becomes the developer's instructions; an assistant answer is an analysis message ("thinking",
# rendered for the last turn only) and a final message; the last answer ends with <|return|>, earlier
# ones with <|end|>; the generation prompt is a bare "<|start|>assistant".
GPT_OSS = (
    "{{- '<|start|>system<|message|>' }}"
    "{%- if model_identity is not defined %}"
    "{%- set model_identity = 'You are ChatGPT, a large language model trained by OpenAI.' %}{%- endif %}"
    "{{- model_identity + '\\n' }}"
    "{{- 'Knowledge cutoff: 2024-06\\n' }}"
    "{{- 'Current date: ' + strftime_now('%Y-%m-%d') + '\\n\\n' }}"
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "{{- 'Reasoning: ' + reasoning_effort + '\\n\\n' }}"
    "{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}"
    "{{- '<|end|>' }}"
    "{%- if messages[0].role == 'developer' or messages[0].role == 'system' %}"
    "{%- set developer_message = messages[0].content %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set developer_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if developer_message %}"
    "{{- '<|start|>developer<|message|>' + '# Instructions\\n\\n' + developer_message + '\\n\\n' + '<|end|>' }}"
    "{%- endif %}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if '<|channel|>analysis<|message|>' in message.content or '<|channel|>final<|message|>' in message.content %}"
    "{{- raise_exception('pass the analysis message in the thinking field, the final one in the content field') }}"
    "{%- endif %}"
    "{%- if loop.last and not add_generation_prompt %}"
    "{%- if 'thinking' in message %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}"
    "{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- else %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}"
    "{%- elif message.role == 'user' -%}"
    "{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def _qwen3(generation_prompt: str, every_answer_after_the_query: str) -> str:
    """Qwen3's ChatML with reasoning: "reasoning_content" or a <think> block in the content; an answer after
    the last user query is written with its think block, earlier ones without."""
    return (
        "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
        "{%- for message in messages[::-1] %}"
        "{%- set index = (messages|length - 1) - loop.index0 %}"
        "{%- if ns.multi_step_tool and message.role == 'user' %}"
        "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        "{%- set content = message.content %}{%- set reasoning_content = '' %}"
        "{%- if message.reasoning_content is defined and message.reasoning_content is not none %}"
        "{%- set reasoning_content = message.reasoning_content %}"
        "{%- elif '</think>' in message.content %}"
        "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
        "{%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
        "{%- endif %}"
        "{%- if loop.index0 > ns.last_query_index and (" + every_answer_after_the_query + ") %}"
        "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
        " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}" + generation_prompt + "{%- endif %}"
    )


# Qwen3: the generation prompt leaves thinking to the model (an empty think block with enable_thinking=false).
QWEN3 = _qwen3(
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "loop.last or reasoning_content",
)
# Qwen3.5 / 3.6: the generation prompt opens the think block itself.
QWEN3_5 = _qwen3(
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}",
    "true",
)

# DeepSeek-R1: the system text right after bos, no separators; every answer is written without its
# reasoning (the content after </think>); the generation prompt opens the think block.
DEEPSEEK_R1 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}"
    "{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor -%}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)

# Phi-3: every turn closed by <|end|>, which only the generation config names a stop (the tokenizer's eos is
# <|endoftext|>, which the template appends after the last turn).
PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

SYSTEM = "You are terse."
ASKS = ("What is a list in Python?", "And a tuple?")
THOUGHTS = ("The user asks about lists.", "Tuples cannot change.")
ANSWERS = ("A mutable sequence.", "An immutable sequence.")


def _harmony(thought: str, answer: str) -> str:
    return f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>final<|message|>{answer}"


def _think_block(thought: str, answer: str) -> str:
    return f"<think>\n{thought}\n</think>\n\n{answer}"


def _after_opened_block(thought: str, answer: str) -> str:
    return f"{thought}\n</think>\n\n{answer}"


@dataclass(frozen=True)
class ChatFormat:
    """One family's chat format: its template and tokens, how a dataset row holds an answer, what the target
    generates for one, and what trains of the earlier answer of :attr:`conversation`."""

    name: str
    template: str
    special_tokens: tuple[str, ...]  # added to the built-in tokenizer (its <|endoftext|>, <|im_start|>, <|im_end|> exist)
    eos: str
    stops: tuple[str, ...]  # the tokens the target's generation config stops at
    row_answer: Callable[[str, str], dict]  # (thought, answer) -> the assistant message's fields in a plain dataset row
    generation: Callable[[str, str], str]  # (thought, answer) -> what the target writes after the generation prompt
    stop: str  # the stop token it ends an answer with
    earlier: str  # what trains of the conversation's first answer: its content as the template writes it, its closing stop
    bos: str | None = None
    kwargs: dict = field(default_factory=dict)

    @property
    def conversation(self) -> list[dict]:
        """system, user, assistant, user, assistant: a plain dataset row."""
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": ASKS[0]},
            {"role": "assistant", **self.row_answer(THOUGHTS[0], ANSWERS[0])},
            {"role": "user", "content": ASKS[1]},
            {"role": "assistant", **self.row_answer(THOUGHTS[1], ANSWERS[1])},
        ]

    @property
    def generated(self) -> str:
        """What the target generates for the conversation's last answer, its stop token aside."""
        return self.generation(THOUGHTS[1], ANSWERS[1])


_THINK = ("<think>", "</think>")


def _answer_only(name: str, template: str, tokens: tuple[str, ...], stop: str, row_pad: str, **kw) -> ChatFormat:
    """A format without reasoning: the target writes the answer, the template pads a row's with ``row_pad``
    (trimmed away), and an earlier answer trains with the stop token that closes it."""
    return ChatFormat(
        name,
        template,
        tokens,
        row_answer=lambda t, a: {"content": a + row_pad},
        generation=lambda t, a: a,
        stop=stop,
        earlier=ANSWERS[0] + stop,
        **kw,
    )


_QWEN3 = ChatFormat(
    "qwen3",
    QWEN3,
    _THINK,
    eos="<|im_end|>",
    stops=("<|im_end|>", "<|endoftext|>"),
    row_answer=lambda t, a: {"content": _think_block(t, a)},
    generation=_think_block,
    stop="<|im_end|>",
    earlier=ANSWERS[0] + "<|im_end|>",  # its reasoning stripped by the template
)

FORMATS = (
    _answer_only(
        "llama3",
        LLAMA3,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|eot_id|>",
        "\n",
        eos="<|eot_id|>",
        stops=("<|end_of_text|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
    ),
    _answer_only(
        "gemma3",
        GEMMA3,
        ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        "<end_of_turn>",
        "  ",
        eos="<eos>",
        stops=("<eos>", "<end_of_turn>"),
        bos="<bos>",
    ),
    ChatFormat(
        "gpt_oss",
        GPT_OSS,
        ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"),
        eos="<|return|>",
        stops=("<|return|>", "<|endoftext|>", "<|call|>"),
        row_answer=lambda t, a: {"content": a, "thinking": t},
        generation=_harmony,
        stop="<|return|>",
        earlier=ANSWERS[0],  # its <|end|> is no stop: the target ended that answer with <|return|>
    ),
    _QWEN3,
    dataclasses.replace(  # the empty think block is the generation prompt's
        _QWEN3,
        name="qwen3_no_thinking",
        row_answer=lambda t, a: {"content": a},
        generation=lambda t, a: a,
        kwargs={"enable_thinking": False},
    ),
    dataclasses.replace(
        _QWEN3,
        name="qwen3_5",
        template=QWEN3_5,
        row_answer=lambda t, a: {"content": a, "reasoning_content": t},
        generation=_after_opened_block,  # the generation prompt opened the block
    ),
    ChatFormat(
        "deepseek_r1",
        DEEPSEEK_R1,
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", *_THINK),
        eos="<｜end▁of▁sentence｜>",
        stops=("<｜end▁of▁sentence｜>",),
        bos="<｜begin▁of▁sentence｜>",
        row_answer=lambda t, a: {"content": _think_block(t, a)},  # the template strips the block from every answer
        generation=_after_opened_block,  # the generation prompt opened the block
        stop="<｜end▁of▁sentence｜>",
        earlier=f"\n\n{ANSWERS[0]}<｜end▁of▁sentence｜>",  # the template keeps what follows </think>
    ),
    _answer_only(
        "phi3",
        PHI3,
        ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        "<|end|>",
        "",
        eos="<|endoftext|>",
        stops=("<|endoftext|>", "<|assistant|>", "<|end|>"),
    ),
)
FORMAT_BY_NAME = {f.name: f for f in FORMATS}


def format_tokenizer(fmt: ChatFormat, bind_stops: bool = True):
    """The built-in tokenizer with ``fmt``'s special tokens, eos, bos and chat template (and kwargs); with
    ``bind_stops`` its stop ids include the generation config's, as :func:`~dflash_ipc.data.tokenizer.config_tokenizer` binds them."""
    tok = build_builtin_tokenizer()
    tok.add_tokens([t for t in fmt.special_tokens if t in _THINK])  # added, not special: decoding keeps them, as Qwen3's and R1's do
    tok.add_special_tokens({"additional_special_tokens": [t for t in fmt.special_tokens if t not in tok.get_vocab()]})
    tok.eos_token = fmt.eos
    if fmt.bos is not None:
        tok.bos_token = fmt.bos
    tok.chat_template = fmt.template
    bind_chat_template_kwargs(tok, fmt.kwargs)
    if bind_stops:
        bind_target_stops(tok, [tok.convert_tokens_to_ids(t) for t in fmt.stops])
    return tok
