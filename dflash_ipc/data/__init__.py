"""Data: corpus loading and caching, the built-in corpus, tokenizers, the length-bucketed batch plan."""
