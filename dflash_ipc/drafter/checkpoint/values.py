"""What a checkpoint's tensors must be, checked once torch has loaded them (the files and the manifest
are ``checkpoint.verify``'s, without torch).

* **Values** (:func:`value_problem`): no finite training run writes a NaN or inf, a trainable weight
  past :data:`WEIGHT_ABS_BOUND` (a run whose learning rate or loss blew up: exploded), a moment past
  :data:`MAX_ABS_VALUE`, or a negative ``exp_avg_sq``. The same bound ends a run whose own weights
  exploded before it writes them (``drafter/training/learning.py``).
* **The model** (:func:`shape_problem`): the drafter that loads a checkpoint knows its trainable tensors;
  the checkpoint's weights must be exactly that set at exactly those shapes, and each moment one of a
  trainable tensor's, at its shape (an extra, missing or transposed tensor would fail after the load).
* **The step** (:func:`step_problem`): the trainer's step counts the steps that reached the optimizer
  (>= 0, at most the checkpoint's step), the optimizer's its applied updates (at most the trainer's).

A checkpoint that fails any of them is passed over for the next older one (``load_latest_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: A weight or first moment whose square overflows float32 (2**64 ~ 1.8e19; float32 max ~ 3.4e38) turns
#: every norm, variance and dot product it enters into inf: no such value comes out of a finite run.
MAX_ABS_VALUE = 2.0**64
#: A trainable weight this large is exploded: AdamW moves a weight by about the learning rate per update
#: (and weight decay pulls it back), so 1e6 takes ~1e9 updates at lr 1e-3; the target's own weights that
#: ``drafter.init_from_target`` copies are O(1) to O(100). A run whose updates blew up goes far past it
#: (``training.lr = 1e30``: 2e29 after its first update).
WEIGHT_ABS_BOUND = 1e6
#: The optimizer's per-parameter tensors in optimizer.safetensors (``"<param index>.<name>"``).
MOMENT_NAMES = ("exp_avg", "exp_avg_sq")


def named_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors inside nested dicts/lists (a trainer state of format 1 holds weights and moments), by dotted path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(named_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def value_problem(tensors: Mapping[str, torch.Tensor], bound: float = MAX_ABS_VALUE) -> str | None:
    """The first tensor no finite training run writes: a NaN or inf, a magnitude past ``bound``, a
    negative ``exp_avg_sq`` (a running mean of squares). None: all plausible."""
    for name, t in tensors.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            return f"{name} holds {bad} non-finite value(s) (NaN or inf)"
        if name.endswith("exp_avg_sq"):
            low = float(t.min())
            if low < 0:
                return f"{name} holds a negative value ({low:g}); a mean of squares cannot be negative"
            continue
        peak = float(t.abs().max())
        if peak > bound:
            why = "exploded: no run that learns writes one" if bound < MAX_ABS_VALUE else "its square overflows float32"
            return f"{name} holds a value of magnitude {peak:.3g}, past {bound:.3g} ({why})"
    return None


@dataclass(frozen=True)
class ModelShapes:
    """What a checkpoint of a model must hold: each trainable tensor's shape by name (model.safetensors),
    and each optimizer parameter's by its index (its moments in optimizer.safetensors, ``"<index>.<name>"``)."""

    weights: Mapping[str, tuple[int, ...]]
    params: Mapping[int, tuple[int, ...]]


def shape_problem(weights: Mapping[str, torch.Tensor], moments: Mapping[str, torch.Tensor], expected: ModelShapes) -> str | None:
    """Why ``weights`` (model.safetensors) and ``moments`` (optimizer.safetensors) do not fit the model
    ``expected`` describes, or None."""
    missing, extra = sorted(expected.weights.keys() - weights.keys()), sorted(weights.keys() - expected.weights.keys())
    if missing or extra:
        return f"the model's trainable tensors differ: missing {missing[:3]}, unexpected {extra[:3]}"
    for name, shape in expected.weights.items():
        if tuple(weights[name].shape) != tuple(shape):
            return f"{name} has shape {tuple(weights[name].shape)}, the model's is {tuple(shape)}"
    for key, t in moments.items():
        index, _, kind = key.partition(".")
        shape = expected.params.get(int(index)) if index.isdigit() else None
        if shape is None or kind not in MOMENT_NAMES:
            return f"optimizer tensor {key!r} is no moment of the model's {len(expected.params)} parameters"
        if tuple(t.shape) != tuple(shape):
            return f"optimizer tensor {key} has shape {tuple(t.shape)}, its parameter's is {tuple(shape)}"
    return None


def step_problem(trainer_state: Mapping[str, Any], step: int) -> str | None:
    """Why the trainer's step counts (trainer.pt) cannot belong to a checkpoint of ``step``, or None."""
    trained = trainer_state.get("step")
    if type(trained) is not int or not 0 <= trained <= step:
        return f"the trainer's step is {trained!r}, not a count from 0 to the checkpoint's step {step}"
    optimizer = trainer_state.get("optimizer")
    per_param = optimizer.get("state", {}) if isinstance(optimizer, dict) else {}
    for index, state in per_param.items() if isinstance(per_param, dict) else ():
        applied = state.get("step") if isinstance(state, dict) else None
        if isinstance(applied, torch.Tensor) and applied.numel() == 1 and not 0 <= float(applied) <= trained:
            return f"parameter {index}'s optimizer step is {float(applied):g}, not a count from 0 to the trainer's step {trained}"
    return None
