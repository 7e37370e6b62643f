"""Tokenizers: the offline built-in tokenizer, and local Hugging Face tokenizer directories.

The built-in tokenizer is a small byte-level BPE (1024 ids, Qwen2-style pre-tokenizer
regex, no normalizer, so ``decode(encode(text)) == text`` for any text) with Qwen-style
ChatML special tokens and chat template::

    ids 0..1019   byte-level BPE (256 byte symbols + 764 merges)
    1020 <|endoftext|>   pad
    1021 <|im_start|>
    1022 <|im_end|>      eos (closes every chat turn)
    1023 <|mask|>        DFlash mask token

Its merges are trained once with ``tokenizers`` on the built-in ``builtin:stdlib-docs``
corpus and shipped as ``dflash_ipc/assets/builtin_tokenizer.json`` (about 20 KB), so
loading it needs no network, no training and gives the same ids on every machine
(training at run time would tie the vocabulary to the local Python version's docstrings).
Regenerate the asset with ``python -m dflash_ipc.data.tokenizer_asset`` (:mod:`dflash_ipc.data.tokenizer_asset`).
"""

from __future__ import annotations

import hashlib
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

BUILTIN_SPEC = "builtin"
BUILTIN_NAME = "dflash-ipc/builtin-bpe-1024"
ASSET_NAME = "builtin_tokenizer.json"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN]  # appended after the BPE ids, in this order
BPE_VOCAB_SIZE = 1020
VOCAB_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)

# Qwen2/Qwen3 pre-tokenizer split: letters with one leading non-letter, single digits, punctuation
# runs, newlines, whitespace.
SPLIT_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Qwen-style ChatML (without tool calls / thinking blocks): every turn is
# "<|im_start|>{role}\n{content}<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class TokenizerError(ValueError):
    """A tokenizer spec that cannot be loaded; the message says what to change."""


def asset_path() -> Path:
    return Path(str(resources.files("dflash_ipc.assets").joinpath(ASSET_NAME)))


def build_builtin_tokenizer() -> PreTrainedTokenizerFast:
    """The offline built-in tokenizer (a fresh instance on every call)."""
    path = asset_path()
    if not path.is_file():
        raise TokenizerError(
            f"built-in tokenizer asset {path} is missing; reinstall dflash-ipc or run `python -m dflash_ipc.data.tokenizer_asset`"
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.name_or_path = BUILTIN_NAME
    if len(tok) != VOCAB_SIZE or tok.convert_tokens_to_ids(MASK_TOKEN) != VOCAB_SIZE - 1:
        raise TokenizerError(f"built-in tokenizer asset {path} is corrupt (unexpected vocabulary)")
    return tok


def load_tokenizer(spec: str, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """``"builtin"`` -> :func:`build_builtin_tokenizer`; otherwise a local tokenizer directory.

    ``cache_dir`` is accepted for symmetry with the data cache; the built-in tokenizer is a
    shipped asset and needs no cache. Never touches the network.
    """
    del cache_dir
    if spec == BUILTIN_SPEC:
        return build_builtin_tokenizer()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise TokenizerError(
            f'target.tokenizer: {spec!r} is neither "builtin" nor a local directory; '
            "point it at a directory holding tokenizer.json/tokenizer_config.json (no downloads are made)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise TokenizerError(f"target.tokenizer: cannot load a tokenizer from {path}: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise TokenizerError(f"target.tokenizer: {path} loads a slow tokenizer; a fast (tokenizers) one is needed")
    return tok


# The attribute a tokenizer bound by :func:`bind_chat_template_kwargs` carries its kwargs in.
TEMPLATE_KWARGS_ATTR = "dflash_chat_template_kwargs"


def bind_chat_template_kwargs(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> PreTrainedTokenizerBase:
    """``tokenizer`` whose ``apply_chat_template`` passes ``kwargs`` (template variables) on every call,
    so each renderer (corpus, gen-data, eval) applies the same ones without threading them through
    its own calls; a call's own keyword arguments win. Part of :func:`tokenizer_identity`."""
    if not kwargs:
        return tokenizer
    render = tokenizer.apply_chat_template
    bound = dict(kwargs)

    def apply_chat_template(conversation, *args, **call_kwargs):
        return render(conversation, *args, **{**bound, **call_kwargs})

    tokenizer.apply_chat_template = apply_chat_template
    setattr(tokenizer, TEMPLATE_KWARGS_ATTR, bound)
    return tokenizer


# The attribute a tokenizer bound by :func:`bind_target_stops` carries the target's generation-config eos ids in.
TARGET_STOPS_ATTR = "dflash_target_stop_ids"


def bind_target_stops(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> PreTrainedTokenizerBase:
    """``tokenizer`` whose :func:`stop_token_ids` include ``ids`` (the target's generation-config eos ids),
    so the corpus closes turns on the tokens gen-data and eval stop at without loading the model (Phi-3
    ends a turn with ``<|end|>``, which its tokenizer's eos does not name; gpt-oss writes ``<|end|>``
    inside an answer, so no name list can hold it). Part of :func:`tokenizer_identity`."""
    if ids:
        setattr(tokenizer, TARGET_STOPS_ATTR, sorted(set(ids)))
    return tokenizer


def target_stop_ids(target_cfg: Any, vocab_size: int) -> list[int]:
    """The eos ids transformers' ``generate`` stops the target at: its checkpoint's ``generation_config.json``,
    else the generation config of its model config (a random spec's too)."""
    from transformers import GenerationConfig

    from dflash_ipc.target_spec.hf_config import load_hf_config

    generation = None
    if target_cfg.model_path:
        try:
            generation = GenerationConfig.from_pretrained(target_cfg.model_path, local_files_only=True)
        except OSError:  # no generation_config.json: transformers derives one from the model config
            generation = None
    if generation is None:
        generation = GenerationConfig.from_model_config(load_hf_config(target_cfg, vocab_size=vocab_size))
    eos = generation.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]


def config_tokenizer(cfg) -> PreTrainedTokenizerBase:
    """The tokenizer of a :class:`~dflash_ipc.config.DFlashConfig` (``target.tokenizer``) with its
    ``[chat_template] kwargs`` and the target's stop ids bound: what every process that renders chats loads."""
    tokenizer = bind_chat_template_kwargs(load_tokenizer(cfg.target.tokenizer), cfg.chat_template.kwargs)
    return bind_target_stops(tokenizer, target_stop_ids(cfg.target, len(tokenizer)))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: Any = None) -> set[int]:
    """Ids that end a generated turn: eos, ``<|im_end|>`` / ``<|endoftext|>`` / ``<|eot_id|>`` /
    ``<end_of_turn>`` where the vocabulary has them, the target's eos ids bound by
    :func:`bind_target_stops`, and ``generation_config``'s eos ids."""
    ids: set[int] = set(getattr(tokenizer, TARGET_STOPS_ATTR, ()))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for name in (IM_END, PAD_TOKEN, "<|eot_id|>", "<end_of_turn>"):
        if name in vocab:
            ids.add(int(vocab[name]))
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


# Special tokens that a chat model never emits: free to stand for "masked" in a draft block.
_UNUSED_TOKEN = re.compile(r"reserved|unused|empty_output|<\|mask\|>|<mask>", re.IGNORECASE)


def choose_mask_token(tokenizer: PreTrainedTokenizerBase, model_vocab_size: int | None = None) -> tuple[int, str]:
    """The id DFlash fills masked block positions with, and why it was chosen.

    Never a stop / end-of-turn token (a decoder that scans drafts for stop tokens would stop
    on it). In order: the tokenizer's own mask token; a special token that is reserved or
    unused (``<|reserved_special_token_0|>``, SmolLM2's ``<empty_output>``, ...); the first
    embedding row past the tokenizer when the model's vocabulary is larger (Qwen-style padded
    vocabularies, z-lab's choice); the pad token; the last vocabulary id that is no stop token.
    """
    stops = stop_token_ids(tokenizer)
    tid = getattr(tokenizer, "mask_token_id", None)
    if tid is not None and tid >= 0 and tid not in stops:
        return int(tid), f"the tokenizer's mask token {tokenizer.convert_ids_to_tokens(int(tid))!r}"
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for i in sorted(added):
        content = str(getattr(added[i], "content", added[i]))
        if i not in stops and _UNUSED_TOKEN.search(content):
            return int(i), f"the unused special token {content!r}"
    n = len(tokenizer)
    if model_vocab_size is not None and model_vocab_size > n:
        return n, f"id {n}, the first embedding row past the tokenizer's {n} ids (model vocabulary {model_vocab_size})"
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None and pad >= 0 and pad not in stops:
        return int(pad), f"the pad token {tokenizer.convert_ids_to_tokens(int(pad))!r}"
    last = next(i for i in range(n - 1, -1, -1) if i not in stops)
    return last, f"the last vocabulary id that is no stop token ({tokenizer.convert_ids_to_tokens(last)!r})"


def mask_token_id(tokenizer: PreTrainedTokenizerBase, model_vocab_size: int | None = None) -> int:
    """:func:`choose_mask_token`'s id."""
    return choose_mask_token(tokenizer, model_vocab_size)[0]


def check_vocab(tokenizer: PreTrainedTokenizerBase, model_vocab_size: int, tokenizer_spec: str) -> None:
    """Refuse a tokenizer that does not belong to the model: ids past the embedding table, or
    a table much larger than the tokenizer (the built-in 1,024 ids fed to a 49,152-id model).
    A model vocabulary a little larger than the tokenizer is padding (Qwen: +267) and is fine."""
    n = len(tokenizer)
    if n > model_vocab_size or model_vocab_size - n > VOCAB_PADDING_SLACK:
        raise TokenizerError(
            f"target.tokenizer: {tokenizer_spec!r} has {n} ids but the target model's vocabulary has {model_vocab_size}: "
            "they do not belong together; leave target.tokenizer unset (the model's own tokenizer) or point it at the "
            "model's tokenizer directory"
        )


VOCAB_PADDING_SLACK = 1024


def check_target_tokenizer(target_cfg: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    """:func:`check_vocab` against a checkpoint target's config (a random spec takes the
    tokenizer's size, so it always fits)."""
    if not target_cfg.model_path:
        return
    from dflash_ipc.target_spec.hf_config import load_hf_config, text_config

    check_vocab(tokenizer, int(text_config(load_hf_config(target_cfg)).vocab_size), target_cfg.tokenizer)


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable hash of everything that decides token ids: vocabulary, merges, added tokens,
    normalizer/pre-tokenizer, and the chat template. Used to key the tokenized-data cache."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # pragma: no cover - slow tokenizers are refused by load_tokenizer
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    template = tokenizer.chat_template
    h.update(repr(template).encode())
    for bound in (TEMPLATE_KWARGS_ATTR, TARGET_STOPS_ATTR):  # only when set: unbound tokenizers keep their identity
        if getattr(tokenizer, bound, None):
            h.update(json.dumps(getattr(tokenizer, bound), sort_keys=True).encode())
    h.update(repr(sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    return h.hexdigest()


def vocab_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """``sha256:<hex>`` of the id -> token mapping (added tokens included): what stored token ids mean.
    Unlike :func:`tokenizer_identity` it ignores merges, normalizer and chat template, which decide
    how text becomes ids but not what an id stands for (gen-data stamps its answers' ids with it)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return "sha256:" + hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
