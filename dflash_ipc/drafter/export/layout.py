"""Export a trained drafter for the SGLang / vLLM DFlash loaders, and load such an export back."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_ipc.control.drafter_tau import DrafterTau
from dflash_ipc.data.draft_vocab import EXPORT_FILE as DRAFT_VOCAB_EXPORT_FILE
from dflash_ipc.data.draft_vocab import EXPORT_TENSOR as DRAFT_VOCAB_TENSOR
from dflash_ipc.drafter.checkpoint.safetensors_stream import write_safetensors
from dflash_ipc.drafter.export.destination import EXPORT_MARKER, check_replaceable, marker_text
from dflash_ipc.drafter.model.dflash_drafter import FULL, SLIDING, DFlashDrafter, DrafterModelConfig
from dflash_ipc.drafter.model.frozen_head import (
    EMBED_TENSOR,
    carries_scaled_embeddings,
    frozen_head_config,
    frozen_head_from_config,
    scaled_table,
)
from dflash_ipc.platform.devices import dtype_name
from dflash_ipc.rundir.fsutil import replace_dir

EXPORT_WEIGHTS_FILE = "model.safetensors"


#: the serving clients an export is laid out for; "all": one directory every one of them reads
CLIENTS = ("all", "vllm", "sglang", "zlab")
#: the project's own modeling code, written beside the weights for ``trust_remote_code`` loaders
MODELING_FILE = "modeling_dflash_ipc.py"
MODEL_CLASS = "DFlashIpcDraftModel"
#: the reduced head in vLLM's EAGLE-3 layout: ``lm_head.weight`` [N, H] and ``d2t`` [N]
#: (draft row i drafts target id ``i + d2t[i]``)
HEAD_TENSOR, D2T_TENSOR = "lm_head.weight", "d2t"
EXPORT_MODE = 0o644  # an export is read by serving engines, often as another user


def _check_client(client: str) -> None:
    if client not in CLIENTS:
        raise ValueError(f"unknown export client {client!r}: one of {', '.join(CLIENTS)}")


def carries_reduced_head(config: DrafterModelConfig, client: str = "all") -> bool:
    """Whether an export for ``client`` carries the drafter's own head rows (+ d2t): every layout but
    SGLang's, whose DFlash loader skips both and drafts over the target's whole head."""
    return bool(config.draft_vocab_size) and client != "sglang"


def drafter_hf_config(
    config: DrafterModelConfig, dtype: torch.dtype, client: str = "all", target_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The ``config.json`` of an exported drafter (see :func:`export_drafter`); ``target_dtype``: the dtype the
    target computed its embeddings in during training (where its family scales them), the weights' otherwise."""
    _check_client(client)
    any_sliding = SLIDING in config.layer_types
    weights_dtype = dtype_name(dtype)
    reduced = carries_reduced_head(config, client)
    dflash_config: dict[str, Any] = {
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
    }
    if config.num_target_layers:
        dflash_config["num_target_layers"] = config.num_target_layers
    if reduced:
        dflash_config["draft_vocab_size"] = config.draft_vocab_size
    out: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "layer_types": list(config.layer_types),
        "use_sliding_window": any_sliding,
        "sliding_window": config.sliding_window if any_sliding else None,
        "max_window_layers": config.num_layers,
        "tie_word_embeddings": False,
        "block_size": config.block_size,
        "dflash_config": dflash_config,
        # what the drafter serves with: `method` and `num_speculative_tokens` of vLLM's --speculative-config
        # (SGLang's --speculative-num-draft-tokens is the block size)
        "method": "dflash",
        "num_speculative_tokens": config.block_size - 1,
        "dtype": weights_dtype,
        "torch_dtype": weights_dtype,
    }
    if client in ("all", "vllm"):
        # vLLM's aux-hidden-state ids are "captured before layer i" = DFlash's "output of
        # layer i-1", hence +1 (vLLM derives the same from dflash_config.target_layer_ids).
        out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config.target_layer_ids]
    if reduced:  # vLLM reads the head's size from the top level
        out["draft_vocab_size"] = config.draft_vocab_size
    if client in ("all", "zlab"):
        out["auto_map"] = {"AutoModel": f"{MODELING_FILE.removesuffix('.py')}.{MODEL_CLASS}"}
    if config.num_target_layers:
        out["num_target_layers"] = config.num_target_layers
    head_dflash, head_top = frozen_head_config(config.frozen_head, target_dtype or dtype, client)
    dflash_config.update(head_dflash)
    out.update(head_top)
    return out


def _export_tensors(model: DFlashDrafter, client: str) -> dict[str, torch.Tensor]:
    tensors = dict(model.state_dict())
    if carries_reduced_head(model.config, client):
        ids = model.draft_token_ids.detach().to(torch.int64)
        tensors[HEAD_TENSOR] = model.lm_head_weight.detach()
        tensors[D2T_TENSOR] = (ids - torch.arange(ids.numel(), device=ids.device)).cpu()
    if carries_scaled_embeddings(model.config.frozen_head, client):
        tensors[EMBED_TENSOR] = scaled_table(model.config.frozen_head, model.embed_weight.detach(), model.target_dtype)
    return tensors


def export_drafter(
    model: DFlashDrafter,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    chat_template_kwargs: dict | None = None,
    client: str = "all",
    drafter_tau: DrafterTau | None = None,
    root: Path | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for the serving engines' DFlash loaders (``client``:
    one of :data:`CLIENTS`; "all" writes the union, which every one of them reads).

    Layout, chosen after reading ``sglang: python/sglang/srt/models/dflash.py`` (``DFlashDraftModel``,
    ``load_weights``: unknown names are skipped), ``sglang: python/sglang/srt/speculative/dflash_utils.py``
    (``parse_dflash_draft_config``, ``get_dflash_layer_types``,
    ``get_dflash_attention_sliding_window_size``), ``vllm: vllm/model_executor/models/qwen3_dflash.py``
    (``DFlashQwen3Model`` / ``DFlashQwen3ForCausalLM.load_weights``, ``_resolve_layer_attention``,
    ``compute_logits``: ``lm_head`` + ``d2t``), vLLM's ``eagle3_utils.get_eagle3_aux_layers_from_config``,
    z-lab ``dflash`` 0.1.0 ``dflash/model.py`` and SpecForge ``specforge/modeling/draft/dflash.py``:

    * ``config.json``: a Qwen3 config (``model_type: "qwen3"``) with
      ``architectures: ["DFlashDraftModel"]``, ``num_hidden_layers``, ``layer_types``,
      ``use_sliding_window`` / ``sliding_window`` (HF semantics: the window counts the current
      token), ``rope_parameters`` (+ legacy ``rope_theta``), top-level ``block_size`` and
      ``num_target_layers``, ``dflash_config: {block_size, mask_token_id, target_layer_ids,
      num_target_layers}`` (target layer ids count as z-lab and SGLang count them: the output of
      layer i, ``hidden_states[i + 1]``), ``method`` / ``num_speculative_tokens`` (block - 1), and
      for vLLM ``eagle_aux_hidden_state_layer_ids = target_layer_ids + 1``. No ``is_causal``: every
      loader then defaults to causal in-block attention for sliding layers and bidirectional for
      full layers, which is what this drafter trains.
    * ``model.safetensors``: unprefixed names ``layers.N.self_attn.{q,k,v,o}_proj.weight``,
      ``layers.N.self_attn.{q,k}_norm.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
      ``layers.N.{input,post_attention}_layernorm.weight``, ``fc.weight``,
      ``hidden_norm.weight``, ``norm.weight``. SGLang stacks q/k/v and gate/up itself; vLLM
      adds the ``model.`` prefix itself. No ``embed_tokens`` (every engine shares the target's) but for a
      family that scales its embeddings (below).
    * A drafter trained over a draft vocabulary (``drafter.draft_vocab_size``) carries its head in
      vLLM's EAGLE-3 layout: ``lm_head.weight`` (the N target rows it drafts over), ``d2t``
      (``target id = row + d2t[row]``) and top-level ``draft_vocab_size``; vLLM and the export's
      own modeling code draft over those rows. SGLang's loader and z-lab's ``DFlashDraftModel``
      skip both tensors and draft over the target's whole head (lossless, not the saving); the
      ``sglang`` layout leaves them out, and eval then drafts over the whole head as SGLang does.
    * ``all`` and ``zlab``: ``modeling_dflash_ipc.py`` (the project's own, :mod:`.hf_modeling`) and
      ``auto_map``, for ``AutoModel.from_pretrained(EXPORT, trust_remote_code=True)``.
    * A target that scales its embeddings or finishes its logits (Gemma, Granite: ``config.frozen_head``)
      adds the keys and the tensor each engine reads to do the same (:func:`~dflash_ipc.drafter.model.frozen_head.frozen_head_config`;
      which engine can, docs/EVAL.md).
    * ``chat_template_kwargs``: the ``[chat_template] kwargs`` the training data was rendered with
      (``{}``: none), for eval's check and the serving request; loaders ignore the key.
    * ``drafter_tau``: the τ these weights reached and whether that is worth serving
      (:mod:`dflash_ipc.control.drafter_tau`; absent when none was measured); loaders ignore the key.

    Every file is written 0644, beside a marker (:data:`.destination.EXPORT_MARKER`) naming them. ``out_dir``
    must be missing, empty or a previous export (:func:`.destination.check_replaceable`); the export is
    written beside it and swapped in whole (:func:`dflash_ipc.rundir.fsutil.replace_dir`): a kill leaves the previous
    one as it was. ``root``: a directory trusted as given (the run's, for the export ``up`` writes) below which
    no link is followed; without it ``out_dir``'s links are resolved first.
    Note: vLLM needs its V2 model runner for drafters that mix sliding and full layers.
    """
    _check_client(client)
    out = Path(out_dir) if root is not None else Path(out_dir).resolve()
    check_replaceable(out)
    dtype = dtype or model.dtype
    tensors = _export_tensors(model, client)
    cfg = drafter_hf_config(model.config, dtype, client, target_dtype=model.target_dtype)
    cfg[CHAT_TEMPLATE_KWARGS_KEY] = dict(chat_template_kwargs or {})
    if drafter_tau is not None:
        cfg[DRAFTER_TAU_KEY] = drafter_tau.metadata()

    def fill(staged: Path) -> None:
        weights = staged / EXPORT_WEIGHTS_FILE
        if all(t.is_floating_point() for t in tensors.values()):
            write_safetensors(weights, tensors, {"format": "pt"}, dtype=dtype)  # bounded host memory
        else:  # d2t stays int64: cast the weights one by one (on their device)
            write_safetensors(
                weights, {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, {"format": "pt"}
            )
        written = {EXPORT_WEIGHTS_FILE: None}
        if client in ("all", "zlab"):
            written[MODELING_FILE] = Path(__file__).with_name("hf_modeling.py").read_text()
        written["config.json"] = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
        written[EXPORT_MARKER] = marker_text(list(written))  # last: it names what this export wrote
        for name, text in written.items():
            if text is not None:
                with open(staged / name, "x") as f:
                    f.write(text)
        for name in written:
            os.chmod(staged / name, EXPORT_MODE)  # only the files written here, whatever the umask

    if root is None:
        out.parent.mkdir(parents=True, exist_ok=True)
    replace_dir(out, fill, root=root)
    return out


CHAT_TEMPLATE_KWARGS_KEY = "chat_template_kwargs"
DRAFTER_TAU_KEY = "drafter_tau"


def recorded_chat_template_kwargs(path: str | Path) -> dict | None:
    """The chat-template kwargs an export records; None for an export written before they were recorded."""
    return json.loads((Path(path) / "config.json").read_text()).get(CHAT_TEMPLATE_KWARGS_KEY)


def _config_from_hf_dict(d: Mapping[str, Any]) -> DrafterModelConfig:
    dflash = d.get("dflash_config") or {}
    layer_types = d.get("layer_types") or [FULL] * int(d["num_hidden_layers"])
    rp = d.get("rope_parameters") or {}
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    return DrafterModelConfig(
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_attention_heads=int(d["num_attention_heads"]),
        num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
        num_layers=int(d["num_hidden_layers"]),
        layer_types=list(layer_types),
        sliding_window=int(d.get("sliding_window") or 2048),
        block_size=int(dflash.get("block_size", d.get("block_size", 16))),
        vocab_size=int(d["vocab_size"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        target_layer_ids=list(dflash["target_layer_ids"]),
        mask_token_id=int(dflash["mask_token_id"]),
        num_target_layers=int(d.get("num_target_layers", 0) or 0),
        initializer_range=float(d.get("initializer_range", 0.02)),
        draft_vocab_size=int(dflash.get("draft_vocab_size", 0) or 0),
        frozen_head=frozen_head_from_config(dflash),
    )


def read_export(path: str | Path) -> DrafterModelConfig:
    """An export's config, its weights file checked readable (header and size, no tensor read):
    a ValueError naming the file and what is wrong, before any model is loaded."""
    return _read_export(path)[0]


def _read_export(path: str | Path) -> tuple[DrafterModelConfig, torch.Tensor | None]:
    """:func:`read_export`, with the draft vocabulary's ids (None: the whole vocabulary)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg_path, weights = path / "config.json", path / EXPORT_WEIGHTS_FILE
    for f in (cfg_path, weights):
        if not f.is_file():
            raise ValueError(f"{f}: not found; {path} is not an exported drafter (config.json + {EXPORT_WEIGHTS_FILE})")
    try:
        cfg = _config_from_hf_dict(json.loads(cfg_path.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not JSON ({e})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{cfg_path}: not a DFlash drafter config ({type(e).__name__}: {e})") from None
    ids = read_export_draft_vocab(path, cfg)
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except SafetensorError as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e}); export the drafter again") from None
    return cfg, ids


def load_exported_drafter(
    path: str | Path,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    attention: str = "auto",
    device: torch.device | str | None = None,
) -> DFlashDrafter:
    """Rebuild a :class:`DFlashDrafter` from an :func:`export_drafter` directory (strict load;
    a damaged or mismatched export is a ValueError naming its file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg, ids = _read_export(path)
    weights = path / EXPORT_WEIGHTS_FILE
    try:
        state = load_file(str(weights), device=str(device) if device is not None else "cpu")
    except SafetensorError as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e}); export the drafter again") from None
    # the head rows are the target's own (frozen): rebuilt from lm_head_weight by their ids (d2t); the scaled
    # embedding table (for vLLM) is the target's too, scaled as config.json's frozen head says
    for frozen in (HEAD_TENSOR, D2T_TENSOR, EMBED_TENSOR):
        state.pop(frozen, None)
    dtype = next(iter(state.values())).dtype if state else torch.float32
    model = DFlashDrafter(cfg, embed_weight, lm_head_weight, attention=attention, device=device, init_seed=0, draft_token_ids=ids).to(dtype)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights} does not fit {path / 'config.json'}: {str(e)[:500]}") from None
    return model


def read_export_draft_vocab(path: Path, cfg: DrafterModelConfig) -> torch.Tensor | None:
    """The target ids the export's head rows draft over (``d2t`` in model.safetensors, or an older
    export's ``draft_vocab.safetensors``), None when it drafts over the whole vocabulary."""
    if not cfg.draft_vocab_size:
        return None
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    weights = path / EXPORT_WEIGHTS_FILE
    try:
        with safe_open(str(weights), framework="pt") as f:
            d2t = f.get_tensor(D2T_TENSOR) if D2T_TENSOR in f.keys() else None
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e}); export the drafter again") from None
    if d2t is not None:
        f, ids = weights, torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    else:
        f = path / DRAFT_VOCAB_EXPORT_FILE
        try:
            ids = load_file(str(f))[DRAFT_VOCAB_TENSOR]
        except FileNotFoundError:
            raise ValueError(
                f"{weights}: no {D2T_TENSOR}; config.json's draft_vocab_size is {cfg.draft_vocab_size}: export the drafter again"
            ) from None
        except (SafetensorError, KeyError) as e:
            raise ValueError(f"{f}: no readable {DRAFT_VOCAB_TENSOR} ({type(e).__name__}: {e}); export the drafter again") from None
    if tuple(ids.shape) != (cfg.draft_vocab_size,):
        raise ValueError(f"{f}: the draft rows' ids have shape {tuple(ids.shape)}, config.json says {cfg.draft_vocab_size} tokens")
    return ids.to(torch.int64)
