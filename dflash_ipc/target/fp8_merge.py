"""Sibling FP8 linears merged: one input quantization and one GEMM where a module's forward
projects one input several times (vLLM's merged QKV / gate-up, done at build time on the frozen
modules, with the transformers forwards left as they are).

A Qwen3.5 attention layer calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden states,
its MLP ``gate_proj`` and ``up_proj``, its GatedDeltaNet ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b`` and ``in_proj_a``; as separate :class:`~dflash_ipc.target.fp8.Fp8Linear` each would
quantize that input again and run its own (for b and a, tiny) GEMM. :func:`merge_sibling_linears`
concatenates each group's FP8 weight rows and their per-row scales (exactly: row scales are per
row) into one :class:`MergedFp8Linear` registered on the parent (``qkv_proj``, ``gate_up_proj``,
``in_proj_merged``) and puts a :class:`Fp8LinearSlice` in each sibling's place; the slice returns
its columns of the merged product. Which siblings share an input is read from each family's
forward code, so the groups are listed per module class (:data:`SIBLING_GROUPS`); a group merges
only the siblings that are already FP8 (a width that is not a multiple of 16 keeps its bf16
GEMM, so merging changes no number), and only when two or more are.

Sharing is scoped to one call of the parent module (hooks on the parent open and close it, the
close runs even when the forward raises). Per group, per parent call::

    CLOSED --parent forward starts--> OPEN --first sibling call, input x--> SHARED(x)
      ^                                 |                                     | every sibling has
      |                                 |                                     | taken its slice
      +------ parent forward ends ------+------------- SPENT <----------------+
              (from any state: the product and x are dropped)

* In SHARED(x), a sibling called with the very tensor object ``x`` (and, for a tensor that
  tracks one, the same version counter: not modified in place since), that has not yet taken
  its slice, gets its columns of the product (a view; each sibling's columns are disjoint from
  the others', so no two callers share an element). Any other call (another tensor, ``x``
  modified in place, the same sibling a second time) computes that sibling's own rows alone:
  its own quantization of its input and a GEMM over its weight rows, the unmerged result.
* In OPEN, the first sibling call computes the merged product for its input and moves to
  SHARED; in SPENT, CLOSED, or outside any parent forward (a sibling called directly), every
  call computes its own rows.
* The product is held only while some sibling may still take it: dropped when the last one
  has, and at the end of the parent's forward whatever happened. Nothing survives the call.

So a stale product cannot be returned as long as a tensor's content does not change without
its version counter moving: true of every PyTorch op, and of the inference tensors the target
captures in (they carry no version counter) by the forwards listed here, which never write
their input in place between the sibling calls. The siblings' order does not matter; a sibling
never called wastes only its share of the merged GEMM. Per parent call the sharing costs a
Python identity check; one forward at a time per module, as the target runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_ipc.target.fp8 import Fp8Linear

__all__ = ["SIBLING_GROUPS", "Fp8LinearSlice", "MergedFp8Linear", "merge_sibling_linears", "unmerge_sibling_linears"]

_ATTENTION = (("qkv_proj", ("q_proj", "k_proj", "v_proj")),)
_MLP = (("gate_up_proj", ("gate_proj", "up_proj")),)

#: Per module class name: (merged attribute, sibling attributes its forward calls on one input tensor).
SIBLING_GROUPS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    # q_proj also carries the output gate (its rows interleave query and gate per head): it stays whole.
    # Qwen3.5-MoE's modules are Qwen3.5's under another name (its MLP: the shared expert).
    **{f"{family}Attention": _ATTENTION for family in ("Qwen3_5", "Qwen3_5Moe", "Qwen3Next")},
    **{f"{family}MLP": _MLP for family in ("Qwen3_5", "Qwen3_5Moe", "Qwen3Next")},
    **{
        f"{family}GatedDeltaNet": (("in_proj_merged", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),)
        for family in ("Qwen3_5", "Qwen3_5Moe")
    },
    "Qwen3NextGatedDeltaNet": (("in_proj_merged", ("in_proj_qkvz", "in_proj_ba")),),
    **{f"{family}Attention": _ATTENTION for family in ("Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Qwen3Moe")},
    **{f"{family}MLP": _MLP for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe")},
}


@dataclass(slots=True)
class _Shared:
    """The merged product of one input, while some sibling may still take its slice."""

    x: torch.Tensor
    version: int | None
    out: torch.Tensor
    taken: list[bool]


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version


class MergedFp8Linear(Fp8Linear):
    """One FP8 GEMM over sibling linears' concatenated weight rows; hands each sibling its columns
    (see the module docstring for when, and the state machine)."""

    def __init__(self, names: list[str], members: list[Fp8Linear]):
        nn.Module.__init__(self)
        bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
        weight = torch.cat([m.weight_fp8 for m in members])
        scale = torch.cat([m.weight_scale for m in members], dim=1)
        self._set_parts(weight, scale, bias, members[0].out_dtype, members[0]._quantize)
        self.names = tuple(names)
        starts = [0]
        for m in members:
            starts.append(starts[-1] + m.out_features)
        self.rows = tuple(slice(a, b) for a, b in zip(starts, starts[1:]))
        self._scope_open = False  # OPEN: inside the parent's forward, no product yet
        self._shared: _Shared | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, parent: nn.Module) -> None:
        """Scope the sharing to each call of ``parent``."""
        self._hooks = [
            parent.register_forward_pre_hook(lambda _mod, _args: self._open()),
            parent.register_forward_hook(lambda _mod, _args, _out: self._close(), always_call=True),
        ]

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._close()

    def _open(self) -> None:
        self._shared = None
        self._scope_open = True

    def _close(self) -> None:
        self._shared = None
        self._scope_open = False

    def member_output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``i``'s output for input ``x``."""
        rows = self.rows[i]
        shared = self._shared
        if shared is not None and shared.x is x and not shared.taken[i] and shared.version == _version(x):
            shared.taken[i] = True
            if all(shared.taken):
                self._shared = None  # SPENT
            return shared.out[..., rows]
        if self._scope_open:
            self._scope_open = False
            out = self(x)
            self._shared = _Shared(x, _version(x), out, [j == i for j in range(len(self.rows))])
            return out[..., rows]
        return self.matmul_quantized(*self.quantize_input(x), rows=rows)

    def member_linear(self, i: int) -> Fp8Linear:
        """Sibling ``i`` as its own :class:`Fp8Linear` again (a copy of its rows)."""
        rows = self.rows[i]
        bias = None if self.bias is None else self.bias[rows].clone()
        return Fp8Linear.from_parts(
            self.weight_fp8[rows].clone(), self.weight_scale[:, rows].contiguous(), bias, self.out_dtype, self._quantize
        )

    def extra_repr(self) -> str:
        widths = ", ".join(f"{n}={r.stop - r.start}" for n, r in zip(self.names, self.rows))
        return f"{super().extra_repr()}; merged rows: {widths}"


class Fp8LinearSlice(nn.Module):
    """In a merged sibling's place: its columns of the group's product (:class:`MergedFp8Linear`)."""

    def __init__(self, merged: MergedFp8Linear, index: int):
        super().__init__()
        self._merged = (merged,)  # not a submodule: the parent owns the merged module, once
        self.index = index
        self.in_features = merged.in_features
        self.out_features = merged.rows[index].stop - merged.rows[index].start

    @property
    def merged(self) -> MergedFp8Linear:
        return self._merged[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._merged[0].member_output(self.index, x)

    def extra_repr(self) -> str:
        rows = self.merged.rows[self.index]
        return f"in_features={self.in_features}, out_features={self.out_features}, rows {rows.start}:{rows.stop} of a merged FP8 GEMM"


def _mergeable(members: list[Fp8Linear]) -> bool:
    first = members[0]
    return all(
        m.in_features == first.in_features
        and m.out_dtype == first.out_dtype
        and (m.bias is None) == (first.bias is None)
        and m.weight_fp8.device == first.weight_fp8.device
        for m in members
    )


def merge_sibling_linears(stack: nn.Module) -> dict[str, int]:
    """Merge every group of :data:`SIBLING_GROUPS` under ``stack`` whose siblings are (two or more)
    :class:`Fp8Linear`, in place (see the module docstring). Returns counts: merged ``groups``, the
    ``linears`` they replaced, and the input quantizations saved per call of all the parents
    (``quantizations_saved``: linears - groups)."""
    counts = {"groups": 0, "linears": 0, "quantizations_saved": 0}
    for parent in list(stack.modules()):
        for merged_name, names in SIBLING_GROUPS.get(type(parent).__name__, ()):
            eligible = [n for n in names if type(getattr(parent, n, None)) is Fp8Linear]
            members = [getattr(parent, n) for n in eligible]
            if len(members) < 2 or not _mergeable(members):
                continue
            if hasattr(parent, merged_name):
                raise ValueError(f"{type(parent).__name__} already has a {merged_name!r}: cannot merge {eligible} under that name")
            merged = MergedFp8Linear(eligible, members)
            parent.add_module(merged_name, merged)
            for i, name in enumerate(eligible):
                setattr(parent, name, Fp8LinearSlice(merged, i))  # the member's own buffers go with it
            merged.attach(parent)
            counts["groups"] += 1
            counts["linears"] += len(members)
            counts["quantizations_saved"] += len(members) - 1
    return counts


def unmerge_sibling_linears(stack: nn.Module) -> int:
    """Undo :func:`merge_sibling_linears`: each sibling its own :class:`Fp8Linear` again, the merged
    modules and their hooks gone. Returns how many groups were split."""
    n = 0
    for parent in list(stack.modules()):
        for merged_name, merged in list(parent.named_children()):
            if not isinstance(merged, MergedFp8Linear):
                continue
            merged.detach()
            for i, name in enumerate(merged.names):
                setattr(parent, name, merged.member_linear(i))
            delattr(parent, merged_name)
            n += 1
    return n
