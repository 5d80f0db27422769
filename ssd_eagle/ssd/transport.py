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

The round trip of a speculation-cache hit (the verifier's outcome out, the cached proposal back) does no draft work,
so what it costs is this plumbing, kept lean (issue 13 item 2):

- **Spinning receive.** A process blocked in a receive is woken by gloo's I/O thread through a condition variable;
  on an idle core (a halted virtual CPU, cold caches) that wake-up alone costs 0.1-1 ms. An end that owns its cores
  (``spin``: the pinned verifier and speculator, :data:`SPIN_SECONDS`) instead busy-polls the posted frame's version
  word (zeroed when the receive is posted, nonzero once the message lands) for up to ``spin`` seconds, yielding the
  core (``sched_yield``) between looks so that the I/O thread filling the frame runs at once, then does the usual
  blocking wait: it completes the receive (a frame is never read early), reports a broken link, and the rest of
  ``timeout`` bounds it. A spin that sees nothing only delays that wait, by at most ``spin``. A yield that comes
  back late (:data:`YIELD_LIMIT`) ran another process on the core: the core is not this end's alone, and yielding
  on would hand that process the core again and again (a scheduler slice each), so the spin stops and the blocking
  wait, whose wake-up the scheduler favours, takes over.
- **No per-message tensors.** A framed message is written into a send frame allocated once (the header through a
  NumPy view, the ints and the floats by one ``copy_`` each, the floats into the frame's float view) and a received
  header is read through a NumPy view: no ``torch.tensor`` or ``torch.cat`` per message (each costs tens of
  microseconds on a cold core). A send has completed when it returns, so one send frame serves every message.
- **Posting after the answer.** After a message whose command is in ``recv``'s ``defer_post`` (a request this end
  answers at once, or the answer to its own request: the peer then sends nothing before this end's next send), the
  next frame's receive is posted by this end's next :meth:`Channel.send`, once that message is out, so the post's
  system call stays off the round trip. A peer's send issued before the post would wait for it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Collection
import threading
import time

import torch
import torch.distributed as dist

from ssd_eagle.ssd.protocol import PROTOCOL_VERSION, Message

HEADER = 4
VERIFIER, SPECULATOR = 0, 1  # ranks in the pair
IDLE_TIMEOUT_S = 10 * 365 * 86400.0  # the speculator's wait for a request: "forever" (gloo needs a finite one)
SPIN_SECONDS = 0.1  # how long an end that owns its cores busy-polls a receive before blocking (module docstring)
YIELD_LIMIT = 1e-4  # a yield of the spin that took longer ran another process: the spin gives way to a blocking wait


class SpeculatorUnavailable(RuntimeError):
    """The speculator died, stalled past the timeout, or reported an error."""


class ProtocolMismatch(SpeculatorUnavailable):
    """The peer speaks another protocol version (its header's first word)."""


def open_store(port: int = 0, timeout: float = 300.0, host: str = "127.0.0.1") -> dist.TCPStore:
    """The pair's rendezvous: ``port=0`` (the verifier) listens on a free port (``store.port``); the speculator
    connects to that port."""
    return dist.TCPStore(host, port, 2, is_master=port == 0, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


JOINING_KEY = "ssd-speculator-joining"  # set in the pair's store by a speculator about to join (wait_for_peer)


def announce_join(store: dist.Store) -> None:
    """The speculator's word, in the pair's store, that it is ready and about to join (:func:`wait_for_peer`)."""
    store.set(JOINING_KEY, "1")


def wait_for_peer(store: dist.Store, process, timeout: float, interval: float = 0.05) -> None:
    """Wait until the spawned speculator ``process`` announced its join (:func:`announce_join`), watching it meanwhile:
    a speculator that dies while starting (a draft that does not build, a script without a ``__main__`` guard under
    spawn) fails the start at once, instead of after the join's ``timeout`` (300 s by default).

    Args:
        process: a ``multiprocessing.Process`` (its ``exitcode`` is read every ``interval`` s).
        timeout: seconds the speculator has to announce itself.

    Raises:
        SpeculatorUnavailable: the process exited first (its exit code; its own traceback is in this process's
            stderr), or ``timeout`` passed.
    """
    deadline = time.monotonic() + timeout
    while not store.check([JOINING_KEY]):
        if process.exitcode is not None:
            raise SpeculatorUnavailable(f"the speculator process exited with code {process.exitcode} while starting, "
                                        "before it joined the link (its traceback is above)")
        if time.monotonic() > deadline:
            raise SpeculatorUnavailable(f"the speculator process did not join the link within {timeout:g} s")
        time.sleep(interval)


def pair_group(store: dist.Store, rank: int, backend: str = "gloo", timeout: float = 300.0,
               op_timeout: float | None = None):
    """The two-rank process group of the pair (``rank`` 0: the verifier, 1: the speculator); blocks until both
    joined.

    Args:
        timeout: seconds the join may take (the rendezvous waits on ``store``, opened with its own timeout).
        op_timeout: seconds a send or receive without a timeout of its own may wait (default ``timeout``). A gloo
            op that times out closes the pair for good, so the speculator's end, which waits for the verifier's next
            request however long the server stays idle, passes :data:`IDLE_TIMEOUT_S`.

    Raises:
        ValueError: a backend other than ``gloo`` or ``nccl``.
    """
    span = datetime.timedelta(seconds=timeout if op_timeout is None else op_timeout)
    store = dist.PrefixStore("ssd-pair/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, span)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = span
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"the SSD link's backend must be gloo or nccl, got {backend!r}")


def link_failed(err: RuntimeError) -> SpeculatorUnavailable:
    """A process group's error (gloo's "Connection closed by peer" when the other end went away, a failed NCCL op)
    as the :class:`SpeculatorUnavailable` the link raises (raised ``from err`` by the caller; a ``try`` costs
    nothing on the hot path, where a context manager would cost ~1.5 us per send)."""
    return SpeculatorUnavailable(f"the link to the peer failed: {err}")


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
        spin: seconds a framed receive busy-polls its frame before the blocking wait (0: never; ignored unframed).
            Only for an end that owns its cores: the spin keeps its core busy (module docstring).
    """

    def __init__(self, group, peer: int, float_dtype: torch.dtype = torch.float32, device="cpu",
                 frame_words: int = 1 << 18, spin: float = 0.0):
        self.group, self.peer = group, peer
        self.device = device
        self.float_dtype = torch.promote_types(float_dtype, torch.float32)
        self.framed = torch.device(device).type == "cpu"
        self.spin = spin if self.framed else 0.0
        self.frames = [torch.zeros(frame_words, dtype=torch.long, device=device) for _ in range(2 if self.framed
                                                                                             else 1)]
        self._next = 0  # the frame the next message arrives in
        self._posted = None  # the posted receive of that frame (framed: always, except after a deferred post)
        self._receiving = threading.Lock()  # orders the receive state (_next, _posted) against another thread's post
        if self.framed:
            self._words = [frame.numpy() for frame in self.frames]  # header reads, version-word polls
            self._floats = [frame.view(self.float_dtype) for frame in self.frames]
            self._out = torch.zeros(frame_words, dtype=torch.long)  # the send frame
            self._out_words, self._out_floats = self._out.numpy(), self._out.view(self.float_dtype)
            self._sending = threading.Lock()  # held while a send uses the send frame
            self.post()

    def send(self, msg: Message) -> None:
        """Send one message (int payloads as int64, floats in ``float_dtype``). Framed, it then posts the next
        frame's receive if a ``recv`` left it unposted (``defer_post``). Safe from several threads for messages that
        fit in a frame; a larger one sends its header and body as two sends, which another thread's send must not
        come between (no caller in this repository sends from two threads)."""
        n_i = 0 if msg.ints is None else msg.ints.numel()
        n_f = 0 if msg.floats is None else msg.floats.numel()
        if self.framed:
            per_word = 8 // self.float_dtype.itemsize
            end = HEADER + n_i + -(-n_f // per_word)
            if end <= self._out.numel():
                own = self._sending.acquire(blocking=False)  # (another thread sends: a frame of this send's own)
                try:
                    frame = self._out if own else torch.empty(end, dtype=torch.long)
                    words = self._out_words if own else frame.numpy()
                    words[:HEADER] = (PROTOCOL_VERSION, msg.command, n_i, n_f)
                    if n_i:
                        ints = msg.ints
                        if ints.device.type == "cpu" and ints.dtype == torch.long:
                            words[HEADER: HEADER + n_i] = ints.numpy().reshape(-1)  # (no torch op)
                        else:
                            frame[HEADER: HEADER + n_i].copy_(ints.reshape(-1))
                    if n_f:
                        start = (HEADER + n_i) * per_word
                        (self._out_floats if own else frame.view(self.float_dtype))[start: start + n_f].copy_(
                            msg.floats.reshape(-1))
                    self._send(frame[:end])
                finally:
                    if own:
                        self._sending.release()
                self.post()
                return
        header = torch.tensor([PROTOCOL_VERSION, msg.command, n_i, n_f], dtype=torch.long)
        self._send(header.to(self.device))
        if n_i or n_f:
            parts = []
            if n_i:
                parts.append(msg.ints.reshape(-1).to("cpu", torch.long))
            if n_f:
                floats = msg.floats.reshape(-1).to("cpu", self.float_dtype)
                pad = -floats.numel() % (8 // floats.element_size())
                parts.append(torch.cat([floats, floats.new_zeros(pad)]).view(torch.long))
            self._send(torch.cat(parts).to(self.device))
        if self.framed:
            self.post()

    def recv(self, timeout: float | None = None, defer_post: Collection[int] = ()) -> Message:
        """Receive one message. Its payloads may alias internal buffers: copy what must outlive the next receive
        (the protocol's decoders do). Framed, the next frame's receive is posted at once, unless the command is in
        ``defer_post``: the peer sends nothing before this end's next :meth:`send`, which posts it (module
        docstring).

        Raises:
            SpeculatorUnavailable: nothing arrived within ``timeout`` seconds (None: wait forever), or the link
                broke.
            ProtocolMismatch: the peer's header carries another protocol version.
        """
        self.post()
        if self.spin > 0:
            timeout = self._spin(timeout)
        self._recv_into(self.frames[self._next], timeout, self._posted)  # (a receive that timed out stays posted)
        with self._receiving:  # (a send from another thread posts only once this message is read and _next moved)
            return self._read(timeout, defer_post)

    def _read(self, timeout: float | None, defer_post: Collection[int]) -> Message:
        """The rest of :meth:`recv` once the frame's receive completed: the header, the body, the next post."""
        frame = self.frames[self._next]
        self._posted = None
        version, command, n_i, n_f = (self._words[self._next] if self.framed else frame)[:HEADER].tolist()
        if version != PROTOCOL_VERSION:
            raise ProtocolMismatch(f"the peer speaks SSD protocol version {version}, this side {PROTOCOL_VERSION}")
        per_word = 8 // self.float_dtype.itemsize
        words = n_i + -(-n_f // per_word)
        if self.framed and HEADER + words <= frame.numel():  # the whole message is in the frame
            start = (HEADER + n_i) * per_word
            msg = Message(command, frame[HEADER: HEADER + n_i], self._floats[self._next][start: start + n_f])
            self._next ^= 1  # the peer's next message may come at once: its frame's receive is posted now (or by
            if command not in defer_post:  # this end's next send, which the peer waits for)
                self._post()
            return msg
        body = frame[HEADER: HEADER + words]
        if body.numel() < words:  # the body comes in a send of its own
            body = torch.empty(words, dtype=torch.long, device=self.device)
        if words:
            self._recv_into(body, timeout)
        if self.framed:
            self._next ^= 1
            self._post()
        return Message(command, body[:n_i], body[n_i:].view(self.float_dtype)[:n_f])

    def post(self) -> None:
        """Post the receive of the next message's frame (its header only with NCCL), if not posted yet. Safe from
        any thread: it waits while another thread's :meth:`recv` reads a message that arrived."""
        with self._receiving:
            self._post()

    def _post(self) -> None:
        if self._posted is None:
            frame = self.frames[self._next]
            if self.framed:
                self._words[self._next][0] = 0  # poll() and the spin read the version word
            else:
                frame[0] = 0
            try:
                self._posted = self.group.recv([frame if self.framed else frame[:HEADER]], self.peer, 0)
            except RuntimeError as err:
                raise link_failed(err) from err

    def poll(self) -> bool:
        """Whether the next message's header has arrived (never waits for the peer; the next :meth:`recv` completes
        it). A timing hint only: gloo marks a receive complete only once waited on, so on CPUs the frame, whose
        version word is zeroed when its receive is posted, is read for the (nonzero) protocol version."""
        with self._receiving:
            self._post()
            return self._posted.is_completed() or (self.framed and bool(self._words[self._next][0]))

    def _spin(self, timeout: float | None) -> float | None:
        """Busy-poll the posted frame's version word for up to ``spin`` seconds (within ``timeout``); returns what
        is left of ``timeout`` for the blocking wait that completes the receive."""
        word = self._words[self._next]
        start = now = time.perf_counter()
        end = start + (self.spin if timeout is None else min(self.spin, timeout))
        while not word[0] and now < end:
            os.sched_yield()  # the I/O thread that fills the frame shares this core
            before, now = now, time.perf_counter()
            if now - before > YIELD_LIMIT and not word[0]:  # the core went to another process: it is not ours alone
                break
        if timeout is None:
            return None
        left = timeout - (time.perf_counter() - start)
        if left < 1e-3 and not word[0]:  # (a wait of under a millisecond would be a wait without a timeout)
            raise SpeculatorUnavailable(f"no message from the peer within {timeout:.1f} s")
        return max(left, 1e-3)

    def _send(self, tensor: torch.Tensor) -> None:
        try:
            self.group.send([tensor], self.peer, 0).wait()
        except RuntimeError as err:
            raise link_failed(err) from err

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
            raise link_failed(err) from err
