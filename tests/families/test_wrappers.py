"""Targets shipped inside an image-text wrapper (Qwen3.5 / Qwen3.6 and Gemma 3 ``ForConditionalGeneration``
checkpoints): the target runs the language model's decoder from text-only data, and its captures on both
paths equal the wrapper's own forward; the drafter's frozen embedding and head are the language model's."""

from __future__ import annotations

import pytest
import torch
from family_zoo import DOC_LENGTHS, VISION_WRAPPED, build_vision_wrapped_checkpoint

from dflash_ipc.config import TargetConfig
from dflash_ipc.target.model import build_target
from dflash_ipc.target_spec.heads import target_head_weights
from dflash_ipc.target_spec.hf_config import load_hf_config


@pytest.mark.parametrize("name", VISION_WRAPPED)
def test_a_vision_wrapped_target_captures_its_language_models_layers_from_text(name, tmp_path):
    from transformers import AutoModelForImageTextToText

    path = build_vision_wrapped_checkpoint(name, tmp_path)
    wrapper = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, 1000, (n,), generator=g) for n in DOC_LENGTHS[:2]]
    with torch.no_grad():
        refs = [wrapper(input_ids=d[None], output_hidden_states=True).hidden_states for d in docs]
    layers = [0, 1, 2]
    cfg = TargetConfig(model_path=str(path), dtype="float32", layer_ids=layers, varlen=True, attn_implementation="eager")
    target = build_target(cfg, "cpu")
    assert type(target.stack).__name__.endswith("TextModel")  # the language model's decoder, no vision tower
    assert not any("vision" in n or "visual" in n for n, _ in target.stack.named_parameters())
    lens = [len(d) for d in docs]
    batch = torch.zeros(2, max(lens), dtype=torch.long)
    for i, d in enumerate(docs):
        batch[i, : len(d)] = d
    padded, packed = target.capture(batch), target.capture_packed(torch.cat(docs), lens)
    for j, layer in enumerate(layers):
        for i, ref in enumerate(refs):
            want = ref[layer + 1][0]
            start = sum(lens[:i])
            assert torch.allclose(padded[j][i, : lens[i]], want, rtol=1e-5, atol=1e-5)
            assert torch.allclose(packed[j][0, start : start + lens[i]], want, rtol=1e-5, atol=1e-5)
    embed, head = target_head_weights(cfg, load_hf_config(cfg), "cpu", torch.float32)
    assert torch.equal(embed, wrapper.get_input_embeddings().weight) and torch.equal(head, wrapper.get_output_embeddings().weight)
