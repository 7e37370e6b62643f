"""``drafter.fp8_linears``: the drafter's trainable linear layers trained with FP8 matmuls, through torchao's
float8 training (``torchao.float8.convert_to_float8_training``, recipes "rowwise" and "tensorwise").

Each converted ``nn.Linear`` becomes torchao's ``Float8Linear``, a subclass of it that holds the very same weight
Parameter. Its forward casts the input and the weight to float8 with dynamic scales (per row, or one per tensor:
the recipe's) and multiplies them with ``torch._scaled_mm``; its backward does the same for the input and weight
gradients. Everything around it is unchanged: the trainer keeps the fp32 master weights, gradients and AdamW state
(:mod:`dflash_ipc.drafter.training.trainer`), the parameter names and the state_dict are a plain drafter's, so checkpoints,
resume and ``dflash-ipc export`` read and write what a drafter without FP8 does, and either loads into the other.

Which linears convert (:func:`skip_reason`): the trainable ones (the frozen embedding and LM head never: they are
the target's, and no ``nn.Linear`` here), whose widths are both multiples of 16 (``_scaled_mm``'s alignment), and,
unless told otherwise, large enough for FP8 to gain: torchao's own thresholds per recipe (its auto filter, from
its H100 tables of bf16 vs float8 forward+backward time by GEMM shape). Below them the casts to float8 and the
scaling cost more than the faster GEMM saves. At Qwen3-8B widths that keeps fc, q/o and the SwiGLU projections and
leaves k/v (1024 wide) in bf16.

The number of rows of a GEMM (tokens, anchors x block size) changes with every batch and is the inner dimension
of the weight-gradient GEMM: ``pad_inner_dim`` pads it to a multiple of 16 there (zeros add nothing to the sum).

Where it runs (:func:`fp8_linears_problem`): CUDA GPUs of compute capability >= 8.9 (FP8 tensor cores), and the
CPU, whose ``_scaled_mm`` gives the same FP8 numerics without any speed-up (the tests). The speed needs
``drafter.compile``: eager, each cast and scale is a kernel of its own.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_ipc.platform.e4m3 import fp8_device_problem

__all__ = [
    "INSTALL_HINT",
    "RECIPES",
    "Fp8Conversion",
    "convert_fp8_linears",
    "fp8_linear_names",
    "fp8_linears_problem",
    "skip_reason",
    "torchao_problem",
]

RECIPES = ("rowwise", "tensorwise")
INSTALL_HINT = "pip install 'dflash-ipc[fp8]' (or pip install torchao)"
_ALIGN = 16


def torchao_problem() -> str | None:
    """Why torchao's float8 training cannot be imported here, or None."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except ImportError as e:
        return f"torchao's float8 training is not importable here ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return None


def fp8_linears_problem(device: torch.device | str) -> str | None:
    """Why the drafter cannot train FP8 linears on ``device``: torchao missing, or a device without FP8 GEMMs
    (CUDA below compute capability 8.9, no CUDA at all). None where it can, the CPU included."""
    if problem := torchao_problem():
        return problem
    if torch.device(device).type == "cpu":
        return None
    return fp8_device_problem(device)


def _too_small(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's size thresholds for a float8 gain (``torchao.float8.float8_linear_utils._auto_filter_for_*``,
    from its H100 tables: https://github.com/pytorch/ao/tree/main/torchao/float8#performance)."""
    n, k = out_features, in_features
    if recipe == "rowwise":
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    return k <= 4096 and n <= 1024


def skip_reason(module: nn.Module, recipe: str, *, size_floor: bool = True) -> str | None:
    """Why ``module`` stays in high precision under ``recipe`` (None: it converts). ``size_floor``: leave the
    linears too small for FP8 to gain (module docstring); off, every aligned trainable linear converts."""
    if not isinstance(module, nn.Linear):
        return "not a linear layer"
    if not module.weight.requires_grad:
        return "frozen"
    n, k = module.out_features, module.in_features
    if n % _ALIGN or k % _ALIGN:
        return f"{n} x {k}: widths not multiples of {_ALIGN} (FP8 GEMM alignment)"
    if size_floor and _too_small(recipe, n, k):
        return f"{n} x {k}: too small for FP8 to gain ({recipe})"
    return None


@dataclass
class Fp8Conversion:
    """What :func:`convert_fp8_linears` did: the converted linears and, for the others, why not (by module name)."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the drafter's log: how many converted, which kinds, and why the rest did not."""
        total = len(self.converted) + len(self.kept)
        kinds = sorted({name.rsplit(".", 1)[-1] for name in self.converted})
        line = f"drafter.fp8_linears = {self.recipe!r}: {len(self.converted)} of {total} linear layers train in FP8 (torchao Float8Linear)"
        if kinds:
            line += f": {', '.join(kinds)}"
        why: dict[str, list[str]] = defaultdict(list)
        for name, reason in self.kept.items():
            why[reason].append(name.rsplit(".", 1)[-1])
        if why:
            kept = "; ".join(f"{', '.join(sorted(set(names)))} x{len(names)} ({reason})" for reason, names in why.items())
            line += f"; kept in high precision: {kept}"
        return line


def _float8_config(recipe: str):
    from torchao.float8 import Float8LinearConfig

    # pad_inner_dim: the weight gradient's inner dimension is the batch's row count, a multiple of 16 only by chance
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)


def convert_fp8_linears(model: nn.Module, recipe: str, *, size_floor: bool = True) -> Fp8Conversion:
    """Swap ``model``'s trainable linears for torchao's ``Float8Linear`` under ``recipe`` (in place; the weights
    are the same Parameters). Before ``torch.compile`` traces the model and before the trainer takes its
    parameters. Raises ValueError where it cannot run (:func:`fp8_linears_problem`) or for an unknown recipe."""
    if recipe not in RECIPES:
        raise ValueError(f"drafter.fp8_linears: unknown recipe {recipe!r}; use one of {', '.join(map(repr, RECIPES))}")
    device = next(model.parameters()).device
    problem = torchao_problem() if device.type == "meta" else fp8_linears_problem(device)  # meta: a shape, no GEMM
    if problem:
        raise ValueError(f'drafter.fp8_linears = "{recipe}": {problem}; or set drafter.fp8_linears = "none"')
    from torchao.float8 import convert_to_float8_training

    result = Fp8Conversion(recipe)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            reason = skip_reason(module, recipe, size_floor=size_floor)
            if reason is None:
                result.converted.append(name)
            else:
                result.kept[name] = reason
    chosen = set(result.converted)
    if chosen:
        convert_to_float8_training(model, module_filter_fn=lambda _module, fqn: fqn in chosen, config=_float8_config(recipe))
    return result


def fp8_linear_names(model: nn.Module) -> list[str]:
    """The linears of ``model`` that train in FP8: torchao's float8 subclass of ``nn.Linear`` (not public API, so
    known by its module) in place of a plain one."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and type(m).__module__.startswith("torchao.float8")]
