"""The data error every loader raises (its own module, so corpus loaders and the built-in corpus share it)."""


class DataError(ValueError):
    """A data problem, phrased as ``FILE:LINE: reason`` (or ``FILE: reason``)."""
