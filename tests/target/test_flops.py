"""The target's FLOP count (target/flops.py) for every kind of family: the weights a token multiplies by are
what torch counts in a real transformers forward (routed experts: only the active ones), hand counts from the
configs for a dense Llama, a Mixtral, a Qwen3.5-MoE hybrid and DeepSeek-V3's latent attention, and attention
pairs equal to what transformers' own mask functions let through (sliding windows, chunks)."""

from __future__ import annotations

import pytest
import torch
from families.family_zoo import WINDOW, family_config, unknown_hybrid_config
from torch.utils.flop_counter import FlopCounterMode

from dflash_ipc.families import AttentionLayer, family_of
from dflash_ipc.target.flops import ForwardFlops, attention_pairs, forward_flops, layer_matmul_params

LENS = [21, 13, 9]  # longer than WINDOW: windows and chunks cap pairs


def _causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3_5_moe", "deepseek_v3", "gpt_oss"])
def test_the_weights_counted_are_what_a_real_forward_multiplies(name):
    """torch's FLOP counter over a real forward (experts run by transformers' eager loop: each expert over the
    tokens routed to it) counts 2 x the counted weights x tokens in its linear products, plus the LM head and the
    GatedDeltaNet's conv (a convolution to torch). Attention scores run as batched products and stay apart."""
    from transformers import AutoModelForCausalLM

    config = family_config(name)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(3, int(config.vocab_size), (2, 24))
    tokens = ids.numel()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = counted.get("aten.mm", 0) + counted.get("aten.addmm", 0)
    conv = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Conv1d))
    head = config.vocab_size * config.hidden_size
    weights = layer_matmul_params(config)
    assert linear + 2 * conv * tokens == 2 * (sum(weights) + head) * tokens
    every_weight = sum(p.numel() for p in model.model.layers.parameters() if p.dim() >= 2)
    experts = family_of(config).experts()
    if experts is None:
        assert sum(weights) == every_weight
    else:  # the routed experts held but not run for a token
        assert 0 < sum(weights) < every_weight and experts.active < experts.num_experts


def test_a_dense_llama_is_the_hand_count():
    from transformers import LlamaConfig

    c = LlamaConfig(
        vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2
    )
    h, hd, nq, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    per_layer = h * nq * hd + 2 * h * nkv * hd + nq * hd * h + 3 * h * c.intermediate_size
    assert layer_matmul_params(c) == [per_layer] * 3
    attention = 4 * nq * hd * sum(_causal_pairs(n) for n in LENS)
    assert forward_flops(c, 2, LENS) == 2 * (2 * per_layer * sum(LENS) + attention)
    assert forward_flops(c, [1], LENS) == forward_flops(c, 1, LENS) == 2 * per_layer * sum(LENS) + attention


def test_mixtral_counts_its_router_and_the_active_experts_only():
    c = family_config("mixtral")
    h, nq, nkv, n_exp, k = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_local_experts, 2
    hd = h // nq  # Mixtral's config has no head_dim
    assert c.num_experts_per_tok == k < n_exp
    attention = h * nq * hd + 2 * h * nkv * hd + nq * hd * h
    moe = n_exp * h + k * 3 * h * c.intermediate_size  # router + each active expert's gate, up, down
    assert layer_matmul_params(c) == [attention + moe] * c.num_hidden_layers
    # every layer slides: a document longer than the window sees window pairs per query past it
    pairs = sum(WINDOW * (WINDOW + 1) // 2 + (n - WINDOW) * WINDOW for n in LENS)
    assert forward_flops(c, 1, LENS) == 2 * (attention + moe) * sum(LENS) + 4 * nq * hd * pairs


def test_a_qwen3_5_moe_hybrid_counts_active_and_shared_experts_and_the_recurrence():
    c = family_config("qwen3_5_moe")
    h, n_exp, k = c.hidden_size, c.num_experts, c.num_experts_per_tok
    moe = n_exp * h + k * 3 * h * c.moe_intermediate_size + 3 * h * c.shared_expert_intermediate_size + h  # + shared gate
    nq, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attention = h * 2 * nq * hd + 2 * h * nkv * hd + nq * hd * h  # q_proj carries the output gate
    key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    conv = 2 * key + value
    linear = h * conv + h * value + 2 * h * c.linear_num_value_heads + value * h + conv * c.linear_conv_kernel_dim
    assert c.layer_types[:2] == ["linear_attention", "full_attention"]
    assert layer_matmul_params(c)[:2] == [linear + moe, attention + moe]
    tokens = sum(LENS)
    recurrence = 6 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * tokens
    causal = 4 * nq * hd * sum(_causal_pairs(n) for n in LENS)
    assert forward_flops(c, 2, LENS) == 2 * (linear + moe) * tokens + recurrence + 2 * (attention + moe) * tokens + causal


def test_deepseek_latent_attention_scores_with_its_query_key_and_value_head_sizes():
    c = family_config("deepseek_v3")
    h, nh, qk, v = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    assert qk != v
    attention = (
        h * c.q_lora_rank  # q_a_proj
        + c.q_lora_rank * nh * qk  # q_b_proj
        + h * (c.kv_lora_rank + c.qk_rope_head_dim)  # kv_a_proj_with_mqa
        + c.kv_lora_rank * nh * (c.qk_nope_head_dim + v)  # kv_b_proj
        + nh * v * h  # o_proj
    )
    dense = 3 * h * c.intermediate_size
    shared = 3 * h * c.n_shared_experts * c.moe_intermediate_size
    moe = c.n_routed_experts * h + c.num_experts_per_tok * 3 * h * c.moe_intermediate_size + shared
    assert c.first_k_dense_replace == 1
    assert layer_matmul_params(c) == [attention + dense] + [attention + moe] * (c.num_hidden_layers - 1)
    pairs = sum(_causal_pairs(n) for n in LENS)
    assert forward_flops(c, [1], LENS) == 2 * (attention + moe) * sum(LENS) + 2 * nh * (qk + v) * pairs


def test_a_window_caps_the_pairs_and_short_documents_are_causal():
    c = family_config("gemma3")  # sliding and full layers alternate
    spec_sliding, spec_full = family_of(c).attention_layers[:2]
    assert (spec_sliding.kind, spec_sliding.window, spec_full.kind) == ("sliding", WINDOW, "full")
    short, long = [WINDOW - 1, 3], [4 * WINDOW]
    count = ForwardFlops(c)
    assert count([0], short) - 2 * count.weights[0] * sum(short) == count([1], short) - 2 * count.weights[1] * sum(short)
    sliding = count([0], long) - 2 * count.weights[0] * sum(long)
    full = count([1], long) - 2 * count.weights[1] * sum(long)
    assert sliding / full == (WINDOW * (WINDOW + 1) // 2 + 3 * WINDOW * WINDOW) / _causal_pairs(4 * WINDOW)


def _transformers_pairs(mask_function, n: int) -> int:
    positions = torch.arange(n)
    allowed = mask_function(torch.tensor(0), torch.tensor(0), positions[:, None], positions[None, :])
    return int(allowed.expand(n, n).sum())


@pytest.mark.parametrize("n", [1, 5, 8, 9, 20])
def test_attention_pairs_are_what_transformers_masks_let_through(n):
    from transformers import masking_utils as mu

    w = 8
    assert attention_pairs(AttentionLayer("full"), n) == _transformers_pairs(mu.causal_mask_function, n)
    assert attention_pairs(AttentionLayer("sliding", window=w), n) == _transformers_pairs(mu.sliding_window_causal_mask_function(w), n)
    chunked = mu.chunked_causal_mask_function(w, torch.zeros(1, dtype=torch.long))
    assert attention_pairs(AttentionLayer("chunked", chunk=w), n) == _transformers_pairs(chunked, n)
    assert attention_pairs(AttentionLayer("full", causal=False), n) == _transformers_pairs(mu.bidirectional_mask_function, n)
    both_ways = mu.sliding_window_bidirectional_mask_function(3)
    assert attention_pairs(AttentionLayer("sliding", window=3, causal=False), n) == _transformers_pairs(both_ways, n)
    assert attention_pairs(AttentionLayer("linear"), n) == 0


def test_a_layer_kind_no_family_knows_counts_its_weights_and_says_so(caplog):
    """LFM2's conv layers (no family entry): their weights count, their mixing is left out and the log says so;
    the attention layers count as any."""
    c = unknown_hybrid_config()
    with caplog.at_level("WARNING", logger="dflash_ipc.target.flops"):
        count = ForwardFlops(c)
    assert "lfm2: layer 0 is a 'conv' layer" in caplog.text
    tokens, attention = sum(LENS), 4 * c.num_attention_heads * (c.hidden_size // c.num_attention_heads) * sum(map(_causal_pairs, LENS))
    assert count([0], LENS) == 2 * count.weights[0] * tokens > 0
    assert count([1], LENS) == 2 * count.weights[1] * tokens + attention
