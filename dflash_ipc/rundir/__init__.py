"""What a run keeps on disk and how it is written: the run directory's fencing generation (``fence``), the
batch ledger of consumed batches (``ledger``), this node's place in the run (``node_spec``, ``node.json``),
atomic and private file writes that follow no planted link (``fsutil``), and JSON read with its nesting
bounded (``bounded_json``).

A leaf package: it imports nothing else of dflash-ipc, so the config, the control plane and both roles
share it.
"""
