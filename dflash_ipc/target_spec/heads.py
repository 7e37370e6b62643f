"""The target's frozen embedding and LM head, for the drafter, without building the target.

Checkpoint: the two tensors are read straight from the safetensors files (and, for a drafter that
starts from the target's own layers, any tensor of the decoder stack by its name inside the stack:
:func:`decoder_stack_shapes`, :func:`read_decoder_stack`). Random spec: they are
regenerated from ``target.random_init_seed`` with generators seeded per tensor name
(:func:`derived_seed`), so the target (which copies the embedding into its stack) and every
drafter get identical tensors without shipping them.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from dflash_ipc.config import TargetConfig
from dflash_ipc.platform.devices import as_device, cuda_device, fill_normal_
from dflash_ipc.target_spec.hf_config import text_config


def derived_seed(seed: int, tag: str) -> int:
    """A generator seed for one named tensor of a run: the same on every process and every build."""
    return (int(seed) * 1_000_003 + zlib.crc32(tag.encode())) % (2**63 - 1)


def _head_generator(seed: int, tag: str, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derived_seed(seed, tag))
    return g


def _random_matrix(rows: int, cols: int, std: float, seed: int, tag: str, device, dtype) -> torch.Tensor:
    """N(0, std) [rows, cols] drawn in fixed row chunks (bounded memory) and written to ``device``.

    On the CPU the draw is identical on every process. On CUDA it is drawn on the GPU (a CPU
    draw of a 248k x 5120 table takes ~30 s per process); every process of one run uses the
    same GPU model, so target and drafters still get identical tensors."""
    device = as_device(device)
    out = torch.empty(rows, cols, device=device, dtype=dtype)
    if device.type == "cuda":
        return fill_normal_(out, std, _head_generator(seed, tag, device), chunk_elems=1 << 28)
    return fill_normal_(out, std, _head_generator(seed, tag))


def is_tied(hf_config: Any) -> bool:
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
        if n.endswith("embed_tokens.weight") and not n.startswith("mtp") and not any(p in n for p in ("visual", "vision", "audio", ".mtp"))
    ]
    if not cands:
        cands = [n for n in names if n.endswith(("wte.weight", "word_embeddings.weight", "tok_embeddings.weight"))]
    if not cands:
        raise KeyError("no input-embedding tensor (…embed_tokens.weight) in the checkpoint")
    # prefer the language model's own embedding, then the shortest name
    cands.sort(key=lambda n: ("language_model" not in n and not n.startswith("model.embed_tokens"), len(n)))
    return cands[0]


def _decoder_stack(model_dir: Path) -> tuple[dict[str, str], str]:
    """(tensor name -> file, the decoder stack's prefix): ``model.`` for most causal LMs,
    ``model.language_model.`` for multimodal wrappers (the prefix of the input embedding)."""
    weight_map = _safetensors_files(model_dir)
    return weight_map, _pick_embed_key(weight_map).removesuffix("embed_tokens.weight")


def decoder_stack_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the decoder stack by its name inside it (``layers.3.mlp.up_proj.weight``,
    ``norm.weight``) and its shape, from the safetensors headers alone (no weights are read)."""
    from safetensors import safe_open

    model_dir = Path(model_path)
    weight_map, prefix = _decoder_stack(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(model_dir / file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix) and weight_map.get(key) == file:
                    shapes[key.removeprefix(prefix)] = tuple(f.get_slice(key).get_shape())
    return shapes


def read_decoder_stack(model_path: str | Path, names: Iterable[str], device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The named tensors of the decoder stack (names as :func:`decoder_stack_shapes` gives them),
    read straight to ``device`` in ``dtype``; a name the checkpoint lacks raises ``KeyError``."""
    model_dir = Path(model_path)
    weight_map, prefix = _decoder_stack(model_dir)
    names = list(names)
    missing = [n for n in names if prefix + n not in weight_map]
    if missing:
        raise KeyError(f"{model_dir}: no tensor {missing[0]!r} in the decoder stack (prefix {prefix!r})")
    tensors = _read_tensors(model_dir, weight_map, [prefix + n for n in names], device, dtype)
    return {n: tensors[prefix + n] for n in names}


def _read_tensors(model_dir: Path, weight_map: dict[str, str], keys: list[str], device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint tensors by their full names, straight to ``device`` in ``dtype``, each file opened once."""
    from safetensors import safe_open

    device = as_device(device)
    dev = str(cuda_device(device) if device.type == "cuda" else device)
    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(weight_map[key], []).append(key)
    out: dict[str, torch.Tensor] = {}
    for file, file_keys in by_file.items():
        with safe_open(str(model_dir / file), framework="pt", device=dev) as f:
            for key in file_keys:
                out[key] = f.get_tensor(key).to(dtype)
    return out


def target_head_weights(cfg: TargetConfig, hf_config: Any, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_weight [V, H], lm_head_weight [V, H]) of the target, frozen, for the drafter.

    Checkpoint: only these two tensors are read from the safetensors files (index json aware,
    tied embeddings handled), straight to ``device``; the model is never built. Random spec:
    regenerated from ``cfg.random_init_seed`` with dedicated CPU generators, so the target
    (which copies the embedding into its ``embed_tokens``) and every drafter get identical
    tensors without shipping them. Tied heads return the same tensor twice.
    """
    device = as_device(device)
    if cfg.model_path:
        model_dir = Path(cfg.model_path)
        weight_map = _safetensors_files(model_dir)
        embed_key = _pick_embed_key(weight_map)
        head_key = None
        if not is_tied(hf_config):
            for cand in ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight"):
                if cand in weight_map:
                    head_key = cand
                    break

        read = _read_tensors(model_dir, weight_map, [embed_key] if head_key is None else [embed_key, head_key], device, dtype)
        return read[embed_key], read[head_key or embed_key]
    tc = text_config(hf_config)
    v, h = int(tc.vocab_size), int(tc.hidden_size)
    std = float(getattr(tc, "initializer_range", 0.02))
    embed = _random_matrix(v, h, std, cfg.random_init_seed, "embed_tokens", device, dtype)
    if is_tied(hf_config):
        return embed, embed
    head = _random_matrix(v, h, std, cfg.random_init_seed, "lm_head", device, dtype)
    return embed, head
