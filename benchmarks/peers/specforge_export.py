"""A SpecForge 0.2.0 DFlash drafter in dflash-ipc's export layout (the directory ``dflash-ipc export`` writes).

    python specforge_export.py --from SPECFORGE_HF_DIR --out EXPORT_DIR [--chat-template-kwargs '{}']

SPECFORGE_HF_DIR is what SpecForge's own exporter writes (``specforge.export.to_hf.export_to_hf``: a
``DFlashDraftModel`` ``config.json`` + ``model.safetensors``, or shards with ``model.safetensors.index.json``).
EXPORT_DIR is what ``dflash-ipc eval --drafter`` reads (drafter/export/layout.py): the drafter is rebuilt as
dflash-ipc's :class:`~dflash_ipc.drafter.model.dflash_drafter.DFlashDrafter`, its weights loaded strictly, and written by
:func:`~dflash_ipc.drafter.export.layout.export_drafter` (config fields, modeling file, 0644 files).

The mapping (read from ``specforge/modeling/draft/dflash.py``):

* config: ``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``num_hidden_layers``, ``layer_types``, ``sliding_window`` (HF semantics in both: the
  window counts the query itself; SpecForge writes None without sliding layers), ``block_size``,
  ``vocab_size``, ``rms_norm_eps``, ``rope_parameters.rope_theta`` (default RoPE only),
  ``max_position_embeddings``, ``num_target_layers``, ``dflash_config.{target_layer_ids, mask_token_id}``
  carry over as they are. Refused: attention or MLP biases, another activation than SiLU, RoPE scaling,
  and the ``dflash_config`` keys of SpecForge's other draft families (``projector_type``,
  ``pure_draft_prefix_len``, ``shift_label``): dflash-ipc's drafter has no place for them.
* tensors: the names are the same on both sides (``fc``, ``hidden_norm``, ``norm``,
  ``layers.N.self_attn.{q,k,v,o}_proj`` / ``{q,k}_norm``, ``layers.N.mlp.{gate,up,down}_proj``,
  ``layers.N.{input,post_attention}_layernorm``), the shapes are checked; ``draft_model.`` (SpecForge's
  training wrapper) is stripped. RoPE buffers (``rotary_emb.*``) are recomputed from the theta by
  dflash-ipc, not stored; an ``embed_tokens.weight`` is the target's frozen table and stays out of the
  export (every loader reads the target's). Any other tensor is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_ipc.drafter.export.layout import export_drafter
from dflash_ipc.drafter.model.dflash_drafter import FULL, SLIDING, DFlashDrafter, DrafterModelConfig

#: SpecForge's draft-family keys that change the architecture (Domino, DSpark heads; label shift)
FOREIGN_DFLASH_KEYS = ("projector_type", "pure_draft_prefix_len", "shift_label")
#: tensors a SpecForge DFlash save may carry that are no trained weight of the drafter
DROPPED_PREFIXES = ("rotary_emb.",)
DROPPED_NAMES = ("embed_tokens.weight",)
WRAPPER_PREFIX = "draft_model."
#: the sliding window dflash-ipc's config needs when SpecForge wrote None (no sliding layer reads it)
UNUSED_WINDOW = 2048


class SpecForgeDraftError(ValueError):
    """A SpecForge drafter that dflash-ipc's drafter cannot hold exactly; the message names the field or tensor."""


def drafter_config(cfg: Mapping[str, Any], where: str = "config.json") -> DrafterModelConfig:
    """dflash-ipc's :class:`DrafterModelConfig` of a SpecForge ``DFlashDraftModel`` config (a dict)."""
    if list(cfg.get("architectures") or []) != ["DFlashDraftModel"]:
        raise SpecForgeDraftError(f"{where}: architectures {cfg.get('architectures')!r}, not ['DFlashDraftModel']")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise SpecForgeDraftError(f"{where}: {key} = true; dflash-ipc's drafter has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecForgeDraftError(f"{where}: hidden_act {cfg['hidden_act']!r}; dflash-ipc's drafter uses SiLU")
    dflash = dict(cfg.get("dflash_config") or {})
    foreign = [k for k in FOREIGN_DFLASH_KEYS if dflash.get(k)]
    if foreign:
        raise SpecForgeDraftError(f"{where}: dflash_config sets {foreign}: another draft family than plain DFlash")
    for key in ("target_layer_ids", "mask_token_id"):
        if dflash.get(key) is None:
            raise SpecForgeDraftError(f"{where}: dflash_config.{key} is missing (SpecForge's trainer writes it)")
    rope = dict(cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta")})
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise SpecForgeDraftError(f"{where}: RoPE {rope.get('rope_type')!r} with scaling; dflash-ipc's drafter uses plain RoPE")
    if rope.get("rope_theta") is None:
        raise SpecForgeDraftError(f"{where}: no rope_parameters.rope_theta")
    vocab = int(cfg["vocab_size"])
    if int(cfg.get("draft_vocab_size") or vocab) != vocab:
        raise SpecForgeDraftError(f"{where}: draft_vocab_size {cfg['draft_vocab_size']} != vocab_size {vocab}: a reduced head")
    layers = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or [FULL] * layers)
    window = cfg.get("sliding_window")
    if SLIDING in layer_types and not window:
        raise SpecForgeDraftError(f"{where}: sliding_attention layers without a sliding_window")
    heads = int(cfg["num_attention_heads"])
    try:
        return DrafterModelConfig(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            num_layers=layers,
            layer_types=layer_types,
            sliding_window=int(window) if window else UNUSED_WINDOW,
            block_size=int(cfg.get("block_size") or dflash.get("block_size") or 16),
            vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
            mask_token_id=int(dflash["mask_token_id"]),
            num_target_layers=int(cfg.get("num_target_layers") or 0),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SpecForgeDraftError(f"{where}: not a DFlash drafter config dflash-ipc can hold ({type(e).__name__}: {e})") from None


def _placeholder_heads(config: DrafterModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """A [vocab, hidden] stand-in for the target's frozen table: the export never carries it, and an expanded
    zero takes no memory."""
    return torch.zeros((), dtype=dtype).expand(config.vocab_size, config.hidden_size)


def drafter_state(state: Mapping[str, torch.Tensor], config: DrafterModelConfig, where: str = "model.safetensors") -> dict:
    """SpecForge's draft tensors under dflash-ipc's names, every expected one present with its shape."""
    expected = _expected_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = name.removeprefix(WRAPPER_PREFIX)
        if key in DROPPED_NAMES or key.startswith(DROPPED_PREFIXES):
            continue
        if key not in expected:
            raise SpecForgeDraftError(f"{where}: tensor {name!r} has no place in dflash-ipc's drafter")
        if tuple(tensor.shape) != expected[key]:
            raise SpecForgeDraftError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}; the config says {expected[key]}")
        out[key] = tensor
    missing = sorted(set(expected) - set(out))
    if missing:
        raise SpecForgeDraftError(f"{where}: missing drafter tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    return out


def _expected_shapes(config: DrafterModelConfig) -> dict[str, tuple[int, ...]]:
    head = _placeholder_heads(config, torch.float32)
    with torch.device("meta"):
        shell = DFlashDrafter(config, head, head, attention="sdpa", device="meta", init_seed=0)
    return {k: tuple(v.shape) for k, v in shell.state_dict().items()}


def to_drafter(config: DrafterModelConfig, state: Mapping[str, torch.Tensor]) -> DFlashDrafter:
    """dflash-ipc's drafter holding SpecForge's weights (strict load; over stand-in heads: export it, or load
    the export with the target's heads, to run it)."""
    mapped = drafter_state(state, config)
    dtype = next(iter(mapped.values())).dtype
    head = _placeholder_heads(config, dtype)
    model = DFlashDrafter(config, head, head, attention="sdpa", device="cpu", dtype=dtype, init_seed=0)
    model.load_state_dict({k: v.to("cpu") for k, v in mapped.items()}, strict=True)
    return model


def read_specforge_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config dict, tensors)`` of a SpecForge HF draft directory (one safetensors file or an index of shards)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise SpecForgeDraftError(f"{cfg_path}: not found; {path} is not a SpecForge draft directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise SpecForgeDraftError(f"{cfg_path}: not JSON ({e})") from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise SpecForgeDraftError(f"{path}: no model.safetensors (nor an index of shards)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(path / f)))
    return cfg, state


def convert(src: str | Path, out: str | Path, chat_template_kwargs: dict | None = None) -> Path:
    """Convert SpecForge's HF draft directory ``src`` into dflash-ipc's export ``out``; returns ``out``."""
    cfg, state = read_specforge_dir(src)
    config = drafter_config(cfg, f"{Path(src) / 'config.json'}")
    model = to_drafter(config, {k: v for k, v in state.items()})
    return export_drafter(model, out, chat_template_kwargs=chat_template_kwargs or {}, client="all")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="src", required=True, help="SpecForge's HF draft directory (export_to_hf)")
    p.add_argument("--out", required=True, help="dflash-ipc export directory to write")
    p.add_argument("--chat-template-kwargs", default="{}", help="the [chat_template] kwargs the training data was rendered with")
    args = p.parse_args(argv)
    try:
        out = convert(args.src, args.out, json.loads(args.chat_template_kwargs))
    except (SpecForgeDraftError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"specforge": str(args.src), "export": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
