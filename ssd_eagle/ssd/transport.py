"""The verifier <-> speculator link: a two-rank process group of its own, and the :class:`Channel` over it.

The link never touches torch.distributed's default process group, so an SSD engine starts whether or not this
process has one (DeepSpeed, a torchrun job), and several SSD engines live in one process. A spawned speculator
meets the verifier through a :class:`torch.distributed.TCPStore` the verifier opens on a free port
(:func:`open_store`, :func:`pair_group`: gloo on CPUs, NCCL between two GPUs); inside a tensor-parallel launch the
pair is a ``new_group`` of the job (:mod:`ssd_eagle.parallel.topology`). Either way the channel addresses the peer
by its rank *in the pair* (the verifier is 0, the speculator 1).

Every message (:mod:`ssd_eagle.ssd.protocol`, which lists the layouts) is a fixed int64 header
``[PROTOCOL_VERSION, command, n_ints, n_floats]`` followed by at most one int64 and one float payload, received
into preallocated buffers when they fit (the hot path never pickles). Floats travel in the link's dtype (the
verifier's).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ssd_eagle.ssd.protocol import PROTOCOL_VERSION, Message

HEADER = 4
VERIFIER, SPECULATOR = 0, 1  # ranks in the pair


class SpeculatorUnavailable(RuntimeError):
    """The speculator died, stalled past the timeout, or reported an error."""


class ProtocolMismatch(SpeculatorUnavailable):
    """The peer speaks another protocol version (its header's first word)."""


def open_store(port: int = 0, timeout: float = 300.0, host: str = "127.0.0.1") -> dist.TCPStore:
    """The pair's rendezvous: ``port=0`` (the verifier) listens on a free port (``store.port``); the speculator
    connects to that port."""
    return dist.TCPStore(host, port, 2, is_master=port == 0, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def pair_group(store: dist.Store, rank: int, backend: str = "gloo", timeout: float = 300.0):
    """The two-rank process group of the pair (``rank`` 0: the verifier, 1: the speculator); blocks until both
    joined.

    Raises:
        ValueError: a backend other than ``gloo`` or ``nccl``.
    """
    span = datetime.timedelta(seconds=timeout)
    store = dist.PrefixStore("ssd-pair/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, span)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = span
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"the SSD link's backend must be gloo or nccl, got {backend!r}")


class Channel:
    """One end of the verifier <-> speculator link.

    Args:
        group: the pair's process group (:func:`pair_group`, or a two-rank ``new_group`` of a launch).
        peer: the other end's rank in ``group``.
        float_dtype: the draft's dtype. Float payloads travel in it, but never narrower than float32: the q of a
            sampled proposal and the sampling parameters must reach the verifier exactly as the speculator used
            them (a bf16 q rounded on the way would change the output law at T > 0; temperature 0.7 would arrive
            as 0.6992).
        device: where buffers live (the process's device; CPU for gloo).
        max_ints / max_floats: preallocated payload sizes; larger messages allocate.
    """

    def __init__(self, group, peer: int, float_dtype: torch.dtype = torch.float32, device="cpu",
                 max_ints: int = 1 << 16, max_floats: int = 1 << 22):
        self.group, self.peer = group, peer
        self.device = device
        self.float_dtype = torch.promote_types(float_dtype, torch.float32)
        self.header = torch.zeros(HEADER, dtype=torch.long, device=device)
        self.ints = torch.zeros(max_ints, dtype=torch.long, device=device)
        self.floats = torch.zeros(max_floats, dtype=self.float_dtype, device=device)
        self._posted = None  # a header receive started by poll()

    def send(self, msg: Message) -> None:
        """Send one message (int payloads as int64, floats in ``float_dtype``)."""
        n_i = 0 if msg.ints is None else msg.ints.numel()
        n_f = 0 if msg.floats is None else msg.floats.numel()
        self._send(torch.tensor([PROTOCOL_VERSION, msg.command, n_i, n_f], dtype=torch.long, device=self.device))
        if n_i:
            self._send(msg.ints.reshape(-1).to(device=self.device, dtype=torch.long).contiguous())
        if n_f:
            self._send(msg.floats.reshape(-1).to(device=self.device, dtype=self.float_dtype).contiguous())

    def recv(self, timeout: float | None = None) -> Message:
        """Receive one message. Its payloads may alias internal buffers: copy what must outlive the next receive
        (the protocol's decoders do).

        Raises:
            SpeculatorUnavailable: nothing arrived within ``timeout`` seconds (None: wait forever), or the link
                broke.
            ProtocolMismatch: the peer's header carries another protocol version.
        """
        posted, self._posted = self._posted, None
        self._recv_into(self.header, timeout, posted)
        version, command, n_i, n_f = self.header.tolist()
        if version != PROTOCOL_VERSION:
            raise ProtocolMismatch(f"the peer speaks SSD protocol version {version}, this side {PROTOCOL_VERSION}")
        ints = self._payload(self.ints, n_i, torch.long, timeout)
        floats = self._payload(self.floats, n_f, self.float_dtype, timeout)
        return Message(command, ints, floats)

    def poll(self) -> bool:
        """Whether the next message's header has arrived (never blocks; the next :meth:`recv` completes it). A
        timing hint only: gloo marks a receive complete only once waited on, so on CPUs the header buffer, zeroed
        when the receive is posted, is read for the (nonzero) protocol version."""
        if self._posted is None:
            self.header.zero_()
            self._posted = self.group.recv([self.header], self.peer, 0)
        return self._posted.is_completed() or (self.header.device.type == "cpu" and bool(self.header[0]))

    def _send(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor], self.peer, 0).wait()

    def _payload(self, buffer: torch.Tensor, n: int, dtype, timeout) -> torch.Tensor:
        if n == 0:
            return buffer[:0]
        target = buffer[:n] if n <= buffer.numel() else torch.empty(n, dtype=dtype, device=self.device)
        self._recv_into(target, timeout)
        return target

    def _recv_into(self, tensor: torch.Tensor, timeout: float | None, work=None) -> None:
        try:
            work = work or self.group.recv([tensor], self.peer, 0)
            if timeout is None:
                work.wait()
            elif not work.wait(datetime.timedelta(seconds=timeout)):
                raise SpeculatorUnavailable(f"no message from the peer within {timeout:.1f} s")
        except SpeculatorUnavailable:
            raise
        except RuntimeError as err:
            raise SpeculatorUnavailable(f"the link to the peer failed: {err}") from err
