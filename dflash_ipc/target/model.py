"""The frozen target model: build it, run it, and capture the hidden states DFlash trains on.

* :func:`build_target` loads a local Hugging Face checkpoint (straight to the device, in the
  configured dtype) or builds a random-weight Qwen3.5-family stack from ``TargetConfig.spec``.
  Only the decoder stack is kept (no LM head, no logits); layers after the last captured one
  are never allocated (random build) or dropped after loading (checkpoint), unless
  ``capture_last_hidden`` needs the whole stack.
* :meth:`TargetModel.capture` runs one right-padded batch under ``torch.inference_mode`` and
  returns the outputs of the chosen decoder layers (layer id ``i`` = output of decoder layer
  ``i``, i.e. ``hidden_states[i + 1]`` of HF's ``output_hidden_states``), stopping the forward
  right after the last captured layer.
* :func:`target_head_weights` gives the frozen embedding / LM head for the drafter without
  building the target (read from safetensors, or regenerated from the seed).
* :func:`fast_path_report` says whether the GatedDeltaNet layers run on flash-linear-attention
  and causal-conv1d kernels or on the slow torch fallbacks.
* :func:`forward_flops` counts the FLOPs of the forward actually run, for MFU.

Right padding needs no attention mask: every layer of the stack is causal (full attention) or
a causal recurrence / causal conv (GatedDeltaNet), so a real token never sees the pad tokens
that follow it; the packer strips the pad positions afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_ipc.config import TargetConfig

__all__ = [
    "TargetModel",
    "build_target",
    "default_layer_ids",
    "resolve_layer_ids",
    "tiny_spec",
    "qwen36_27b_spec",
    "make_hf_config",
    "load_hf_config",
    "text_config",
    "target_head_weights",
    "fast_path_report",
    "forward_flops",
    "layer_matmul_params",
]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- layer ids and specs


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """DFlash's default spread: ``k`` layer ids evenly from layer 1 to layer ``L - 3``.

    Matches DFlash's ``build_target_layer_ids`` (64 layers -> [1, 16, 31, 46, 61]; one layer ->
    the middle one). For stacks too shallow to give ``k`` distinct ids in [1, L-3] the spread
    widens to [0, L-1].
    """
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k})")
    if num_layers < k:
        raise ValueError(f"cannot capture {k} distinct layers from a {num_layers}-layer target; lower num_capture_layers")
    if k == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    ids = [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]
    if end > start and len(set(ids)) == k and all(0 <= i < num_layers for i in ids):
        return ids
    span = num_layers - 1
    return [int(math.floor(i * span / (k - 1) + 0.5)) for i in range(k)]


def resolve_layer_ids(cfg: TargetConfig, num_layers: int) -> list[int]:
    """``cfg.layer_ids`` if set (validated against the stack depth), else the default spread."""
    ids = list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(num_layers, cfg.num_capture_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target.layer_ids {bad} outside the target's {num_layers} decoder layers (0..{num_layers - 1})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target.layer_ids must be distinct (got {ids})")
    return ids


def _layer_types(num_layers: int, full_every: int) -> list[str]:
    return ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(num_layers)]


def tiny_spec(vocab_size: int = 512) -> dict[str, Any]:
    """A tiny Qwen3.5-style stack for CPU tests: hidden 64, 6 layers (linear, linear, full) x 2."""
    return {
        "vocab_size": int(vocab_size),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "layer_types": _layer_types(6, 3),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }


def qwen36_27b_spec(num_layers: int = 64) -> dict[str, Any]:
    """Qwen3.6-27B-class text stack: 64 layers = 48 GatedDeltaNet + 16 full attention (every 4th)."""
    return {
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": int(num_layers),
        "layer_types": _layer_types(int(num_layers), 4),
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }


# --------------------------------------------------------------------------- configs


def text_config(hf_config: Any) -> Any:
    """The text (decoder) config of a possibly multimodal config."""
    get = getattr(hf_config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except TypeError:
            return get()
    return getattr(hf_config, "text_config", None) or hf_config


def make_hf_config(spec: dict[str, Any], vocab_size: int | None = None, attn_implementation: str | None = None):
    """A ``Qwen3_5TextConfig`` from a spec dict (vocab_size overrides the spec's)."""
    from transformers import Qwen3_5TextConfig

    spec = dict(spec) if spec else tiny_spec(vocab_size or 512)
    if vocab_size is not None:
        spec["vocab_size"] = int(vocab_size)
    spec.setdefault("use_cache", False)
    conf = Qwen3_5TextConfig(**spec)
    if attn_implementation is not None:
        conf._attn_implementation = attn_implementation
    return conf


def load_hf_config(cfg: TargetConfig, vocab_size: int | None = None):
    """The target's HF config, built the same way in the target and in every drafter."""
    if cfg.model_path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(cfg.model_path)
    return make_hf_config(cfg.spec, vocab_size, cfg.attn_implementation)


def _truncated_spec_config(hf_config: Any, num_layers: int):
    """A copy of a Qwen3_5TextConfig with only the first ``num_layers`` layers."""
    d = hf_config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        d.pop(key, None)
    d["num_hidden_layers"] = num_layers
    if d.get("layer_types"):
        d["layer_types"] = list(d["layer_types"])[:num_layers]
    conf = type(hf_config)(**d)
    conf._attn_implementation = getattr(hf_config, "_attn_implementation", None)
    return conf


# --------------------------------------------------------------------------- frozen head weights


def _head_generator(seed: int, tag: str, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(tag.encode())) % (2**63 - 1))
    return g


def _random_matrix(rows: int, cols: int, std: float, seed: int, tag: str, device, dtype) -> torch.Tensor:
    """N(0, std) [rows, cols] drawn in fixed row chunks (bounded memory) and written to ``device``.

    On the CPU the draw is identical on every process. On CUDA it is drawn on the GPU (a CPU
    draw of a 248k x 5120 table takes ~30 s per process); every process of one run uses the
    same GPU model, so target and drafters still get identical tensors."""
    device = torch.device(device)
    out = torch.empty(rows, cols, device=device, dtype=dtype)
    if device.type == "cuda":
        gen = _head_generator(seed, tag, device)
        chunk = max(1, (1 << 28) // max(cols, 1))
        for r in range(0, rows, chunk):
            n = min(chunk, rows - r)
            out[r : r + n].copy_(torch.randn(n, cols, generator=gen, device=device, dtype=torch.float32) * std)
        return out
    gen = _head_generator(seed, tag)
    chunk = max(1, (1 << 24) // max(cols, 1))
    for r in range(0, rows, chunk):
        block = torch.randn(min(chunk, rows - r), cols, generator=gen, dtype=torch.float32) * std
        out[r : r + block.shape[0]].copy_(block)
    return out


def _tied(hf_config: Any) -> bool:
    tc = text_config(hf_config)
    return bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False))


def _safetensors_files(model_dir: Path) -> dict[str, str]:
    """tensor name -> file name, from the index json or the single-file checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / "model.safetensors"
    if single.exists():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise FileNotFoundError(f"{model_dir}: no model.safetensors(.index.json); target_head_weights needs safetensors weights")


def _pick_embed_key(names: Iterable[str]) -> str:
    cands = [
        n
        for n in names
        if n.endswith("embed_tokens.weight")
        and not n.startswith("mtp")
        and not any(p in n for p in ("visual", "vision", "audio", ".mtp"))
    ]
    if not cands:
        cands = [n for n in names if n.endswith(("wte.weight", "word_embeddings.weight", "tok_embeddings.weight"))]
    if not cands:
        raise KeyError("no input-embedding tensor (…embed_tokens.weight) in the checkpoint")
    # prefer the language model's own embedding, then the shortest name
    cands.sort(key=lambda n: ("language_model" not in n and not n.startswith("model.embed_tokens"), len(n)))
    return cands[0]


def target_head_weights(cfg: TargetConfig, hf_config: Any, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_weight [V, H], lm_head_weight [V, H]) of the target, frozen, for the drafter.

    Checkpoint: only these two tensors are read from the safetensors files (index json aware,
    tied embeddings handled), straight to ``device``; the model is never built. Random spec:
    regenerated from ``cfg.random_init_seed`` with dedicated CPU generators, so the target
    (which copies the embedding into its ``embed_tokens``) and every drafter get identical
    tensors without shipping them. Tied heads return the same tensor twice.
    """
    device = torch.device(device)
    if cfg.model_path:
        from safetensors import safe_open

        model_dir = Path(cfg.model_path)
        weight_map = _safetensors_files(model_dir)
        embed_key = _pick_embed_key(weight_map)
        head_key = None
        if not _tied(hf_config):
            for cand in ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight"):
                if cand in weight_map:
                    head_key = cand
                    break

        def read(key: str) -> torch.Tensor:
            dev = str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
            with safe_open(str(model_dir / weight_map[key]), framework="pt", device=dev) as f:
                return f.get_tensor(key).to(dtype)

        embed = read(embed_key)
        head = read(head_key) if head_key is not None else embed
        return embed, head
    tc = text_config(hf_config)
    v, h = int(tc.vocab_size), int(tc.hidden_size)
    std = float(getattr(tc, "initializer_range", 0.02))
    embed = _random_matrix(v, h, std, cfg.random_init_seed, "embed_tokens", device, dtype)
    if _tied(hf_config):
        return embed, embed
    head = _random_matrix(v, h, std, cfg.random_init_seed, "lm_head", device, dtype)
    return embed, head


# --------------------------------------------------------------------------- building


class _StopForward(Exception):
    """Raised by the last capture hook: nothing after the last captured layer is computed."""


def _find_decoder_stack(model: nn.Module) -> nn.Module:
    """The decoder stack (a module with ``.layers`` and input embeddings) inside a causal LM."""
    for path in ("model.language_model", "language_model", "model", "transformer", ""):
        mod = model
        ok = True
        for part in filter(None, path.split(".")):
            mod = getattr(mod, part, None)
            if mod is None:
                ok = False
                break
        if ok and isinstance(getattr(mod, "layers", None), nn.ModuleList):
            return mod
    for _, mod in model.named_modules():
        if isinstance(getattr(mod, "layers", None), nn.ModuleList) and hasattr(mod, "get_input_embeddings"):
            return mod
    raise ValueError(f"cannot find a decoder stack with .layers in {type(model).__name__}")


def _param_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def _deterministic_init(stack: nn.Module, seed: int, std: float) -> None:
    """Re-draw every random parameter from its own generator seeded by (seed, parameter name):
    identical weights whatever the build depth (truncated or full) or construction order."""
    for name, p in stack.named_parameters():
        if name.startswith("embed_tokens."):
            continue  # set from target_head_weights
        gen = torch.Generator(device=p.device)
        gen.manual_seed(_param_seed(seed, name))
        if name.endswith("A_log"):
            tmp = torch.empty(p.shape, device=p.device, dtype=torch.float32).uniform_(0.01, 16.0, generator=gen)
            p.copy_(tmp.log_())
        elif p.dim() >= 2:
            tmp = torch.empty(p.shape, device=p.device, dtype=torch.float32).normal_(0.0, std, generator=gen)
            p.copy_(tmp)
        # 1-D parameters (norm weights, dt_bias, biases) keep their constant HF init


def build_target(cfg: TargetConfig, device, vocab_size: int | None = None) -> "TargetModel":
    """Build the frozen target on ``device`` (checkpoint or random spec); see the module docstring."""
    device = torch.device(device)
    dtype = _DTYPES[cfg.dtype]
    if cfg.model_path:
        return _build_from_checkpoint(cfg, device, dtype)
    hf_config = make_hf_config(cfg.spec, vocab_size, cfg.attn_implementation)
    n_layers = int(hf_config.num_hidden_layers)
    layer_ids = resolve_layer_ids(cfg, n_layers)
    n_build = n_layers if cfg.capture_last_hidden else max(layer_ids) + 1
    build_conf = hf_config if n_build == n_layers else _truncated_spec_config(hf_config, n_build)
    build_conf.use_cache = False

    from transformers import Qwen3_5TextModel

    with torch.device(device):
        stack = Qwen3_5TextModel._from_config(build_conf, dtype=dtype, attn_implementation=cfg.attn_implementation)
    stack.to(device)
    _deterministic_init(stack, cfg.random_init_seed, float(getattr(hf_config, "initializer_range", 0.02)))
    embed, _ = target_head_weights(cfg, hf_config, device, dtype)
    with torch.no_grad():
        stack.embed_tokens.weight.copy_(embed)
    del embed
    return TargetModel(stack, hf_config, layer_ids, device, dtype, capture_last_hidden=cfg.capture_last_hidden)


def _build_from_checkpoint(cfg: TargetConfig, device: torch.device, dtype: torch.dtype) -> "TargetModel":
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(cfg.model_path)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": cfg.attn_implementation}
    move_after = False
    if device.type != "cpu":
        if importlib.util.find_spec("accelerate") is not None:
            # weights go straight from the (memory-mapped) safetensors to the device
            kwargs["device_map"] = {"": str(device) if device.index is not None else f"{device.type}:0"}
        else:  # transformers needs accelerate for device_map: load to host memory, then move
            log.warning("accelerate is not installed: loading %s through host memory (pip install accelerate)", cfg.model_path)
            move_after = True
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, **kwargs)
    stack = _find_decoder_stack(model)
    del model  # drops the LM head (and any vision tower) with it
    n_layers = len(stack.layers)
    layer_ids = resolve_layer_ids(cfg, n_layers)
    if not cfg.capture_last_hidden and max(layer_ids) + 1 < n_layers:
        stack.layers = nn.ModuleList(list(stack.layers)[: max(layer_ids) + 1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if move_after:
        stack.to(device)
    if getattr(stack, "config", None) is not None:
        stack.config.use_cache = False
    return TargetModel(stack, hf_config, layer_ids, device, dtype, capture_last_hidden=cfg.capture_last_hidden)


# --------------------------------------------------------------------------- the model


class TargetModel:
    """A frozen decoder stack that returns the outputs of ``layer_ids`` for a right-padded batch."""

    def __init__(
        self,
        stack: nn.Module,
        hf_config: Any,
        layer_ids: Sequence[int],
        device,
        dtype: torch.dtype,
        capture_last_hidden: bool = False,
    ):
        self.stack = stack
        self.hf_config = hf_config
        self.layer_ids = list(layer_ids)
        self.device = torch.device(device)
        self.dtype = dtype
        self.capture_last_hidden = bool(capture_last_hidden)
        if max(self.layer_ids) >= len(stack.layers):
            raise ValueError(f"layer id {max(self.layer_ids)} but only {len(stack.layers)} layers were built")
        stack.eval()
        stack.requires_grad_(False)

    @property
    def num_layers_built(self) -> int:
        return len(self.stack.layers)

    @property
    def num_layers_total(self) -> int:
        return int(text_config(self.hf_config).num_hidden_layers)

    @property
    def layers_run(self) -> int:
        """Decoder layers computed per forward (layers 0 .. layers_run-1)."""
        return self.num_layers_total if self.capture_last_hidden else max(self.layer_ids) + 1

    @property
    def hidden_size(self) -> int:
        return int(text_config(self.hf_config).hidden_size)

    @property
    def num_planes(self) -> int:
        return len(self.layer_ids) + (1 if self.capture_last_hidden else 0)

    def capture(self, input_ids: torch.Tensor, capture_last_hidden: bool | None = None) -> list[torch.Tensor]:
        """Run ``input_ids`` [B, L] (right-padded; no mask needed) and return the outputs of the
        decoder layers ``layer_ids`` as k tensors [B, L, H] (+ the final normed hidden state
        when capture_last_hidden). Pad positions hold garbage; the packer drops them."""
        last = self.capture_last_hidden if capture_last_hidden is None else bool(capture_last_hidden)
        if last and self.num_layers_built < self.num_layers_total:
            raise ValueError("capture_last_hidden needs the full stack; build the target with capture_last_hidden=True")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L] (got shape {tuple(input_ids.shape)})")
        input_ids = input_ids.to(self.device)
        slots: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        stop_at = None if last else max(self.layer_ids)
        handles = []

        def make_hook(j: int, layer_id: int):
            def hook(module, args, output):
                slots[j] = output[0] if isinstance(output, (tuple, list)) else output
                if layer_id == stop_at:
                    raise _StopForward

            return hook

        try:
            for j, li in enumerate(self.layer_ids):
                handles.append(self.stack.layers[li].register_forward_hook(make_hook(j, li)))
            out = None
            with torch.inference_mode():
                try:
                    out = self.stack(input_ids=input_ids, use_cache=False)
                except _StopForward:
                    pass
        finally:
            for h in handles:
                h.remove()
            handles.clear()
        result: list[torch.Tensor] = []
        for j, t in enumerate(slots):
            if t is None:
                raise RuntimeError(f"decoder layer {self.layer_ids[j]} did not run")
            result.append(t)
        slots.clear()
        if last:
            lh = getattr(out, "last_hidden_state", None)
            result.append(lh if lh is not None else out[0])
        return result

    def forward_flops(self, seq_lens: Iterable[int]) -> float:
        return forward_flops(self.hf_config, self.layers_run, seq_lens)


# --------------------------------------------------------------------------- fast-path report


_ROLE_NAMES = {
    "chunk_gated_delta_rule": ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
    "recurrent_gated_delta_rule": ("fused_recurrent_gated_delta_rule", "recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "causal_conv1d_fn": ("causal_conv1d_fn",),
    "causal_conv1d_update": ("causal_conv1d_update", "torch_causal_conv1d_update"),
}


def _resolve_impl(fn: Any) -> Any:
    """Follow transformers' fallback wrappers (closure variable ``implementation``) and plain
    decorators down to the function actually called."""
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        closure = getattr(fn, "__closure__", None)
        if code is not None and closure:
            cells = {}
            for name, cell in zip(code.co_freevars, closure):
                try:
                    cells[name] = cell.cell_contents
                except ValueError:
                    pass
            impl = cells.get("implementation")
            if impl is not None and impl is not fn:
                fn = impl
                continue
            inner = next((v for k, v in cells.items() if k in ("func", "fn", "function", "original_function") and callable(v)), None)
            if inner is not None and inner is not fn:
                fn = inner
                continue
        break
    return fn


def _origin(fn: Any) -> str:
    if fn is None:
        return "none"
    mod = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or ""
    if mod.startswith("fla"):
        return "fla"
    if mod.startswith("causal_conv1d"):
        return "causal_conv1d"
    if mod.startswith("transformers"):
        return "torch"
    if mod.startswith("kernels") or "hub" in mod or mod.startswith("_"):
        return "hub_kernel"
    return mod or "unknown"


def fast_path_report(model: Any) -> dict[str, Any]:
    """Which implementations the GatedDeltaNet layers actually call.

    Handles both mechanisms: per-instance attributes / a module-level ``is_fast_path_available``
    (qwen3_next-style), and transformers 5.x's ``use_kernel_func_from_hub_with_fallback`` wrappers
    whose resolved ``implementation`` is the fla / causal_conv1d function or the torch fallback.
    """
    import transformers

    stack = model.stack if isinstance(model, TargetModel) else model
    gdn = [m for m in stack.modules() if "GatedDeltaNet" in type(m).__name__]
    report: dict[str, Any] = {
        "transformers": transformers.__version__,
        "gated_delta_net_layers": len(gdn),
    }
    if not gdn:
        report["fast_path"] = None
        return report
    layer = gdn[0]
    modmod = sys.modules.get(type(layer).__module__)
    impls: dict[str, str] = {}
    origins: dict[str, str] = {}
    for role, names in _ROLE_NAMES.items():
        fn = None
        for name in names:  # instance attributes first (older layout), then module globals
            cand = getattr(layer, name, None)
            if callable(cand) and not isinstance(cand, nn.Module):
                fn = cand
                break
        if fn is None and modmod is not None:
            for name in names:
                cand = getattr(modmod, name, None)
                if callable(cand):
                    fn = cand
                    break
        impl = _resolve_impl(fn)
        origins[role] = _origin(impl)
        impls[role] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', getattr(impl, '__name__', '?'))}" if impl is not None else "none"
    # older layout: attribute explicitly None when the package is missing
    if hasattr(layer, "causal_conv1d_fn") and layer.causal_conv1d_fn is None:
        origins["causal_conv1d_fn"] = "torch"
        impls["causal_conv1d_fn"] = "torch F.conv1d (inline)"
    norm = getattr(layer, "norm", None)
    report["norm"] = type(norm).__name__ if norm is not None else None
    report["norm_fused"] = norm is not None and type(norm).__module__.startswith("fla")
    report["implementations"] = impls
    report["origins"] = origins
    module_flag = getattr(modmod, "is_fast_path_available", None) if modmod is not None else None
    if isinstance(module_flag, bool):
        report["module_is_fast_path_available"] = module_flag
    fast = {"fla", "hub_kernel", "causal_conv1d"}
    report["fla"] = origins["chunk_gated_delta_rule"] in fast
    report["causal_conv1d"] = origins["causal_conv1d_fn"] in fast
    layer_forward_mod = getattr(type(layer).forward, "__module__", "")
    report["layer_forward"] = layer_forward_mod
    if not layer_forward_mod.startswith("transformers"):
        # the whole layer's forward was replaced by a hub kernel (kernelize)
        report["fla"] = report["causal_conv1d"] = True
    report["fast_path"] = bool(report["fla"] and report["causal_conv1d"])
    return report


# --------------------------------------------------------------------------- FLOPs


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

