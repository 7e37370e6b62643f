"""Slot layout: how one batch of hidden states sits inside one fixed-size ring slot.

A slot is a flat byte range. Its regions, each aligned to 256 bytes::

    planes     k * T_cap * H  x plane dtype   per-layer planes, used prefix [k, n, H] contiguous
    token_ids  T_cap          x int64
    loss_mask  T_cap          x uint8
    seq_lens   S_cap          x int32         lengths of the documents packed in the batch

``n`` (real tokens in this batch) and the number of documents travel in the SlotReady
message, so the consumer copies exactly the used prefix of each region: planes for the
batch are ``flat[: k*n*H].view(k, n, H)``, one contiguous range, so a cross-device copy is a
single copy-engine transfer. There is never padding in a slot: the target strips it.

The layout is a pure function of (k, H, T_cap, S_cap, dtype); it travels in the ring
descriptor as a :class:`~dflash_ipc.control.ring_descriptor.SlotLayoutWire` (:meth:`SlotLayout.to_wire`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dflash_ipc.control.ring_descriptor import SlotLayoutWire
from dflash_ipc.platform.devices import dtype_from_name

ALIGN = 256
# Used ranges closer than this are copied as one range (the gap's bytes are copied too; they are
# unused on both sides). One more copy costs more than copying a megabyte over NVLink.
COALESCE_GAP = 1 << 20


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SlotLayout:
    num_planes: int
    hidden_size: int
    max_tokens: int
    max_seqs: int
    plane_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_planes", "hidden_size", "max_tokens", "max_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"SlotLayout.{name} must be >= 1")
        dtype_from_name(self.plane_dtype)

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_name(self.plane_dtype)

    @property
    def planes_bytes(self) -> int:
        return self.num_planes * self.max_tokens * self.hidden_size * self.dtype.itemsize

    @property
    def offsets(self) -> dict[str, int]:
        off = {}
        pos = 0
        off["planes"] = pos
        pos += _align(self.planes_bytes)
        off["token_ids"] = pos
        pos += _align(self.max_tokens * 8)
        off["loss_mask"] = pos
        pos += _align(self.max_tokens)
        off["seq_lens"] = pos
        pos += _align(self.max_seqs * 4)
        off["end"] = pos
        return off

    @property
    def slot_bytes(self) -> int:
        return self.offsets["end"]

    def check_counts(self, n_tokens: int, n_seqs: int) -> None:
        if not (0 <= n_tokens <= self.max_tokens):
            raise ValueError(f"n_tokens {n_tokens} outside slot capacity {self.max_tokens}")
        if not (0 <= n_seqs <= self.max_seqs):
            raise ValueError(f"n_seqs {n_seqs} outside slot capacity {self.max_seqs}")

    def views(self, slot: torch.Tensor, n_tokens: int, n_seqs: int) -> SlotViews:
        """Typed views of the used prefix of one slot (a 1-D uint8 tensor of slot_bytes)."""
        self.check_counts(n_tokens, n_seqs)
        off = self.offsets
        k, h = self.num_planes, self.hidden_size
        pb = k * n_tokens * h * self.dtype.itemsize
        planes = slot[off["planes"] : off["planes"] + pb].view(self.dtype).view(k, n_tokens, h)
        token_ids = slot[off["token_ids"] : off["token_ids"] + 8 * n_tokens].view(torch.int64)
        loss_mask = slot[off["loss_mask"] : off["loss_mask"] + n_tokens]
        seq_lens = slot[off["seq_lens"] : off["seq_lens"] + 4 * n_seqs].view(torch.int32)
        return SlotViews(planes=planes, token_ids=token_ids, loss_mask=loss_mask, seq_lens=seq_lens)

    def used_ranges(self, n_tokens: int, n_seqs: int) -> list[tuple[int, int]]:
        """(offset, nbytes) of each used region: what a consumer must copy out."""
        off = self.offsets
        return [
            (off["planes"], self.num_planes * n_tokens * self.hidden_size * self.dtype.itemsize),
            (off["token_ids"], 8 * n_tokens),
            (off["loss_mask"], n_tokens),
            (off["seq_lens"], 4 * n_seqs),
        ]

    def copy_used(self, dst: torch.Tensor, src: torch.Tensor, n_tokens: int, n_seqs: int, *, non_blocking: bool = False) -> None:
        """Copy the used ranges of one slot from ``src`` to ``dst`` (flat uint8, same offsets), nearby
        ranges coalesced. The one copy loop of every ring: the caller picks the stream."""
        self.check_counts(n_tokens, n_seqs)
        for off, nbytes in coalesce(self.used_ranges(n_tokens, n_seqs)):
            dst[off : off + nbytes].copy_(src[off : off + nbytes], non_blocking=non_blocking)

    def to_wire(self) -> SlotLayoutWire:
        return SlotLayoutWire(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SlotLayoutWire)})

    @classmethod
    def from_wire(cls, wire: SlotLayoutWire) -> SlotLayout:
        return cls(**{f.name: getattr(wire, f.name) for f in dataclasses.fields(SlotLayoutWire)})


@dataclass
class SlotViews:
    """Typed views of one batch inside a slot (or inside a consumer's local copy)."""

    planes: torch.Tensor  # [k, n, H] plane dtype
    token_ids: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] uint8 (1 = supervised)
    seq_lens: torch.Tensor  # [b] int32, sum == n


def coalesce(ranges: Iterable[tuple[int, int]], max_gap: int = COALESCE_GAP) -> list[tuple[int, int]]:
    """Drop empty ranges and merge ranges (sorted by offset) separated by at most max_gap bytes."""
    out: list[tuple[int, int]] = []
    for off, nbytes in ranges:
        if nbytes <= 0:
            continue
        if out and off - (out[-1][0] + out[-1][1]) <= max_gap:
            start = out[-1][0]
            out[-1] = (start, max(out[-1][0] + out[-1][1], off + nbytes) - start)
        else:
            out.append((off, nbytes))
    return out
