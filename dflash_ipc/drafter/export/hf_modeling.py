"""The drafter as a Hugging Face model: the modeling file an export carries for ``trust_remote_code``.

``dflash-ipc export`` writes this file beside the weights as ``modeling_dflash_ipc.py`` and names
it in ``config.json``'s ``auto_map``, so ``AutoModel.from_pretrained(EXPORT, trust_remote_code=True)``
builds :class:`DFlashIpcDraftModel` with nothing but torch and transformers installed. It imports
nothing from dflash-ipc (the file travels alone).

Interface (the one z-lab's reference decoder ``dflash.model.dflash_generate`` drives, so either loop
decodes with it): ``forward(position_ids, noise_embedding, target_hidden, past_key_values, use_cache)``
returns the final-normed block hidden states, ``noise_embedding`` being the target's raw embedding rows
times ``dflash_config.input_embedding_scale`` (:meth:`noise_embedding`, as z-lab's loop computes it: what
the target's first layer sees, for a Gemma or Granite target whose embeddings are scaled);
``compute_logits(hidden, output_head)`` gives logits over the target's whole vocabulary, multiplied by
``output_multiplier`` and soft-capped at ``final_logit_softcapping`` where the target's are (Granite, Gemma):
with the drafter's own head rows (``lm_head`` + ``d2t``, an export with ``drafter.draft_vocab_size``)
``-inf`` outside them, else ``output_head`` (the target's head); ``block_size``, ``mask_token_id`` and
``target_layer_ids`` (the target layers whose outputs, i.e. ``hidden_states[i + 1]``, the context
concatenates). :meth:`spec_generate` is a greedy decoder of its own.

Attention: block queries attend to the cached context and to the block; ``full_attention`` layers
see the whole block, ``sliding_attention`` layers are causal with a window that counts the current
token (HF semantics), as the drafter trains.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding

SLIDING = "sliding_attention"


def _dflash_value(config, name: str, default=None):
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def rollback_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for a model of ``config`` whose sliding-window and chunked attention layers keep every
    token, as its full-attention layers do (the masks transformers builds from the config still apply the window
    or the chunks, over the whole length): transformers' own sliding layers keep only the last ``window - 1``
    tokens and refuse ``crop`` once the window is full, a layer that keeps every token crops exactly. Other
    layers (recurrent state: GatedDeltaNet) stay as transformers builds them."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:  # not a subclass: hybrid layers carry recurrent state too
            cache.layers[i] = DynamicLayer()
    return cache


def crops_exactly(cache) -> bool:
    """Whether ``cache.crop(-r)`` leaves ``cache`` as it was ``r`` tokens ago: every layer keeps every token
    (``DynamicLayer``) or holds nothing (transformers' placeholder for a KV-shared layer, where it has one).
    Otherwise (recurrent state, a layer kind not known here) a rollback re-runs the kept tokens from a copy."""
    exact = tuple(c for c in (DynamicLayer, getattr(cache_utils, "DummyLayer", None)) if c is not None)
    return all(type(layer) in exact for layer in cache.layers)


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` (a negative count: what every transformers 5 accepts)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [b, heads, n, d] at the last ``n`` positions of ``cos``/``sin`` [b, N, d]."""
    n = x.shape[-2]
    cos, sin = cos[:, None, -n:], sin[:, None, -n:]
    return x * cos + _rotate_half(x) * sin


class _Attention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or []
        self.sliding = layer_idx < len(layer_types) and layer_types[layer_idx] == SLIDING
        self.window = int(config.sliding_window) if self.sliding else None

    def _mask(self, n_q: int, n_k: int, device) -> torch.Tensor | None:
        if not self.sliding:
            return None  # the whole context and the whole block
        q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]
        k_pos = torch.arange(n_k, device=device)[None, :]
        return (k_pos <= q_pos) & (q_pos - k_pos < self.window)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos, sin, cache) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        both = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(both).view(b, both.shape[1], self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(b, both.shape[1], self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask = self._mask(n, k.shape[-2], x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class _MLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = _Attention(config, layer_idx)
        self.mlp = _MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache):
        # the context enters every layer's keys/values without the layer's input norm
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashIpcDraftModel(Qwen3PreTrainedModel):
    """A dflash-ipc drafter read from its export (see the module docstring)."""

    config_class = Qwen3Config
    _no_split_modules = ["_Layer"]
    # the target's embedding table, scaled, that vLLM embeds with: this class scales the target's own rows
    _keys_to_ignore_on_load_unexpected = [r"^embed_tokens\.weight$"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.target_layer_ids = [int(i) for i in _dflash_value(config, "target_layer_ids")]
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = int(_dflash_value(config, "mask_token_id"))
        self.input_embedding_scale = float(_dflash_value(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(_dflash_value(config, "output_multiplier", 1.0))
        softcap = _dflash_value(config, "final_logit_softcapping")
        self.final_logit_softcapping = float(softcap) if softcap else None
        h = config.hidden_size
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        n_rows = int(getattr(config, "draft_vocab_size", 0) or 0)
        self.reduced_head = 0 < n_rows < config.vocab_size
        if self.reduced_head:  # vLLM's EAGLE-3 layout: row i drafts target id i + d2t[i]
            self.lm_head = nn.Linear(h, n_rows, bias=False)
            self.register_buffer("d2t", torch.zeros(n_rows, dtype=torch.long))
        self.post_init()

    def forward(
        self,
        position_ids: torch.LongTensor,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """``target_hidden`` [b, n, k*H] (context not yet cached), ``noise_embedding`` [b, B, H] (anchor,
        then mask tokens, the target's embeddings), ``position_ids`` [b, n + B]: the block's hidden states."""
        x = noise_embedding
        ctx = self.hidden_norm(self.fc(target_hidden.to(x.dtype)))
        cos, sin = self.rotary_emb(x, position_ids)
        cache = past_key_values if use_cache else None
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, cache)
        return self.norm(x)

    def noise_embedding(self, target, ids: torch.LongTensor) -> torch.Tensor:
        """The block's input: the target's raw embedding rows times ``input_embedding_scale``."""
        return F.embedding(ids, target.get_input_embeddings().weight) * self.input_embedding_scale

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        rows = self._finish(self.lm_head(hidden) if self.reduced_head else output_head(hidden))
        if not self.reduced_head:
            return rows
        full = rows.new_full((*rows.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., torch.arange(rows.shape[-1], device=rows.device) + self.d2t] = rows
        return full

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits from its head's product: scaled, then soft-capped, where the target's are."""
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    def _context(self, hidden_states, active_stream: int = 0) -> torch.Tensor:
        """The captured layers' outputs side by side; a layer that outputs several streams of its hidden state
        (Gemma 3n's AltUp: ``[streams, b, n, H]``) gives the one the next layer computes on, ``active_stream``."""
        planes = [hidden_states[i + 1] for i in self.target_layer_ids]
        return torch.cat([h[active_stream] if h.dim() == 4 else h for h in planes], dim=-1)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids: torch.LongTensor, max_new_tokens: int, stop_token_ids=None, temperature: float = 0.0):
        """Greedy speculative decoding of one prompt (``input_ids`` [1, n]) with ``target`` (a Hugging Face causal
        LM); the output equals the target's greedy decoding. After a rejection the target's cache crops back to
        the kept tokens (:func:`rollback_cache`: sliding and chunked layers keep every token), or, where a layer
        cannot forget tokens (recurrent state), returns to its copy from before the verification and re-runs them."""
        if temperature != 0.0:
            raise ValueError("spec_generate decodes greedily: temperature must be 0")
        stops = set(stop_token_ids or [])
        head = target.get_output_embeddings()
        n0, dev = input_ids.shape[1], input_ids.device
        t_cache, d_cache = rollback_cache(target.config), DynamicCache()  # the drafter's layers are all attention
        crops = crops_exactly(t_cache)
        active = int(getattr(target.config.get_text_config(decoder=True), "altup_active_idx", 0))
        # transformers renames the forward's ``past_key_values`` to ``cache`` (5.24; the old name warns)
        cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        out = target(input_ids, **{cache_kw: t_cache}, use_cache=True, output_hidden_states=True)
        tokens = [int(out.logits[0, -1].argmax())]
        ctx, done = self._context(out.hidden_states, active), n0  # positions [done - ctx_len, done) await the drafter
        self.acceptance_lengths = []
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            # a whole block even where the budget ends inside it (cut below): full layers see the whole
            # block, so a shorter one would draft other tokens than the drafter trained on
            width = self.block_size
            block = torch.full((1, width), self.mask_token_id, dtype=torch.long, device=dev)
            block[0, 0] = tokens[-1]
            pos = torch.arange(done - ctx.shape[1], done + width, device=dev)[None]
            h = self(pos, self.noise_embedding(target, block), ctx, past_key_values=d_cache, use_cache=True)
            crop_cache(d_cache, done)
            block[0, 1:] = self.compute_logits(h[:, 1:], head).argmax(-1)[0]
            pos = torch.arange(done, done + width, device=dev)[None]
            snapshot = None if crops else copy.deepcopy(t_cache)
            out = target(block, position_ids=pos, **{cache_kw: t_cache}, use_cache=True, output_hidden_states=True)
            verdict = out.logits[0].argmax(-1)
            accepted = int((block[0, 1:] == verdict[:-1]).long().cumprod(0).sum())
            new = [*block[0, 1 : accepted + 1].tolist(), int(verdict[accepted])][: max_new_tokens - len(tokens)]
            cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
            new = new[:cut]
            tokens += new
            self.acceptance_lengths.append(len(new))
            ctx = self._context(out.hidden_states, active)[:, : len(new)]
            done += len(new)
            if crops:
                crop_cache(t_cache, done)
            elif len(new) < width:  # the anchor and the accepted drafts, from the cache as it was before them
                t_cache = snapshot
                target(block[:, : len(new)], position_ids=pos[:, : len(new)], **{cache_kw: t_cache}, use_cache=True)
        return torch.cat([input_ids, torch.tensor([tokens], device=dev)], dim=1)
