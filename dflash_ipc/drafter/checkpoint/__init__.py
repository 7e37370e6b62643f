"""The drafter's checkpoints: written crash-safe and loaded with a fallback (``store``), the root's names and
what reads without torch (``layout``), the files checked before a resume (``verify``, no torch either), the
tensors' values checked once loaded (``values``), and safetensors written a slice at a time
(``safetensors_stream``).

Importing this package imports nothing: the supervisor, which never imports torch, reads ``layout`` and
``verify``."""
