"""``[topology]``: which device each process runs on, one OS process per entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_ipc.config.fields import require

__all__ = ["TopologyConfig", "valid_device"]


def valid_device(dev: str) -> bool:
    """``"cpu"`` or ``"cuda:N"`` (whether device N exists is the preflight's check)."""
    if dev == "cpu":
        return True
    if dev.startswith("cuda:"):
        return dev[5:].isdigit()
    return False


@dataclass
class TopologyConfig:
    """Which device each process runs on: one OS process per entry."""

    targets: list[str] = field(default_factory=lambda: ["cpu"])
    """One target process per entry ("cpu" or "cuda:N"), each running the frozen model on its share of the batches."""
    drafters: list[str] = field(default_factory=lambda: ["cpu"])
    """One drafter process per entry ("cpu" or "cuda:N"), data-parallel; with nccl one GPU per drafter."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend among the drafters; "auto": nccl on CUDA, gloo on the CPU."""

    def __post_init__(self) -> None:
        require(len(self.targets) >= 1, "targets", 'needs at least one target device, e.g. ["cuda:0"]')
        require(len(self.drafters) >= 1, "drafters", 'needs at least one drafter device, e.g. ["cuda:1"]')
        for name, devs in (("targets", self.targets), ("drafters", self.drafters)):
            for i, dev in enumerate(devs):
                require(valid_device(dev), f"{name}[{i}]", f'{dev!r} is not a device; use "cpu" or "cuda:N"')
        uses_cuda = any(d.startswith("cuda") for d in self.targets + self.drafters)
        require(
            not (self.dist_backend == "nccl" and any(d == "cpu" for d in self.drafters)),
            "dist_backend",
            'nccl needs every drafter on a cuda device; use "gloo" or "auto"',
        )
        require(
            not (uses_cuda and any(d == "cpu" for d in self.targets + self.drafters)),
            "targets",
            "mixing cpu and cuda processes in one run is not supported; put all on cuda or all on cpu",
        )
        if self.resolved_dist_backend() == "nccl":
            seen: dict[int, int] = {}
            for i, dev in enumerate(self.drafters):
                index = int(dev[5:])
                require(
                    index not in seen,
                    f"drafters[{i}]",
                    f"{dev!r} is already drafters[{seen.get(index)}]: NCCL needs one GPU per drafter; give each drafter its own device",
                )
                seen[index] = i

    @property
    def on_cuda(self) -> bool:
        return self.targets[0].startswith("cuda")

    def resolved_dist_backend(self) -> str:
        if self.dist_backend != "auto":
            return self.dist_backend
        return "nccl" if self.on_cuda else "gloo"
