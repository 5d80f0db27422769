"""Verifier <-> speculator messages over torch.distributed point-to-point (gloo on CPU, NCCL-capable on GPU).

Every message is a fixed int64 header ``[command, n_ints, n_floats, tag]`` followed by at most one int64 and one
float payload, received into preallocated buffers when they fit (the hot path never allocates or pickles). The
layouts, in int64 words:

    ADD      ints   [slot, seed, top_k, greedy, num_tokens, tokens...]   floats [temperature, top_p, aux...]
    PROPOSE  ints   [rows, then per row: slot, k, bonus, budget]          floats [aux of every row, concatenated]
    REPLY    ints   [rows, then per row: hit, lookup_k, m, has_q, K tokens (padded)]   floats [q of rows with q]
    REMOVE   ints   [slot]
    STATS    (request) -> ints [lookups, hits, builds, n_ranks, ranks...], floats [build_time, intervals...]
    ERROR    the speculator failed to answer; the verifier falls back to plain decoding

``hit`` is -1 when no lookup happened. Aux and q travel in the float payload's dtype (the verifier's).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

ADD, PROPOSE, REPLY, REMOVE, STATS, SHUTDOWN, ERROR = range(1, 8)
HEADER = 4


class SpeculatorUnavailable(RuntimeError):
    """The speculator died, stalled past the timeout, or reported an error."""


class Channel:
    """One end of the verifier <-> speculator link.

    Args:
        peer: the other end's *global* rank (``dist.send`` takes global ranks even with a ``group``).
        group: the process group holding both ends (None: the default group).
        float_dtype: dtype of float payloads (aux states, q).
        device: where buffers live (the process's device; CPU for gloo).
        max_ints / max_floats: preallocated payload sizes; larger messages allocate.
        timeout: seconds to wait for a reply before declaring the peer unavailable (None: forever).
    """

    def __init__(self, peer: int, group=None, float_dtype: torch.dtype = torch.float32, device="cpu",
                 max_ints: int = 1 << 16, max_floats: int = 1 << 22, timeout: float | None = None):
        self.peer, self.group = peer, group
        self.device = device
        self.float_dtype = float_dtype
        self.header = torch.zeros(HEADER, dtype=torch.long, device=device)
        self.ints = torch.zeros(max_ints, dtype=torch.long, device=device)
        self.floats = torch.zeros(max_floats, dtype=float_dtype, device=device)
        self.timeout = timeout

    def send(self, command: int, ints: torch.Tensor | None = None, floats: torch.Tensor | None = None,
             tag: int = 0) -> None:
        n_i = 0 if ints is None else ints.numel()
        n_f = 0 if floats is None else floats.numel()
        header = torch.tensor([command, n_i, n_f, tag], dtype=torch.long, device=self.device)
        dist.send(header, self.peer, group=self.group)
        if n_i:
            dist.send(ints.reshape(-1).to(device=self.device, dtype=torch.long).contiguous(), self.peer,
                      group=self.group)
        if n_f:
            dist.send(floats.reshape(-1).to(device=self.device, dtype=self.float_dtype).contiguous(), self.peer,
                      group=self.group)

    def recv(self, timeout: float | None = None) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """Receive one message: (command, ints, floats, tag). Payload views may alias internal buffers: copy
        what must outlive the next receive.

        Raises:
            SpeculatorUnavailable: nothing arrived within ``timeout`` seconds, or the link broke.
        """
        self._recv_into(self.header, timeout)
        command, n_i, n_f, tag = self.header.tolist()
        ints = self._payload(self.ints, n_i, torch.long, timeout)
        floats = self._payload(self.floats, n_f, self.float_dtype, timeout)
        return command, ints, floats, tag

    def _payload(self, buffer: torch.Tensor, n: int, dtype, timeout) -> torch.Tensor:
        if n == 0:
            return buffer[:0]
        target = buffer[:n] if n <= buffer.numel() else torch.empty(n, dtype=dtype, device=self.device)
        self._recv_into(target, timeout)
        return target

    def _recv_into(self, tensor: torch.Tensor, timeout: float | None) -> None:
        try:
            work = dist.irecv(tensor, self.peer, group=self.group)
            if timeout is None:
                work.wait()
            elif not work.wait(datetime.timedelta(seconds=timeout)):
                raise SpeculatorUnavailable(f"no message from rank {self.peer} within {timeout:.1f} s")
        except SpeculatorUnavailable:
            raise
        except RuntimeError as err:
            raise SpeculatorUnavailable(f"link to rank {self.peer} failed: {err}") from err
