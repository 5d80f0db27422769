"""Ranks, roles, process groups and devices of a tensor-parallel launch (see :mod:`ssd_eagle.parallel`).

The launch is an ordinary ``torchrun`` job: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` come from the environment. With ``WORLD_SIZE == tp_size + 1`` the last rank is the speculator;
with ``WORLD_SIZE == tp_size`` there is none (autoregressive or ordinary speculative decoding).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ssd_eagle.ssd.transport import IDLE_TIMEOUT_S

DRIVER, WORKER, SPECULATOR = "driver", "worker", "speculator"


@dataclass
class Topology:
    """Where this process sits in the launch.

    Attributes:
        tp_size: N, the ranks holding a shard of the target (ranks 0 .. N-1).
        rank, local_rank, world_size: this process's global rank, its rank on its node, the job's size.
        tp_group: the target's process group (None on the speculator rank).
        pair_group: the verifier (rank 0) <-> speculator (rank N) group (None without a speculator, and on ranks
            1 .. N-1).
    """

    tp_size: int
    rank: int
    local_rank: int
    world_size: int
    tp_group: object | None
    pair_group: object | None

    @property
    def has_speculator(self) -> bool:
        return self.world_size == self.tp_size + 1

    @property
    def speculator_rank(self) -> int | None:
        return self.tp_size if self.has_speculator else None

    @property
    def role(self) -> str:
        """``driver`` (rank 0: the engine), ``worker`` (ranks 1 .. N-1) or ``speculator`` (rank N)."""
        if self.rank == 0:
            return DRIVER
        return SPECULATOR if self.rank == self.speculator_rank else WORKER

    def device(self, kind: str) -> torch.device:
        """This rank's device for a configured device string: ``cuda[:i]`` -> ``cuda:<local_rank>`` (one GPU per
        rank, as torchrun places them), anything else -> ``cpu``."""
        if str(kind).startswith("cuda"):
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def default_backend() -> str:
    """gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA is available (one multi-device backend, so the
    startup messages can stay on the CPU while the target's collectives run on the GPUs)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_topology(tp_size: int, backend: str | None = None, timeout_s: float = 1800.0) -> Topology:
    """Join the launch's default process group (if not joined yet) and create the target's and the pair's groups.

    Every rank must call this, in the same order relative to any other group creation.

    Raises:
        ValueError: ``tp_size < 1``, or ``WORLD_SIZE`` is neither ``tp_size`` nor ``tp_size + 1``.
        KeyError: not launched by torchrun (no ``RANK``/``WORLD_SIZE`` in the environment) and no process group.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not dist.is_initialized():
        world = int(os.environ["WORLD_SIZE"])
        _check_world(tp_size, world)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend or default_backend(), timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    _check_world(tp_size, world)
    tp_group = dist.new_group(list(range(tp_size)))
    pair_group = dist.new_group([0, tp_size], timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S)) \
        if world == tp_size + 1 else None  # (the speculator rank waits for requests however long rank 0 idles)
    in_tp = rank < tp_size
    in_pair = pair_group is not None and rank in (0, tp_size)
    return Topology(tp_size=tp_size, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", rank)), world_size=world,
                    tp_group=tp_group if in_tp else None, pair_group=pair_group if in_pair else None)


def _check_world(tp_size: int, world: int) -> None:
    if world not in (tp_size, tp_size + 1):
        raise ValueError(f"a launch with --tp {tp_size} needs {tp_size} processes (ar/sd) or {tp_size + 1} (ssd: "
                         f"one more for the speculator), got WORLD_SIZE={world}")
