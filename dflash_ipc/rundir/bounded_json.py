"""JSON that another process wrote (a checkpoint's manifest and ledger, a run's plan, status and node
records), parsed with its nesting bounded.

``json.loads`` recurses once per nested array or object and raises RecursionError past the interpreter's
limit: a file of 100,000 ``[`` is then neither a value nor a ``ValueError`` its reader handles (a damaged
checkpoint falls back on ValueError and CheckpointError, ``status`` answers "not JSON" on ValueError).
Here it is a ``ValueError`` saying so, like any other malformed document.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def loads(text: str | bytes) -> Any:
    """``json.loads``, a document nested past the parser's recursion refused as a ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than a JSON reader here allows (about {sys.getrecursionlimit()} levels)") from None


def read(path: str | Path) -> Any:
    """The JSON document in the file ``path`` (:func:`loads`); OSError when it cannot be read."""
    return loads(Path(path).read_text())
