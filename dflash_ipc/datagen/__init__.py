"""Training-data generation: the target answers prompts (``gen-data``) and synthesises prompts from its chat template.

An application on top of ``eval`` (it drives the frozen target through ``eval.target_lm``) and ``data``
(it reads prompts and writes records); nothing below it imports it.
"""
