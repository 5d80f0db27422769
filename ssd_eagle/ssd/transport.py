"""The verifier <-> speculator link: a two-rank process group of its own, and the :class:`Channel` over it.

The link never touches torch.distributed's default process group, so an SSD engine starts whether or not this
process has one (DeepSpeed, a torchrun job), and several SSD engines live in one process. A spawned speculator
meets the verifier through a :class:`torch.distributed.TCPStore` the verifier opens on a free port
(:func:`open_store`, :func:`pair_group`: gloo on CPUs, NCCL between two GPUs); inside a tensor-parallel launch the
pair is a ``new_group`` of the job (:mod:`ssd_eagle.parallel.topology`). Either way the channel addresses the peer
by its rank *in the pair* (the verifier is 0, the speculator 1).

Every message (:mod:`ssd_eagle.ssd.protocol`, which lists the layouts) is a fixed int64 header
``[PROTOCOL_VERSION, command, n_ints, n_floats]`` and a body: the int64 words, then the floats' bytes packed into
int64 words (floats travel in the link's dtype, the verifier's, never narrower than float32). The hot path never
pickles.

A gloo send completes only once the peer has posted the matching receive (measured: a send to a peer that posts its
receive 20 ms later waits 20 ms), so on CPUs every message travels as **one frame** (header and body in one send)
and each end keeps the receive of the peer's next frame posted at all times (two frame buffers, alternating): a send
never waits for the peer to finish what it is doing (a speculator mid-forward, a verifier mid-verification), and a
round costs one send each way instead of five rendezvous. A message larger than a frame sends its header in the
frame and its body in a second send. With NCCL (two GPUs) a receive must match its send's size and a posted receive
would hold back this rank's sends on the communicator's stream, so there the header and the body travel as two
sends and nothing is posted in advance.
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
        device: where buffers live (the process's device; CPU for gloo, where messages travel framed).
        frame_words: int64 words of a frame (header included; a larger message sends its body apart); both ends
            of a link must use the same.
    """

    def __init__(self, group, peer: int, float_dtype: torch.dtype = torch.float32, device="cpu",
                 frame_words: int = 1 << 18):
        self.group, self.peer = group, peer
        self.device = device
        self.float_dtype = torch.promote_types(float_dtype, torch.float32)
        self.framed = torch.device(device).type == "cpu"
        self.frames = [torch.zeros(frame_words, dtype=torch.long, device=device) for _ in range(2 if self.framed
                                                                                             else 1)]
        self._next = 0  # the frame the next message arrives in
        self._posted = None  # the posted receive of that frame (framed: always)
        if self.framed:
            self.post()

    def send(self, msg: Message) -> None:
        """Send one message (int payloads as int64, floats in ``float_dtype``)."""
        n_i = 0 if msg.ints is None else msg.ints.numel()
        n_f = 0 if msg.floats is None else msg.floats.numel()
        header = torch.tensor([PROTOCOL_VERSION, msg.command, n_i, n_f], dtype=torch.long)
        parts = [header]
        if n_i:
            parts.append(msg.ints.reshape(-1).to("cpu", torch.long))
        if n_f:
            floats = msg.floats.reshape(-1).to("cpu", self.float_dtype)
            pad = -floats.numel() % (8 // floats.element_size())
            parts.append(torch.cat([floats, floats.new_zeros(pad)]).view(torch.long))
        if self.framed and sum(map(len, parts)) <= self.frames[0].numel():
            self._send(torch.cat(parts))
            return
        self._send(header.to(self.device))
        if len(parts) > 1:
            self._send(torch.cat(parts[1:]).to(self.device))

    def recv(self, timeout: float | None = None) -> Message:
        """Receive one message. Its payloads may alias internal buffers: copy what must outlive the next receive
        (the protocol's decoders do).

        Raises:
            SpeculatorUnavailable: nothing arrived within ``timeout`` seconds (None: wait forever), or the link
                broke.
            ProtocolMismatch: the peer's header carries another protocol version.
        """
        self.post()
        frame = self.frames[self._next]
        self._recv_into(frame, timeout, self._posted)  # (a receive that timed out stays posted)
        self._posted = None
        version, command, n_i, n_f = frame[:HEADER].tolist()
        if version != PROTOCOL_VERSION:
            raise ProtocolMismatch(f"the peer speaks SSD protocol version {version}, this side {PROTOCOL_VERSION}")
        words = n_i + -(-n_f * self.float_dtype.itemsize // 8)
        body = frame[HEADER: HEADER + words]
        if not self.framed or HEADER + words > frame.numel():  # the body comes in a send of its own
            if body.numel() < words:
                body = torch.empty(words, dtype=torch.long, device=self.device)
            if words:
                self._recv_into(body, timeout)
        if self.framed:  # the peer's next message may come at once: its frame's receive is posted now
            self._next ^= 1
            self.post()
        return Message(command, body[:n_i], body[n_i:].view(self.float_dtype)[:n_f])

    def post(self) -> None:
        """Post the receive of the next message's frame (its header only with NCCL), if not posted yet."""
        if self._posted is None:
            frame = self.frames[self._next]
            frame[0] = 0  # poll() reads the version word
            self._posted = self.group.recv([frame if self.framed else frame[:HEADER]], self.peer, 0)

    def poll(self) -> bool:
        """Whether the next message's header has arrived (never blocks; the next :meth:`recv` completes it). A
        timing hint only: gloo marks a receive complete only once waited on, so on CPUs the frame, whose version
        word is zeroed when its receive is posted, is read for the (nonzero) protocol version."""
        self.post()
        frame = self.frames[self._next]
        return self._posted.is_completed() or (frame.device.type == "cpu" and bool(frame[0]))

    def _send(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor], self.peer, 0).wait()

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
