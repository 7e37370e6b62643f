"""Drafter role: the DFlash drafter model, its loss, the data-parallel trainer, checkpoints, export, the drafter's pure core."""
