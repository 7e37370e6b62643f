"""Whether a drafter is worth serving: the τ a run's drafter reached, and the plain verdict printed beside it.

    drafter 0 at a checkpoint and at the end of a run
      held-out τ measured (training.holdout_every)? ── yes ─▶ DrafterTau(tau_holdout, "held-out", its step)
                                                   └─ no ──▶ DrafterTau(training τ of the last steps, "training", step)
    ─▶ checkpoint meta (extra.drafter_tau) · DrafterSummary · status.json · the export's config.json
    ─▶ `up`'s summary, `export` and `status`: the line, and below WORTH_SERVING_TAU the warning

τ is tokens per verification step: 1.0 is plain decoding, and a drafter's own forward costs time, so a drafter
under ~1.1 makes decoding slower, not faster. Training τ is counted like eval's on training batches: it
overstates held-out τ, never understates a drafter that learned nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dflash_ipc.control.wire import Struct

#: under this τ the drafter's own cost outweighs what it saves: decoding gets slower
WORTH_SERVING_TAU = 1.1
NOT_WORTH_SERVING = "this drafter will not speed up decoding; train longer or on more data"
MEASURED_ON = ("held-out", "training")
#: how many of the last training steps a training τ pools (their blocks, as eval pools prompts)
TRAINING_TAU_STEPS = 16


@dataclass(frozen=True)
class DrafterTau(Struct):
    """The τ a drafter reached: held-out τ (eval's decode replayed on held-out answers) when the run measured one,
    else training τ of its last steps; ``step``: the weights it was measured on."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"tau", "step"})
    tau: float
    measured_on: str  # one of MEASURED_ON
    step: int

    def __post_init__(self) -> None:
        if self.measured_on not in MEASURED_ON:
            raise ValueError(f"measured_on must be one of {MEASURED_ON} (got {self.measured_on!r})")

    @property
    def worth_serving(self) -> bool:
        return self.tau >= WORTH_SERVING_TAU

    def figure(self) -> str:
        """The figure and what it was measured on."""
        if self.measured_on == "held-out":
            return f"held-out tau {self.tau:.2f} at step {self.step}"
        return f"training tau {self.tau:.2f} at step {self.step} (no held-out tau measured)"  # it overstates held-out tau

    def describe(self) -> str:
        """:meth:`figure`, and the warning when it is under WORTH_SERVING_TAU."""
        return self.figure() if self.worth_serving else f"{self.figure()}: warning: {NOT_WORTH_SERVING}"

    def metadata(self) -> dict:
        """The export's ``config.json`` entry (serving loaders ignore it)."""
        return {"tau": self.tau, "measured_on": self.measured_on, "step": self.step, "worth_serving": self.worth_serving}


def drafter_tau(holdout: dict, recent_training: list[tuple[float, float]], step: int) -> DrafterTau | None:
    """The τ to judge a drafter by: ``holdout`` (the last held-out pass's metrics record) when it has one, else the
    training τ pooled over ``recent_training`` ((accepted tokens, blocks) of the last steps); None before any."""
    if holdout.get("tau_holdout") is not None:
        return DrafterTau(float(holdout["tau_holdout"]), "held-out", int(holdout.get("holdout_step") or 0))
    blocks = sum(b for _, b in recent_training)
    if blocks <= 0:
        return None
    return DrafterTau(round(sum(a for a, _ in recent_training) / blocks, 4), "training", step)
