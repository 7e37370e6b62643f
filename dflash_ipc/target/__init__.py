"""Target role: the frozen model with hidden-state capture, packing into slots, the target's pure core."""
