"""FLOPs of the target forward actually run (for MFU), from its transformers config."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dflash_ipc.target_spec.hf_config import text_config


def _attn_output_gate(tc: Any) -> bool:
    gate = getattr(tc, "attn_output_gate", None)
    if gate is not None:
        return bool(gate)
    return str(getattr(tc, "model_type", "")).startswith(("qwen3_5", "qwen3_next"))


def layer_matmul_params(hf_config: Any, layer_type: str) -> int:
    """Weights of one decoder layer that take part in matmuls/convs (Linear + conv kernels;
    norm gains excluded). Dense layers only (no MoE)."""
    tc = text_config(hf_config)
    h = int(tc.hidden_size)
    inter = int(tc.intermediate_size)
    mlp = 3 * h * inter
    if layer_type == "linear_attention":
        nk, nv = int(tc.linear_num_key_heads), int(tc.linear_num_value_heads)
        dk, dv = int(tc.linear_key_head_dim), int(tc.linear_value_head_dim)
        key_dim, value_dim = nk * dk, nv * dv
        conv_dim = 2 * key_dim + value_dim
        mixer = (
            h * conv_dim  # in_proj_qkv
            + h * value_dim  # in_proj_z
            + 2 * h * nv  # in_proj_b, in_proj_a
            + value_dim * h  # out_proj
            + conv_dim * int(tc.linear_conv_kernel_dim)  # depthwise causal conv
        )
        return mixer + mlp
    nq = int(tc.num_attention_heads)
    nkv = int(getattr(tc, "num_key_value_heads", None) or nq)
    hd = int(getattr(tc, "head_dim", None) or h // nq)
    q_out = nq * hd * (2 if _attn_output_gate(tc) else 1)
    bias = (q_out + 2 * nkv * hd + h) if getattr(tc, "attention_bias", False) else 0
    mixer = h * q_out + 2 * h * nkv * hd + nq * hd * h + bias
    return mixer + mlp


def forward_flops(hf_config: Any, layers_run: int | Iterable[int], seq_lens: Iterable[int]) -> float:
    """FLOPs of one target forward over sequences of ``seq_lens`` through ``layers_run``
    decoder layers (an int N = layers 0..N-1, or explicit layer indices). Pass the lengths the
    forward actually computed (padded lengths for the work run, real lengths for useful work).

    Count (multiply-add = 2 FLOPs, forward only, no embedding lookup / final norm / LM head):

    * every layer: ``2 * layer_matmul_params * tokens``;
    * full attention, causal: QK^T and PV over the L(L+1)/2 visible pairs per sequence,
      ``2 * 2 * n_heads * head_dim * L(L+1)/2``;
    * GatedDeltaNet: the state recurrence, ``6 * d_k * d_v`` per value head per token
      (state decay/read-out/update of the recurrent form; chunked kernels do the same order).
    """
    tc = text_config(hf_config)
    lens = [int(x) for x in seq_lens]
    tokens = sum(lens)
    pairs = sum(L * (L + 1) // 2 for L in lens)
    n_total = int(tc.num_hidden_layers)
    idx = list(range(int(layers_run))) if isinstance(layers_run, int) else [int(i) for i in layers_run]
    types = list(getattr(tc, "layer_types", None) or ["full_attention"] * n_total)
    h = int(tc.hidden_size)
    total = 0.0
    for i in idx:
        lt = types[i] if i < len(types) else "full_attention"
        lt = "linear_attention" if lt == "linear_attention" else "full_attention"
        total += 2.0 * layer_matmul_params(tc, lt) * tokens
        if lt == "full_attention":
            nq = int(tc.num_attention_heads)
            hd = int(getattr(tc, "head_dim", None) or h // nq)
            total += 4.0 * nq * hd * pairs
        else:
            nv = int(tc.linear_num_value_heads)
            total += 6.0 * nv * int(tc.linear_key_head_dim) * int(tc.linear_value_head_dim) * tokens
    return total
