"""Serving a tensor-parallel target with the SSD speculator as one more rank of the same launch.

One ``torchrun`` job of N + 1 processes (N without a speculator) holds every role::

    rank 0 .. N-1   the target (verifier), sharded N ways; rank 0 owns the engine (scheduling, sampling,
                    verification, the HTTP server) and broadcasts each forward's inputs to ranks 1 .. N-1
    rank N          the SSD speculator (draft model or EAGLE-3 head) on its own device

Process groups: the default group (all ranks, used once at startup to share the engine configuration), the
target's group ``new_group(range(N))`` (its device mesh and the per-forward broadcasts), and the verifier <->
speculator pair ``new_group([0, N])`` (the point-to-point messages of :mod:`ssd_eagle.ssd.transport`).

Modules:

- :mod:`~ssd_eagle.parallel.topology`: ranks, roles, groups and devices of a launch.
- :mod:`~ssd_eagle.parallel.sharding`: sharding a transformers causal LM with transformers' own tensor-parallel
  plans (and why not DeepSpeed's AutoTP), the local KV-head count.
- :mod:`~ssd_eagle.parallel.runner`: rank 0's forward broadcast and the lockstep loop of ranks 1 .. N-1.
- :mod:`~ssd_eagle.parallel.speculator`: the speculator rank and the verifier's handle on it.
- :mod:`~ssd_eagle.parallel.engine`: building rank 0's engine and running every other role.

The launch command is ``python -m inference.launch --tp N {generate,serve} ...`` (see :mod:`inference.launch`).
"""
