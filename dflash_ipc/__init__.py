"""dflash-ipc: train DFlash speculative-decoding drafters at the speed of the target model."""

__version__ = "0.1.0"
