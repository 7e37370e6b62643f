"""Write a random-weight Hugging Face checkpoint (config.json + safetensors) at one of shapes.py's shapes.

dflash-ipc reads its target from ``target.model_path`` (its random ``target.spec`` builds only the
Qwen3.5 hybrid family), so a Llama / Qwen3 shape needs a folder on disk; a Qwen3.5 shape (``qwen3.6-27b``)
gets the tokenizer alone (dflash-ipc builds the stack from ``target.spec``, the SpecForge bench in memory). Built on the GPU when there
is one (seconds), then saved; the 8B shape is ~16.4 GB of bf16. A word-level tokenizer with exactly the
model's vocabulary is saved beside it (dflash-ipc refuses a tokenizer much smaller than the embedding
table, e.g. its built-in 1,024-id one for a 49,152-id model): ids ``t0..`` plus ChatML specials.

    python make_target.py --shape qwen3-8b --out /root/peer-bench/qwen3-8b
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES, hf_config  # noqa: E402

CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
WORDS = ["user", "assistant", "system", "record"]


def write_tokenizer(out: str, vocab_size: int) -> None:
    """A fast word-level tokenizer of exactly ``vocab_size`` ids: the specials, a few chat words, then t0, t1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n_plain = vocab_size - len(SPECIALS) - len(WORDS)
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *WORDS, *(f"t{i}" for i in range(n_plain))])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    assert len(tok) == vocab_size, (len(tok), vocab_size)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    done = os.path.join(args.out, ".complete")
    if os.path.exists(done) and os.path.exists(os.path.join(args.out, "tokenizer.json")):
        print(f"[make_target] {args.out} exists (complete), kept")
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    cfg = hf_config(args.shape)
    if SHAPES[args.shape]["arch"] == "qwen3_5":
        os.makedirs(args.out, exist_ok=True)
        write_tokenizer(args.out, int(cfg.vocab_size))
        with open(done, "w") as f:
            json.dump({"shape": args.shape, "tokenizer_only": True}, f)
        print(f"[make_target] {args.shape}: tokenizer of {cfg.vocab_size} ids ({time.perf_counter() - t0:.1f} s) -> {args.out}")
        return
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    t1 = time.perf_counter()
    model.save_pretrained(args.out, max_shard_size="50GB")
    write_tokenizer(args.out, int(cfg.vocab_size))
    n = sum(p.numel() for p in model.parameters())
    with open(done, "w") as f:
        json.dump({"shape": args.shape, "params": n}, f)
    print(
        f"[make_target] {args.shape}: {n / 1e9:.3f} B params, built {t1 - t0:.1f} s, saved {time.perf_counter() - t1:.1f} s -> {args.out}"
    )


if __name__ == "__main__":
    main()
