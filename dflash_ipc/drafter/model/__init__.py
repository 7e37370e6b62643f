"""The drafter network and how one is built: the DFlash decoder (``dflash_drafter``), its blockwise attention,
the target's frozen embedding and head as the drafter computes them (``frozen_head``, ``fp8_head``), FP8
training of its linears (``fp8_linears``), its start from the target's weights (``init_from_target``) and the
one place a run's drafter is assembled from the config (``build``)."""
