"""The target's effective embedding and LM head, as the drafter computes them.

:class:`~dflash_ipc.families.traits.FrozenHead` says what a target family applies around its two frozen
tables (Gemma scales its embeddings by sqrt(hidden) and soft-caps its logits; Granite multiplies its
embeddings and divides its logits). The drafter applies the same, so its trainable layers see exactly the
hidden state the target's layer 0 sees, and its logits are the ones the target's head would give:

* :func:`embed_rows`: table rows scaled as the target scales them, in the target's dtype (a bf16 target
  rounds the scale and the product in bf16), then cast to the drafter's dtype. A plain family is untouched.
* :func:`finish_logits_fp32` and :func:`logit_slope`: the logit transform for the loss (computed in fp32,
  where the loss's softmax runs) and its derivative, ``d final / d raw``, by which the chunked CE multiplies
  its gradient before the head's GEMM (:mod:`~dflash_ipc.drafter.loss.chunked_ce`).

Eval decodes through :meth:`~dflash_ipc.drafter.model.dflash_drafter.DFlashDrafter.compute_logits`, which finishes the
logits in their own dtype, as transformers does after its head.

The export (:func:`frozen_head_config`, :func:`scaled_table`) records what each serving engine reads to do the
same; what each engine does with it, after reading its loader's source, is in docs/EVAL.md:

* ``dflash_config.frozen_head``: the whole :class:`FrozenHead`, read back by dflash-ipc's own loader (eval).
* ``dflash_config.input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``: z-lab ``dflash``
  0.1.0's loop embeds the target's raw table rows times the first (``_raw_input_embeddings``) and its
  ``DFlashDraftModel.compute_logits`` multiplies the head's logits by the second and soft-caps them by the third;
  the export's own modeling class reads the same keys. The scale is the one the target multiplied by in training
  (Gemma's sqrt(hidden) rounded to the target's dtype first).
* ``logit_scale`` (top level) and the tensor ``embed_tokens.weight``: vLLM's ``DFlashQwen3ForCausalLM`` multiplies
  its logits by ``logit_scale`` (its ``LogitsProcessor``), and embeds with the target's raw embedding module unless
  the drafter carries a table of its own that differs from the target's: the scaled table, as the target scaled it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dflash_ipc.families.traits import FrozenHead

__all__ = [
    "EMBED_TENSOR",
    "carries_scaled_embeddings",
    "embed_rows",
    "finish_logits_fp32",
    "frozen_head_config",
    "frozen_head_from_config",
    "logit_slope",
    "scaled_table",
    "transforms_logits",
]

#: the scaled embedding table's name in an export (vLLM loads it as the drafter's own ``embed_tokens``)
EMBED_TENSOR = "embed_tokens.weight"
#: the key of ``dflash_config`` holding the whole frozen head, for dflash-ipc's own loader
FROZEN_HEAD_KEY = "frozen_head"
#: the export layouts vLLM reads (drafter/export/layout.py's CLIENTS)
_VLLM_LAYOUTS = ("all", "vllm")


def embed_rows(head: FrozenHead, rows: torch.Tensor, target_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of the embedding table as the target's layer 0 receives them, in ``out_dtype``: scaled in the
    target's own dtype first (``target_dtype``), where the family scales at all."""
    if head.embed_scale == 1.0:
        return rows.to(out_dtype)
    return head.scale_embeddings(rows.to(target_dtype)).to(out_dtype)


def transforms_logits(head: FrozenHead | None) -> bool:
    """Whether the target does anything to its logits after the head's matmul."""
    return head is not None and (head.logit_divisor != 1.0 or head.final_logit_softcap is not None)


def finish_logits_fp32(head: FrozenHead, raw: torch.Tensor) -> torch.Tensor:
    """The target's logits from the head's raw product ``raw``, in fp32, by the target's own operations
    (:meth:`FrozenHead.finish_logits`) done in place: ``raw`` (a GEMM's fresh output) is consumed."""
    x = raw.float()
    if head.logit_divisor != 1.0:
        x.div_(head.logit_divisor)
    if head.final_logit_softcap is not None:
        x.div_(head.final_logit_softcap).tanh_().mul_(head.final_logit_softcap)
    return x


def logit_slope(head: FrozenHead, finished: torch.Tensor) -> torch.Tensor | float:
    """``d finished / d raw`` elementwise, from the finished logits: ``1 / divisor`` times, under a soft-cap
    ``c``, ``1 - (finished / c)^2`` (tanh's derivative, from its output as autograd takes it). A float when
    it is the same for every logit."""
    inverse = 1.0 / head.logit_divisor
    if head.final_logit_softcap is None:
        return inverse
    return (finished / head.final_logit_softcap).square_().neg_().add_(1.0).mul_(inverse)


def scaled_table(head: FrozenHead, table: torch.Tensor, target_dtype: torch.dtype) -> torch.Tensor:
    """The whole embedding table as the target's layer 0 sees its rows (scaled in ``target_dtype``)."""
    return head.scale_embeddings(table.to(target_dtype))


def carries_scaled_embeddings(head: FrozenHead, client: str) -> bool:
    """Whether an export for ``client`` carries the scaled table: the layouts vLLM reads, for a family that scales."""
    return head.embed_scale != 1.0 and client in _VLLM_LAYOUTS


def input_embedding_scale(head: FrozenHead, target_dtype: torch.dtype) -> float:
    """The number that multiplies the raw table rows into what the target's layer 0 sees: Gemma's scale rounded
    to the target's dtype first (as its scaled embedding module rounds it), Granite's as it is."""
    if not head.embed_scale_in_dtype:
        return head.embed_scale
    return float(torch.tensor(head.embed_scale, dtype=target_dtype))


def frozen_head_config(head: FrozenHead, target_dtype: torch.dtype, client: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(keys for ``dflash_config``, keys for the top level) of an export's ``config.json`` (module docstring);
    none for a plain family, whose export stays as it was."""
    if head.is_plain:
        return {}, {}
    dflash: dict[str, Any] = {FROZEN_HEAD_KEY: head.to_dict()}
    top: dict[str, Any] = {}
    if head.embed_scale != 1.0:
        dflash["input_embedding_scale"] = input_embedding_scale(head, target_dtype)
    if head.logit_divisor != 1.0:
        dflash["output_multiplier"] = 1.0 / head.logit_divisor
        if client in _VLLM_LAYOUTS:
            top["logit_scale"] = 1.0 / head.logit_divisor
    if head.final_logit_softcap is not None:
        dflash["final_logit_softcapping"] = head.final_logit_softcap
    return dflash, top


def frozen_head_from_config(dflash_config: Mapping[str, Any]) -> FrozenHead:
    """The frozen head an export's ``dflash_config`` records (plain when it records none)."""
    d = dflash_config.get(FROZEN_HEAD_KEY) or {}
    softcap = d.get("final_logit_softcap")
    return FrozenHead(
        embed_scale=float(d.get("embed_scale", 1.0)),
        logit_divisor=float(d.get("logit_divisor", 1.0)),
        final_logit_softcap=None if softcap is None else float(softcap),
        embed_scale_in_dtype=bool(d.get("embed_scale_in_dtype", True)),
    )
