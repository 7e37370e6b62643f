"""Data plane: slot layout, shared-memory helpers, the cpu-shm / cuda-ipc / host-pinned rings and
their one set of factories, producer/consumer cores."""
