"""Train the built-in tokenizer's BPE and write its shipped asset.

Run ``python -m dflash_ipc.data.tokenizer_asset`` to regenerate
``dflash_ipc/assets/builtin_tokenizer.json`` from the docstrings of the running Python's standard
library (:mod:`dflash_ipc.data.builtin_corpus`). Kept apart from :mod:`dflash_ipc.data.tokenizer`
so loading a tokenizer never depends on the corpus code.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from dflash_ipc.data.builtin_corpus import stdlib_doc_entries
from dflash_ipc.data.tokenizer import BPE_VOCAB_SIZE, SPECIAL_TOKENS, SPLIT_PATTERN, VOCAB_SIZE, asset_path


def train_builtin_tokenizer(texts: Iterable[str]):
    """Train the built-in BPE on ``texts`` (deterministic for the same texts); returns a
    ``tokenizers.Tokenizer`` with the special tokens appended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(list(texts), trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {tok.get_vocab_size()} ids, expected {VOCAB_SIZE}")
    return tok


def write_asset(out: Path) -> str:
    """Train on the standard library's docstrings and write the tokenizer JSON to ``out``."""
    entries = stdlib_doc_entries()
    texts = [e.doc for e in entries] + [f"What does `{e.name}` do?" for e in entries]
    tok = train_builtin_tokenizer(texts)
    out.write_text(tok.to_str(pretty=False))
    return f"wrote {out} ({out.stat().st_size} bytes) from {len(entries)} docstrings, Python {sys.version.split()[0]}"


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python -m dflash_ipc.data.tokenizer_asset  (rewrites the shipped built-in tokenizer asset)")
        return 2
    print(write_asset(asset_path()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
