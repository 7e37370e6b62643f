"""A drafter that starts from the target's own weights (``drafter.init_from_target``).

A random drafter spends its first hundreds of steps learning what the target already knows: how a
decoder layer turns token embeddings into what the LM head reads. The drafter's layers have the
target's shapes (its hidden size always; heads, head size and MLP width unless the config changes
them), so each can start as a copy of one target layer:

* drafter layer ``d`` <- target layer ``init_from_target[d]`` (negative: from the top): attention
  projections, MLP and both norms; the q/k norms too where the target has them (where it has none,
  they start at one, as in a random start);
* the final norm <- the target's (the LM head is the target's already);
* ``fc`` <- the identity on one captured plane, zeros on the others: the plane nearest the first copied
  layer's input (the output of layer ``first - 1``; ties: the shallower), so the context rows start as
  the target's own hidden states at about the depth the copied layers read.

:func:`plan_init` checks a plan against shapes alone (the checkpoint's safetensors headers: the
preflight refuses a bad plan before any process starts); :func:`apply_init` copies the tensors.
Tensors of a copied layer the drafter has no place for (a target's attention biases) are named in
the plan's description and left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dflash_ipc.drafter.model.dflash_drafter import DFlashDecoderLayer, DFlashDrafter, DrafterModelConfig

__all__ = ["InitPlan", "apply_init", "drafter_layer_shapes", "nearest_plane", "plan_init"]

#: Drafter tensors a target may lack: they keep their random-start value (ones).
_OPTIONAL = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


@dataclass(frozen=True)
class InitPlan:
    """What :func:`apply_init` copies: (drafter name, target decoder-stack name) pairs and the fc plane."""

    target_layers: list[int]
    copies: list[tuple[str, str]]
    left_at_default: list[str]
    left_out: list[str]
    context_plane: int  # index into the captured planes (fc's input blocks)
    context_layer: int  # that plane's target layer

    def describe(self) -> str:
        parts = [
            f"drafter layers from target layers {self.target_layers}",
            "final norm from the target's",
            f"fc = identity on the plane of target layer {self.context_layer}",
        ]
        if self.left_at_default:
            parts.append(f"at their random-start value (the target has none): {sorted({n.split('.', 2)[2] for n in self.left_at_default})}")
        if self.left_out:
            parts.append(f"target tensors the drafter has no place for, left out: {self.left_out}")
        return "; ".join(parts)


def drafter_layer_shapes(cfg: DrafterModelConfig) -> dict[str, tuple[int, ...]]:
    """One drafter layer's tensors and shapes (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        layer = DFlashDecoderLayer(cfg, 0)
    return {name: tuple(t.shape) for name, t in layer.state_dict().items()}


def nearest_plane(layer_ids: list[int], first_copied: int) -> int:
    """Index of the captured plane nearest the input of target layer ``first_copied`` (ties: shallower)."""
    want = first_copied - 1
    return min(range(len(layer_ids)), key=lambda j: (abs(layer_ids[j] - want), layer_ids[j]))


def plan_init(cfg: DrafterModelConfig, init_layers: list[int], target_shapes: Mapping[str, tuple[int, ...]]) -> InitPlan:
    """The copy plan for ``init_layers`` (one per drafter layer), checked against the target's tensor
    shapes (names inside its decoder stack). ``ValueError`` says what to change."""
    n = cfg.num_target_layers
    if len(init_layers) != cfg.num_layers:
        raise ValueError(f"names {len(init_layers)} target layers for {cfg.num_layers} drafter layers; name one per drafter layer")
    bad = [i for i in init_layers if not -n <= i < n]
    if bad:
        raise ValueError(f"{bad} outside the target's {n} decoder layers (0..{n - 1}, or -{n}..-1 from the top)")
    resolved = [i % n for i in init_layers]
    q_proj = ".self_attn.q_proj.weight"
    with_attention = sorted({int(k.split(".")[1]) for k in target_shapes if k.startswith("layers.") and k.endswith(q_proj)})
    layer_shapes = drafter_layer_shapes(cfg)
    copies: list[tuple[str, str]] = []
    left_at_default: list[str] = []
    left_out: list[str] = []
    for d, t in enumerate(resolved):
        if t not in with_attention:
            raise ValueError(
                f"target layer {t} has no self_attn.q_proj (not a softmax-attention layer); "
                f"the drafter's layers can start from {_ranges(with_attention) or 'none of them'}"
            )
        for name, shape in layer_shapes.items():
            src, dst = f"layers.{t}.{name}", f"layers.{d}.{name}"
            if src not in target_shapes:
                if name in _OPTIONAL:
                    left_at_default.append(dst)
                    continue
                raise ValueError(f"target layer {t} has no {name} (its layers differ from a Llama/Qwen3 decoder layer)")
            if tuple(target_shapes[src]) != shape:
                raise ValueError(
                    f"target {src} is {list(target_shapes[src])} but the drafter's {name} is {list(shape)}: the drafter's "
                    "heads, head size and MLP width must be the target's (set them to 0), and the target's attention "
                    "must be plain (a gated q_proj, as in Qwen3.5, cannot be copied)"
                )
            copies.append((dst, src))
        prefix = f"layers.{t}."
        left_out += sorted(k for k in target_shapes if k.startswith(prefix) and k.removeprefix(prefix) not in layer_shapes)
    if target_shapes.get("norm.weight") != (cfg.hidden_size,):
        raise ValueError(f"the target's decoder stack has no final norm.weight of [{cfg.hidden_size}]")
    copies.append(("norm.weight", "norm.weight"))
    plane = nearest_plane(cfg.target_layer_ids, resolved[0])
    return InitPlan(resolved, copies, left_at_default, left_out, plane, cfg.target_layer_ids[plane])


def apply_init(model: DFlashDrafter, plan: InitPlan, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (target decoder-stack name -> tensor, every source of ``plan.copies``) into
    ``model`` and set ``fc`` to the identity on ``plan.context_plane``."""
    params = dict(model.named_parameters())
    h = model.config.hidden_size
    with torch.no_grad():
        for dst, src in plan.copies:
            params[dst].copy_(tensors[src])
        fc = model.fc.weight
        fc.zero_()
        fc[:, plan.context_plane * h : (plan.context_plane + 1) * h] = torch.eye(h, dtype=fc.dtype, device=fc.device)


def _ranges(ids: list[int]) -> str:
    if len(ids) <= 8:
        return str(ids)
    return f"{ids[:4]} ... {ids[-4:]} ({len(ids)} layers)"
