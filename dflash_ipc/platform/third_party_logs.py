"""Notes that third-party libraries log at import and a user cannot act on, dropped by their text.

Wherever torchao is installed (the ``fp8`` extra), transformers' quantizer registry imports it, so every
process that builds a model does: torchao then logs one warning per optional C++ kernel library this
machine cannot load (dflash-ipc uses none of them: float8 training runs on torch's scaled matmul) and,
without triton, that its integer matmul kernels will not work; and
torch's pytree registry logs a deprecation note per enum torchao registers. Left alone they print ahead
of a process's own first line, e.g. before the error a refused config prints. :func:`quiet_import_notes`
drops exactly those records (by logger and message); every other message of these loggers still shows.
Every entry point calls it before a model is built: the CLI, the probe, the fork server (its children inherit
the filters), an exec'd child (``runtime/launch.py``), eval's workers and the tools that load models.
"""

from __future__ import annotations

import logging

#: logger -> the text fragments of the records dropped from it
IMPORT_NOTES: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torchao.kernel.intmm": ("Detected no triton",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}


class _DropImportNotes(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def quiet_import_notes() -> None:
    """Drop :data:`IMPORT_NOTES` from here on in this process (and the processes it forks); idempotent.
    Call it before the first import of transformers' models."""
    for name, fragments in IMPORT_NOTES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNotes) for f in logger.filters):
            logger.addFilter(_DropImportNotes(fragments))
