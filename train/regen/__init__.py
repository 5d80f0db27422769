"""Regenerating training data with the target (``scripts/regenerate_data.py`` is the command line).

- :mod:`~train.regen.sources`: conversations (packaged prompts, files), per-conversation choices;
- :mod:`~train.regen.grounded`: requests about real local text (docs, standard-library code);
- :mod:`~train.regen.magpie`: the target writes user turns (steered new requests, follow-ups);
- :mod:`~train.regen.filters`: deduplication keys and the repetition filter;
- :mod:`~train.regen.scheduler`: continuous batching over the engine's ``add_request`` / ``step``;
- :mod:`~train.regen.store`: the resumable work folder (shards, candidate log, run log);
- :mod:`~train.regen.pack`: the packed ``data/<model>/`` file and its manifest.

The held-out guard every prompt and response passes lives in :mod:`train.heldout`.
"""
