"""The trainer's torch.distributed plumbing: start the world through DeepSpeed, reduce small vectors over ranks.

Runs unchanged on CPUs (gloo) and GPUs (nccl); a plain ``python`` launch (no ``RANK`` in the environment) becomes a
one-process world on a free local port. The ``deepspeed`` launcher always sets ``MASTER_PORT`` (its ``--master_port``,
default 29500): a one-process world whose port is already taken (another training, a test) moves to a free one
(not under ``torchrun``, whose agent holds that port for the store the worker joins);
ranks of a larger world cannot agree on a new port by themselves, so concurrent multi-rank runs need their own
``--master_port``.
"""

from __future__ import annotations

import errno
import logging
import os
import socket

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed (gloo without GPUs, nccl with). A plain ``python`` launch
    becomes a one-process world; a one-process world on a taken ``MASTER_PORT`` moves to a free port (logged),
    unless torchrun's agent is the one holding it (``TORCHELASTIC_USE_AGENT_STORE``).
    Returns ``(rank, world_size)``."""
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    port = os.environ.get("MASTER_PORT", "")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves that port
    if not dist.is_initialized() and os.environ.get("WORLD_SIZE") == "1" and not agent_store and port.isdigit() \
            and _port_taken(int(port)):
        os.environ["MASTER_PORT"] = str(_free_port())
        logger.warning("MASTER_PORT %s is taken (another run?): this one-process world uses port %s instead",
                       port, os.environ["MASTER_PORT"])
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def all_reduce(values: list[float] | torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) a small vector over ranks; returned on the CPU in float64."""
    t = torch.as_tensor(values, dtype=torch.float64).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        on_device = t.to(accelerator_device()) if dist.get_backend() == "nccl" else t
        dist.all_reduce(on_device, op=op)
        t = on_device.cpu()
    return t


def accelerator_device() -> torch.device:
    """This rank's device as DeepSpeed's accelerator names it (``cpu`` or ``cuda:<local rank>``)."""
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())
