"""How the drafter trains: the data-parallel optimizer step (``trainer``) over its process group
(``distributed``) and learning-rate schedule (``schedule``, fitted to a wall-clock budget by
``time_budget``), how many anchors a batch trains on (``anchor_budget``, ``memory_plan``), held-out τ
(``holdout``), whether a run learned anything (``learning``) and its record per step (``metrics_log``)."""
