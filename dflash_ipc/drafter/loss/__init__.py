"""The DFlash training objective on a packed batch (``objective``): where the draft blocks sit (``blocks``),
the attention masks over them (``masks``) and the full-vocabulary cross-entropy through the frozen head, a
chunk of rows at a time (``chunked_ce``)."""
