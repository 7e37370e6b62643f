"""The captured hidden states of every family, on the padded and the packed forward, against transformers'
own ``output_hidden_states`` of each document alone: exact in fp32 on the CPU (the packed reference kernel),
as close as the padded path in bf16 on a GPU (torch's varlen kernel); and every (family, kernel) pair that
cannot be exact refused by name.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from family_zoo import DOC_LENGTHS, FAMILIES, family_config

from dflash_ipc.config import TargetConfig
from dflash_ipc.families import FAMILIES as REGISTRY
from dflash_ipc.families import family_of
from dflash_ipc.families.registry import CheckedDecoder
from dflash_ipc.target.model import build_target
from dflash_ipc.target.varlen import plan_packed_attention


def _documents(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g) for n in DOC_LENGTHS]


def _reference(path, docs, dtype, device) -> tuple[list[list[torch.Tensor]], list[int]]:
    """transformers' own forward of each document alone (eager attention): [document][layer] -> [len, H], and the layer ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device).eval()
    family = family_of(model.config)
    layers = list(range(family.num_layers - 1))  # the last entry of output_hidden_states is after the final norm
    out = []
    with torch.no_grad():
        for doc in docs:
            states = model(doc[None].to(device), output_hidden_states=True).hidden_states
            out.append([family.captured(states[i + 1])[0].float() for i in layers])
    return out, layers


def _captured(model, docs) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """(padded, packed) captures of ``docs`` by a TargetModel: [document][layer] -> [len, H]."""
    lens = [len(d) for d in docs]
    batch = torch.zeros(len(docs), max(lens), dtype=torch.long)
    for i, d in enumerate(docs):
        batch[i, : len(d)] = d
    padded_planes = model.capture(batch)
    packed_planes = model.capture_packed(torch.cat(docs).to(model.device), lens)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    padded = [[p[i, : lens[i]].float().cpu() for p in padded_planes] for i in range(len(docs))]
    packed = [[p[0, starts[i] : starts[i] + lens[i]].float().cpu() for p in packed_planes] for i in range(len(docs))]
    return padded, packed


def _fp32_config(path, layers: list[int]) -> TargetConfig:
    return TargetConfig(model_path=str(path), dtype="float32", layer_ids=layers, varlen=True, attn_implementation="eager")


def _worst(got, ref) -> float:
    return max(((g - r).norm() / r.norm()).item() for gd, rd in zip(got, ref) for g, r in zip(gd, rd))


@pytest.mark.parametrize("name", FAMILIES)
def test_padded_and_packed_captures_equal_transformers_hidden_states_in_fp32(name, family_checkpoint):
    path = family_checkpoint(name)
    docs = _documents()
    ref, layers = _reference(path, docs, torch.float32, "cpu")
    # forced packed on the CPU: the per-document reference kernel with the family's own masks
    model = build_target(_fp32_config(path, layers), "cpu")
    assert model.varlen and model.packed_attention
    padded, packed = _captured(model, docs)
    assert _worst(padded, ref) <= 1e-5, f"{name}: padded capture differs from transformers' forward"
    assert _worst(packed, ref) <= 1e-5, f"{name}: packed capture differs from transformers' forward"


def test_packing_that_ignored_the_window_would_be_caught(family_checkpoint):
    """The comparison above can fail: the same mistral target with its layers told the window is absent
    (what the packed path did before it read the family) differs by far more than the bound."""
    path = family_checkpoint("mistral")
    docs = _documents()
    ref, layers = _reference(path, docs, torch.float32, "cpu")
    model = build_target(_fp32_config(path, layers), "cpu")
    model._attention_layers = {m: dataclasses.replace(spec, kind="full", window=None) for m, spec in model._attention_layers.items()}
    for layer in model.stack.layers:  # transformers passes sliding_window: the packed attention refuses a disagreement
        layer.self_attn.config.sliding_window = None
    _, packed = _captured(model, docs)
    assert _worst(packed, ref) > 1e-2


@pytest.mark.parametrize(
    ("name", "kernel", "missing"),
    [
        ("gemma2", "varlen_attn", "attention soft-capping at 50"),
        ("mistral", "flash_attention_2", "sliding window of 8 (not checked through flash_attention_2)"),
        ("gpt_oss", "flex_attention", "attention sinks (not checked through flex_attention)"),
        ("llama4", "flex_attention", "chunked attention of 8"),
    ],
)
def test_a_packed_kernel_that_cannot_be_exact_is_refused_by_name_and_auto_pads(name, kernel, missing):
    family = family_of(family_config(name))
    attn, device = ("sdpa", "cuda") if kernel == "varlen_attn" else (kernel, "cpu")
    with pytest.raises(
        ValueError, match=rf"target\.varlen = true: the packed {kernel} attention cannot reproduce {family.name}.*{re.escape(missing)}"
    ):
        plan_packed_attention(True, family, attn, device, torch.bfloat16)
    packs, why = plan_packed_attention("auto", family, attn, device, torch.bfloat16)
    assert packs is False and why.startswith("auto: padded") and missing in why


def test_sinks_are_not_packed_on_the_gpu_kernel(monkeypatch):
    """gpt-oss's sinks on torch's varlen kernel are refused (not yet held to the padded path on a GPU; without the
    kernel's log-sum-exp they could not be folded in at all); the CPU reference packs them exactly."""
    import dflash_ipc.target.varlen as varlen

    family = family_of(family_config("gpt_oss"))
    with pytest.raises(ValueError, match="attention sinks .*not held to the padded path on a GPU"):
        plan_packed_attention(True, family, "eager", "cuda", torch.bfloat16)
    monkeypatch.setattr(varlen, "varlen_lse_available", lambda: False)
    with pytest.raises(ValueError, match="attention sinks .*log-sum-exp"):
        plan_packed_attention(True, family, "eager", "cuda", torch.bfloat16)
    assert plan_packed_attention(True, family, "eager", "cpu", torch.float32)[0]


def test_a_model_type_without_a_family_row_keeps_the_padded_forward():
    from transformers import Starcoder2Config

    family = family_of(Starcoder2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2))
    assert not family.packed_checked
    packs, why = plan_packed_attention("auto", family, "sdpa", "cuda", torch.bfloat16)
    assert packs is False and "starcoder2 has no family entry" in why
    with pytest.raises(ValueError, match="starcoder2 has no family entry"):
        plan_packed_attention(True, family, "sdpa", "cpu", torch.float32)


def test_every_registered_family_has_a_row_in_the_family_matrix():
    """A family whose packed path is claimed checked must be in tests/families/family_zoo.py."""
    zoo_types = {family_of(family_config(name)).model_type for name in FAMILIES}
    zoo_classes = {type(family_of(family_config(name))) for name in FAMILIES}
    unchecked = [t for t, cls in REGISTRY.items() if (cls is CheckedDecoder and t not in zoo_types) or cls not in zoo_classes]
    assert not unchecked, f"registered without a family-matrix row: {unchecked}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_on_the_gpu_is_as_close_to_fp32_as_the_padded_forward(name, family_checkpoint):
    """bf16 on CUDA: the packed capture (torch's varlen kernel) is as close to transformers' fp32 forward as the
    padded capture (transformers' own kernels) is, or the family's packed kernel is refused and auto pads."""
    path = family_checkpoint(name)
    docs = _documents()
    family = family_of(family_config(name))
    # fp32 on the CPU, except for GatedDeltaNet hybrids: where fla is installed transformers hands it CPU tensors
    ref, layers = _reference(path, docs, torch.float32, "cuda" if family.has_recurrent_layers() else "cpu")
    attn = "sdpa" if "sdpa" in family.attention_implementations() else "eager"
    cfg = TargetConfig(
        model_path=str(path), dtype="bfloat16", layer_ids=layers, varlen=True, attn_implementation=attn, fuse_elementwise=False
    )
    problems = family.packed_problems("varlen_attn", lse=True)
    if problems:
        with pytest.raises(ValueError, match="cannot reproduce"):
            build_target(cfg, "cuda")
        assert build_target(dataclasses.replace(cfg, varlen="auto"), "cuda").varlen is False
        return
    model = build_target(cfg, "cuda")
    padded, packed = _captured(model, docs)
    padded_error, packed_error = _worst(padded, ref), _worst(packed, ref)
    print(f"{name}: bf16 vs fp32, padded {padded_error:.2e}, packed {packed_error:.2e}")
    assert packed_error <= 2 * padded_error + 2e-3, (padded_error, packed_error)
