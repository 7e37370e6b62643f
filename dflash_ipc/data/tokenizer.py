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
from importlib import resources
from pathlib import Path

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
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

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
            f"built-in tokenizer asset {path} is missing; reinstall dflash-ipc or run "
            "`python -m dflash_ipc.data.tokenizer_asset`"
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
            f"target.tokenizer: {spec!r} is neither \"builtin\" nor a local directory; "
            "point it at a directory holding tokenizer.json/tokenizer_config.json (no downloads are made)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise TokenizerError(f"target.tokenizer: cannot load a tokenizer from {path}: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise TokenizerError(f"target.tokenizer: {path} loads a slow tokenizer; a fast (tokenizers) one is needed")
    return tok


def mask_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id DFlash fills masked block positions with.

    The tokenizer's mask token if it has one (the built-in one: ``<|mask|>``), else its pad
    token, else the last id of the vocabulary.
    """
    for tid in (getattr(tokenizer, "mask_token_id", None), getattr(tokenizer, "pad_token_id", None)):
        if tid is not None and tid >= 0:
            return int(tid)
    return len(tokenizer) - 1


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
    h.update(repr(sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    return h.hexdigest()
