"""Drafter role, by concern, lowest first: ``model`` (the network and its build), ``loss`` (the training
objective), ``checkpoint``, ``training`` (the data-parallel trainer and what steers it) and ``export`` (for the
serving engines); on top, the role's pure core (``core``) and its loop (``loop``). Each room imports only the
rooms below it (tests/project/test_architecture.py)."""
