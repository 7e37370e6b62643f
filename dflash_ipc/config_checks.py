"""Checks of single config values: device names, host names, and what is installed (libzmq's CURVE, TensorBoard)."""

from __future__ import annotations

import ipaddress
import re

__all__ = ["tensorboard_installed", "valid_device", "valid_host", "zmq_has_curve"]


def valid_host(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", host) is not None


def zmq_has_curve() -> bool:
    import zmq

    return bool(zmq.has("curve"))


def tensorboard_installed() -> bool:
    # Imported, not just found: torch.utils.tensorboard needs a tensorboard that imports.
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def valid_device(dev: str) -> bool:
    if dev == "cpu":
        return True
    if dev.startswith("cuda:"):
        return dev[5:].isdigit()
    return False
