"""The batch ledger: the ids of every batch whose gradient is inside a checkpoint's weights.

A leaf both roles use: drafters write it with each checkpoint (``drafter/checkpoint/store.py``);
targets read it on resume and skip exactly those batches, so no consumed batch repeats and
none is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dflash_ipc.rundir import bounded_json

LEDGER_FORMAT = "dflash-ipc-ledger/1"
LEDGER_FILE = "ledger.json"

BatchId = tuple[int, ...]


class BatchLedger:
    """The set of batch ids consumed by optimizer steps; an id is a tuple of ints."""

    def __init__(self, ids: Iterable[Sequence[int]] = ()):
        self._ids: set[BatchId] = set()
        self.add(ids)

    @staticmethod
    def _norm(bid: Sequence[int]) -> BatchId:
        t = tuple(int(x) for x in bid)
        if not t:
            raise ValueError("a batch id must have at least one integer")
        return t

    def add(self, ids: Iterable[Sequence[int]]) -> None:
        for bid in ids:
            self._ids.add(self._norm(bid))

    def add_one(self, bid: Sequence[int]) -> None:
        self._ids.add(self._norm(bid))

    def merge(self, other: BatchLedger | Iterable[Sequence[int]]) -> BatchLedger:
        if isinstance(other, BatchLedger):
            self._ids |= other._ids
        else:
            self.add(other)
        return self

    def __contains__(self, bid: object) -> bool:
        try:
            return tuple(int(x) for x in bid) in self._ids  # type: ignore[union-attr]
        except (TypeError, ValueError):
            return False

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self):
        return iter(sorted(self._ids))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchLedger) and self._ids == other._ids

    def __repr__(self) -> str:
        return f"BatchLedger({len(self._ids)} ids)"

    def copy(self) -> BatchLedger:
        out = BatchLedger()
        out._ids = set(self._ids)
        return out

    def to_wire(self) -> dict[str, Any]:
        """Plain JSON/msgpack-friendly form: {"format": ..., "ids": [[int, ...], ...]} (sorted)."""
        return {"format": LEDGER_FORMAT, "ids": [list(t) for t in sorted(self._ids)]}

    @classmethod
    def from_wire(cls, wire: dict[str, Any] | list) -> BatchLedger:
        if isinstance(wire, dict):
            fmt = wire.get("format")
            if fmt != LEDGER_FORMAT:
                raise ValueError(f"unsupported ledger format {fmt!r} (expected {LEDGER_FORMAT})")
            ids = wire.get("ids")
        else:
            ids = wire
        if not isinstance(ids, list):
            raise ValueError("ledger wire form needs a list of ids")
        return cls(ids)


def read_ledger(checkpoint_dir: str | Path | None) -> BatchLedger:
    """The ledger of a checkpoint directory (none: an empty ledger, a fresh run)."""
    if not checkpoint_dir:
        return BatchLedger()
    return BatchLedger.from_wire(bounded_json.read(Path(checkpoint_dir) / LEDGER_FILE))
