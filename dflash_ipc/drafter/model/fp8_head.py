"""The frozen LM head in e4m3 for the chunked CE's two GEMMs (``training.ce_fp8``).

The drafter never trains its head, so it is quantized once per model (:meth:`DFlashDrafter.fp8_head
<dflash_ipc.drafter.model.dflash_drafter.DFlashDrafter.fp8_head>`), into two copies, each scaled along the dimension its
GEMM reduces (``torch._scaled_mm``'s row-wise scales lie on the product's outer dimensions,
:mod:`dflash_ipc.platform.e4m3`):

* ``logits = X @ W^T``: ``W`` [V, H] row-major, one fp32 scale per vocabulary row; its ``.t()`` is the
  column-major [H, V] operand;
* ``dX = dlogits @ W``: ``W^T`` [H, V] row-major, one scale per hidden column; its ``.t()`` is the
  column-major [V, H] operand.

Each chunk's rows (hidden states, the logits' gradient) come quantized per row
(:mod:`dflash_ipc.drafter.loss.chunked_ce`). Widths that are not multiples of :data:`~dflash_ipc.platform.e4m3.ALIGN`
are padded with zeros (a zero row or column adds nothing to a product) and the outputs sliced back.

Not state: the copies are derived from the frozen head, so no ``state_dict``, checkpoint or export holds
them (a plain attribute of the model, neither parameter nor buffer). Two e4m3 copies: ``2 V H`` bytes
(0.6 GB each at Qwen3-8B's 151,936 x 4,096).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ipc.platform.e4m3 import ALIGN, E4M3, quantize_rows

__all__ = ["Fp8Head", "fp8_head_bytes", "pad_columns"]

#: rows quantized at a time when the copies are made (bounds the fp32 transients: 256 x 248,320 x 4 B = 254 MB)
_BLOCK_ROWS = 256


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` [M, n] with zero columns up to ``width`` (itself when it is that wide)."""
    return x if x.shape[1] == width else F.pad(x, (0, width - x.shape[1]))


def fp8_head_bytes(rows: int, hidden: int) -> int:
    """Bytes of the two e4m3 copies of a [rows, hidden] head, scales included."""
    r, h = _aligned(rows), _aligned(hidden)
    return 2 * r * h + 4 * (r + h)


def _quantize_blocks(w: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of ``w`` [R, C] (any strides), ``_BLOCK_ROWS`` rows at a time, into
    ([aligned R, width] e4m3, [1, aligned R] fp32): zero padding, unit scales on the padded rows."""
    rows, cols = w.shape
    q = torch.zeros(_aligned(rows), width, dtype=E4M3, device=w.device)
    scale = torch.ones(1, _aligned(rows), dtype=torch.float32, device=w.device)
    for s in range(0, rows, _BLOCK_ROWS):
        e = min(rows, s + _BLOCK_ROWS)
        bq, bs = quantize_rows(w[s:e])
        q[s:e, :cols] = bq
        scale[0, s:e] = bs[:, 0]
    return q, scale


@dataclass(frozen=True)
class Fp8Head:
    """The two e4m3 copies of a frozen head ``[rows, hidden]`` (module docstring)."""

    weight: torch.Tensor  # [aligned rows, aligned hidden] e4m3, row-major
    weight_scale: torch.Tensor  # [1, aligned rows] fp32
    weight_t: torch.Tensor  # [aligned hidden, aligned rows] e4m3, row-major
    weight_t_scale: torch.Tensor  # [1, aligned hidden] fp32
    rows: int
    hidden: int
    source: tuple  # (device, data_ptr, shape) of the head it was made from

    @classmethod
    def quantize(cls, head: torch.Tensor) -> Fp8Head:
        """Both copies of ``head`` [rows, hidden] (a frozen weight, any float dtype)."""
        head = head.detach()
        rows, hidden = head.shape
        w, ws = _quantize_blocks(head, _aligned(hidden))
        wt, wts = _quantize_blocks(head.t(), _aligned(rows))
        return cls(w, ws, wt, wts, rows, hidden, cls._source_of(head))

    @staticmethod
    def _source_of(head: torch.Tensor) -> tuple:
        return (head.device, head.data_ptr(), tuple(head.shape))

    def made_from(self, head: torch.Tensor) -> bool:
        """These copies are of ``head`` as it is now placed (a head moved or replaced needs new ones)."""
        return self.source == self._source_of(head.detach())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale, self.weight_t, self.weight_t_scale))

    @property
    def padded_hidden(self) -> int:
        return self.weight.shape[1]

    @property
    def padded_rows(self) -> int:
        return self.weight_t.shape[1]

    def logits(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """``X @ W^T`` [M, rows] bf16 from ``X`` quantized per row (``xq`` [M, aligned hidden] e4m3, ``xs`` [M, 1])."""
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale, out_dtype=torch.bfloat16)
        return y if self.padded_rows == self.rows else y[:, : self.rows]

    def input_grad(self, gq: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
        """``G @ W`` [M, hidden] bf16 from ``G`` quantized per row (``gq`` [M, aligned rows] e4m3, ``gs`` [M, 1])."""
        y = torch._scaled_mm(gq, self.weight_t.t(), scale_a=gs, scale_b=self.weight_t_scale, out_dtype=torch.bfloat16)
        return y if self.padded_hidden == self.hidden else y[:, : self.hidden]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both copies as the GEMMs see them, fp32 [rows, hidden] (for error figures and tests)."""
        w = (self.weight.float() * self.weight_scale.t())[: self.rows, : self.hidden]
        wt = (self.weight_t.float() * self.weight_t_scale.t())[: self.hidden, : self.rows]
        return w, wt.t()
