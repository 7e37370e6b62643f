"""--max-restarts: run the group again from the last checkpoint after a failure, every node together.

One node's attempts (``run_with_restarts``)::

    ATTEMPT g: the supervisor runs its group (resume from the shared checkpoint when g > 0)
      │ finished ─▶ tell the node group (done/<node>) ─▶ exit 0
      ▼ GroupFailed (here, or told by another node under g<g>/fail/<node>)
    torn down ─▶ report g<g>/fail/<node> ─▶ VOTE: restart if restarts are left and no stop was asked
      │ agree_restart: every node's vote, first decision written wins (see runtime.nodes)
      │ "stop: ..." ─▶ exit 1
      ▼ "restart"
    a new run id (shared memory of the attempt is swept), generation g+1 ─▶ ATTEMPT g+1

A single node agrees with itself at once. Nodes restart only after every node has voted, that is
after every node's teardown: no drafter of attempt g is alive when attempt g+1 rendezvouses on the
same MASTER_PORT, and the checkpoint every node resumes from is the one rank 0 wrote last.
"""

from __future__ import annotations

from collections.abc import Callable


class GroupFailed(RuntimeError):
    pass


def run_with_restarts(
    attempt: Callable[[bool], int],
    group,
    *,
    resume: bool,
    max_restarts: int,
    stop_requested: Callable[[], str],
    on_failed: Callable[[], None],
    on_restart: Callable[[], None],
    vote_timeout_s: float,
    echo=print,
) -> int:
    """``attempt(resume)`` until it returns, at most ``max_restarts`` times again after a GroupFailed;
    ``group``: the NodeGroup (or SingleNode) that every node's restart is agreed through."""
    restarts = 0
    multi = getattr(group, "spec", None) is not None
    label = f"{group.spec.label()}: " if multi else ""
    while True:
        try:
            code = attempt(resume)
            group.finish()
            return code
        except GroupFailed as e:
            on_failed()
            echo(f"[up] FAILED: {group.report_failure(str(e))}")
            want = restarts < max_restarts and not stop_requested()
            restart, why = group.agree_restart(want, vote_timeout_s)
            if not restart:
                if multi and want:
                    echo(f"[up] {label}no restart: {why}")
                return 1
            restarts += 1
            generation = group.begin_generation()
            together = f", every node together (generation {generation})" if multi else ""
            echo(f"[up] {label}restarting the group from the last checkpoint ({restarts}/{max_restarts}){together}")
            resume = True
            on_restart()
