"""The speculator process: receives requests, answers from the speculation cache, then builds the next one.

Started by :class:`~ssd_eagle.ssd.client.RemoteSpeculator` with ``torch.multiprocessing`` (spawn). It joins the
verifier's two-rank link (:mod:`ssd_eagle.ssd.transport`; rank 1 there), pins itself to its own CPU cores or GPU,
and serves until SHUTDOWN (messages: :mod:`ssd_eagle.ssd.protocol`). The draft model arrives as a module (its
tensors in shared memory) and is moved to the speculator's device. Answering before building is what lets drafting
overlap the target's verification. Before it joins, it warms its draft up on synthetic requests (:func:`warm_up`:
0.4 s for chains, 1.9 s for trees with the SmolLM2 head on one Xeon core), so that the first real request's hits do
not wait for first-shape costs.

From its first instruction to its end the process beats a heartbeat (:data:`HEARTBEAT_INTERVAL`): a daemon thread
writes ``time.monotonic()`` (system-wide on Linux) into a shared double the verifier reads without a message, so a
process that is alive but not running (stopped, starved, stuck holding the GIL) is told apart from a slow one.
A verifier that goes away without SHUTDOWN (it exited, or was killed) ends the process quietly with exit code
:data:`LINK_LOST`, not a traceback in the server's log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from ssd_eagle.ssd import protocol as p
from ssd_eagle.ssd import transport as t

log = logging.getLogger(__name__)

LINK_LOST = 3  # the speculator process's exit code when the verifier closed the link without a SHUTDOWN


@dataclass
class SpeculatorSettings:
    """Everything the speculator process needs besides the draft module (picklable)."""

    kind: str  # "draft_model" or "eagle3"
    num_speculative_tokens: int
    fanout: list[int]
    fanout_miss: list[int] | None
    backup: str
    fast_backup_batch: int
    saguaro_c: float
    prompt_lookup: tuple[int, int]
    num_slots: int
    max_len: int
    device: str = "cpu"
    threads: int = 1
    cpus: list[int] | None = None
    store_port: int = 0  # the verifier's TCPStore (set when the process is spawned)
    dist_backend: str = "gloo"
    float_dtype: torch.dtype = torch.float32
    vocab_size: int = 0
    tree_budget: int = 0
    tree_depth: int = 5
    tree_topk: int = 4
    fanout_power: float | str = 1.0  # r, or "auto" (fitted online)
    cuda_graphs: bool = True  # fixed-shape draft steps (CUDA graphs on CUDA); False: --eager
    temperature_scale: float | None = None  # the draft's temperature scale s (None: 1, see build_speculator)


HEARTBEAT_INTERVAL = 0.5  # seconds between two heartbeats of the speculator process


def beat(heartbeat, interval: float = HEARTBEAT_INTERVAL) -> None:
    """Write ``time.monotonic()`` (seconds) into ``heartbeat.value`` every ``interval`` s, forever (a daemon
    thread's loop)."""
    while True:
        heartbeat.value = time.monotonic()
        time.sleep(interval)


def build_speculator(settings: SpeculatorSettings, draft, backend=None):
    """The :class:`~ssd_eagle.ssd.speculator.Speculator` for a draft module (used in-process and in the worker),
    on a new draft backend or on ``backend`` (then ``draft`` is not used)."""
    from ssd_eagle.drafters.base import SaguaroSampling
    from ssd_eagle.drafters.backends import DraftLMBackend, Eagle3Backend
    from ssd_eagle.ssd.speculator import Speculator

    if settings.kind not in ("eagle3", "draft_model"):
        raise ValueError(f"SSD needs a neural draft ('draft_model' or 'eagle3'), got {settings.kind!r}")
    if backend is None:
        kind = Eagle3Backend if settings.kind == "eagle3" else DraftLMBackend
        backend = kind(draft, settings.num_slots, settings.max_len, settings.cuda_graphs)
    # SSD drafts at s = 1 unless told otherwise: the s a draft records maximises SD's acceptance, but a sharper q
    # leaves a rejected position's bonus (drawn from the residual max(p - q, 0)) less often among the cached top-F
    # candidates, and the round's chance not to stall falls (SmolLM2 head, T = 1, F = 3: 0.737 at s = 1, 0.715 at
    # s = 0.7; ssd_eagle.ssd.fanout.nonstall_probability on 24 training conversations)
    backend.temperature_scale = 1.0 if settings.temperature_scale is None else settings.temperature_scale
    from ssd_eagle.drafters.tree import TreeSettings

    saguaro = SaguaroSampling(settings.saguaro_c, tuple(settings.fanout)) if settings.saguaro_c < 1.0 else None
    tree = None
    if settings.tree_budget:
        tree = TreeSettings(settings.tree_budget, min(settings.tree_depth, settings.num_speculative_tokens),
                            settings.tree_topk)
    return Speculator(backend, settings.num_speculative_tokens, settings.fanout, settings.fanout_miss,
                      settings.backup, settings.fast_backup_batch, saguaro, settings.prompt_lookup, tree,
                      settings.fanout_power)


def warm_up(speculator, rounds: int = 6, prompt_tokens: int = 160) -> None:
    """Drive synthetic requests (random tokens and, for EAGLE-3, random aux states; one greedy, one sampled when
    there are two slots) through ``rounds`` rounds of propose and build, then remove them, so that the first real
    request does not pay the draft's first-shape costs (oneDNN builds a kernel per new shape; allocator growth):
    the first tree hit on a Xeon with AMX waited 187 ms, the next ones ~1 ms. It leaves ``speculator``'s statistics
    and measured costs behind: serve a fresh :func:`build_speculator` on the same backend afterwards."""
    from ssd_eagle.sampling_params import SamplingParams
    from ssd_eagle.ssd.speculator import SpecRequest

    backend = speculator.backend
    vocab_size = backend.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt_tokens = min(prompt_tokens, backend.kv.max_len // 2)  # (room for the rounds and their branches)
    slots = range(min(2, backend.kv.num_slots - 1))  # (the last slot is the backend's scratch)
    width = backend.head.fc.in_features if backend.needs_aux else 0
    for slot in slots:
        tokens = torch.randint(0, vocab_size, (prompt_tokens,), generator=gen).tolist()
        aux = torch.randn(prompt_tokens - 1, width, generator=gen).to(backend.dtype) if width else None
        speculator.add(slot, tokens, SamplingParams(temperature=0.0 if slot == 0 else 1.0), seed=slot, aux=aux)
    request = {slot: SpecRequest(slot, -1, 0, speculator.K) for slot in slots}
    for _ in range(rounds):
        replies = speculator.propose(list(request.values()))
        speculator.build()
        for slot, reply in zip(slots, replies):
            k = min(1, len(reply.tokens))  # (one draft accepted when there is one: a hit path and a miss path)
            bonus = int(torch.randint(0, vocab_size, (1,), generator=gen))
            aux = torch.randn(k + 1, width, generator=gen).to(backend.dtype) if width else None
            request[slot] = SpecRequest(slot, k, bonus, speculator.K, aux, reply.tokens[:k])
    for slot in slots:
        speculator.remove(slot)


def worker_main(settings: SpeculatorSettings, draft, startup_timeout: float = 300.0, heartbeat=None) -> None:
    """Entry point of the speculator process; ``heartbeat``: a shared double (``multiprocessing.RawValue("d")``)
    beaten every :data:`HEARTBEAT_INTERVAL` s from a daemon thread, or None."""
    if heartbeat is not None:
        threading.Thread(target=beat, args=(heartbeat,), name="heartbeat", daemon=True).start()
    if settings.cpus:
        os.sched_setaffinity(0, settings.cpus)
    torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    draft = draft.to(device)
    speculator = build_speculator(settings, draft)
    try:  # (before joining: the verifier waits for it)
        warm_up(speculator)
    except Exception as err:  # noqa: BLE001 - a failed warm-up only leaves the first-shape costs to the first request
        log.warning("the speculator's warm-up failed (%s); serving without it", err)
    speculator = build_speculator(settings, draft, backend=speculator.backend)  # (the warm-up's statistics dropped)
    try:
        channel, _store = join_link(settings, device, startup_timeout)
        serve(speculator, channel, [])
    except t.ProtocolMismatch:
        raise
    except t.SpeculatorUnavailable as err:  # the verifier went away (exited, or was killed): nothing left to serve
        log.info("the verifier closed the link; the speculator exits: %s", err)
        raise SystemExit(LINK_LOST) from None


def join_link(settings: SpeculatorSettings, device: torch.device, startup_timeout: float):
    """The speculator's end of the link: ``(channel, store)`` (keep the store while the channel lives). The join
    may take ``startup_timeout`` s; a receive then waits for the verifier's next request however long the server
    idles (:data:`~ssd_eagle.ssd.transport.IDLE_TIMEOUT_S`: with the join's timeout, gloo closed the pair of a
    server idle for 5 minutes and the speculator died).

    Raises:
        SpeculatorUnavailable: the verifier closed the link as it was being opened.
    """
    store = t.open_store(settings.store_port, startup_timeout)
    t.announce_join(store)
    group = t.pair_group(store, t.SPECULATOR, settings.dist_backend, startup_timeout, op_timeout=t.IDLE_TIMEOUT_S)
    channel = t.Channel(group, t.VERIFIER, settings.float_dtype, "cpu" if settings.dist_backend == "gloo" else device,
                        spin=t.SPIN_SECONDS if settings.cpus else 0.0)  # (pinned: this core is the speculator's)
    return channel, store


def serve(speculator, channel: t.Channel, intervals: list[float]) -> None:
    """The request loop until SHUTDOWN (also handy to drive from a test); ``intervals`` collects every build's
    wall-clock start and end. The verification time (reply sent -> next PROPOSE arrived, noted by polling between
    the build's forwards) sizes the next builds (:mod:`ssd_eagle.ssd.budget`); a message arriving mid-build stops
    the build at its next forward, so that it is answered at once.

    A PROPOSE is answered before anything else. When every row hits a cached chain that needs no work
    (:meth:`~ssd_eagle.ssd.speculator.Speculator.peek`: greedy, within its budget) the reply goes out even before
    the round is committed (aux states copied, statistics, the sequences' state), which ``propose`` then does and
    whose replies are the same; and the receive of the verifier's next message is posted only once the reply is
    out (:mod:`ssd_eagle.ssd.transport`)."""
    sent = arrived = None

    def poll() -> bool:
        """Whether the verifier's next message has arrived (noting when)."""
        nonlocal arrived
        if arrived is None and channel.poll():
            arrived = time.perf_counter()
        return arrived is not None

    while True:
        msg = channel.recv(defer_post=(p.PROPOSE, p.STATS))  # (answered at once)
        if msg.command == p.SHUTDOWN:
            return
        if msg.command != p.PROPOSE:  # the verifier did something else than verify: no verification time
            sent = None
        if msg.command == p.ADD:
            seq = p.decode_add(msg)
            speculator.add(seq.slot, seq.token_ids, seq.params, seq.seed, seq.aux, seq.start, seq.done)
        elif msg.command == p.REMOVE:
            speculator.remove(p.decode_remove(msg))
        elif msg.command == p.STATS:
            channel.send(p.encode_stats(speculator.stats, intervals, speculator.choice))
        elif msg.command == p.PROPOSE:
            if sent is not None:
                speculator.observe_verify((arrived or time.perf_counter()) - sent)
            early = None
            try:
                early = speculator.peek(p.decode_propose(msg, aux=False))
                if early is not None:
                    channel.send(p.encode_reply(early))
                    sent = time.perf_counter()
                replies = speculator.propose(p.decode_propose(msg))  # (after an early reply: the same replies)
            except Exception:  # noqa: BLE001 - the verifier must hear back, whatever broke
                if early is None:
                    channel.send(p.Message(p.ERROR))
                raise
            if early is None:
                channel.send(p.encode_reply(replies))
                sent = time.perf_counter()
            arrived = None
            start = time.time()
            try:
                speculator.build(poll)
            except Exception:  # noqa: BLE001 - a failed build only costs hits: every lookup will miss
                for seq in speculator.seqs.values():
                    seq.cache = {}
            poll()
            intervals.extend([start, time.time()])
        else:
            raise RuntimeError(f"unknown command {msg.command}")
