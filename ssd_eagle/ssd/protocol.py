"""The verifier <-> speculator messages of SSD, each message's encode and decode side by side.

A message is a command and at most two flat payloads: int64 words and floats (the link's float dtype, the
verifier's). :class:`~ssd_eagle.ssd.transport.Channel` sends the header ``[PROTOCOL_VERSION, command, n_ints,
n_floats]`` and then the payloads as plain tensors (no pickling on the hot path). Layouts, in int64 words:

    ADD       ints   [slot, seed, top_k, greedy, start, done, n, tokens[n]]   (token positions start .. start+n-1)
              floats [temperature, top_p, aux[(n - done) * W]]           (their aux states: EAGLE-3 only)
    PROPOSE   ints   [rows, W, per row: slot, k, bonus, budget, rounds; then every row's k accepted tokens]
              floats [aux[(k + 1) * W] of every row with k >= 0]         (W = 0: no aux)
    REPLY     ints   [rows, n, support[n], per row: hit, lookup_k, fanout, power_micro, backup, m, has_q, is_tree,
              tokens[m], parents[m] if is_tree]   (backup: -1 from the cache, else its index in BACKUPS)
              floats [q[m, support] of every row with has_q]  (support: the columns where some q of the reply is
              nonzero, ascending; every other entry of every q is exactly 0)
    REMOVE    ints   [slot]
    STATS     request: empty; reply ints [lookups, hits, builds, backup_forwards, interrupted, power_micro,
              has_choice, choice[16], n, ranks[n], build_ns, intervals_ns...] (nanoseconds, and the fitted r in
              millionths, -1 for None: exact whatever the float dtype; choice: the backup choice's tokens,
              hit_tokens and next_hit per source in millionths, verify per source and seconds per backup in ns,
              chosen per backup)
    SHUTDOWN  empty
    ERROR     empty: the speculator failed to answer; the verifier falls back to ordinary decoding

A prompt prefilled in chunks goes in one ADD per chunk, in order (``start`` = the tokens sent before; the first
chunk, ``start = 0``, starts the sequence and alone uses its seed and sampling fields); the last has ``done = 1``:
its last token is the first sampled one, which has no aux state yet, and the sequence then decodes.
``k = -1`` is the first round after the last ADD (no lookup); ``hit`` and ``lookup_k`` are -1 for None. A q travels
on its support only: an EAGLE-3 head's q is 0 outside its draft vocabulary (8192 of SmolLM2's 49152 tokens), and
top-k, top-p and Saguaro scaling zero more, so a sampled chain's reply shrinks from K x V floats to about a sixth;
it is drafted over the head's columns and decoded over the support (``Proposal.q_ids``), never made dense on either
side, and the verifier's q is the speculator's bit for bit. A reply is a
:class:`~ssd_eagle.drafters.base.Proposal` (its ``cache_hit`` is the ``hit`` word; ``hidden`` stays on the
speculator's side). Decoded tensors are copies:
they outlive the channel's receive buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd_eagle.drafters.base import Proposal
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.backup import BACKUPS, SOURCES, BackupChoice

PROTOCOL_VERSION = 8  # 7: STATS without the backup choice; 6: PROPOSE rows without rounds; 5: REPLY without the backup word; 4: REPLY with dense q,
# without fanout and r, and (transport) header and payloads in separate sends; 3: STATS without interrupted builds
# and the fitted r; 2: one ADD per sequence (no chunks); 1: the unversioned layout before this module (no aux
# width, float statistics)
ADD, PROPOSE, REPLY, REMOVE, STATS, SHUTDOWN, ERROR = range(1, 8)


@dataclass
class Message:
    """One message: a command and its payloads (int64 ``[n_ints]``, float ``[n_floats]``; None when empty)."""

    command: int
    ints: torch.Tensor | None = None
    floats: torch.Tensor | None = None


@dataclass
class NewSequence:
    """What ADD carries: the token positions ``start .. start+n-1`` of a sequence the speculator tracks (the whole
    sequence when ``start = 0`` and ``done``: prompt + first token) and ``aux``, float [n - done, W] of them or None.
    ``done``: the prompt is complete (its last token is the first sampled one)."""

    slot: int
    token_ids: list[int]
    params: SamplingParams
    seed: int
    aux: torch.Tensor | None = None
    start: int = 0
    done: bool = True


def _none_as(value, empty: int = -1) -> int:
    return empty if value is None else int(value)


def _as_none(word: int):
    return None if word < 0 else word


# ADD
def encode_add(seq: NewSequence) -> Message:
    ints = torch.tensor([seq.slot, seq.seed, seq.params.top_k, int(seq.params.greedy), seq.start, int(seq.done),
                         len(seq.token_ids), *seq.token_ids])
    floats = torch.tensor([seq.params.temperature, seq.params.top_p], dtype=torch.float64)
    if seq.aux is not None:
        floats = torch.cat([floats, seq.aux.detach().reshape(-1).to("cpu", torch.float64)])
    return Message(ADD, ints, floats)


def decode_add(msg: Message) -> NewSequence:
    slot, seed, top_k, greedy, start, done, n = msg.ints[:7].tolist()
    temperature, top_p = msg.floats[:2].tolist()
    aux = msg.floats[2:].clone().view(n - done, -1) if msg.floats.numel() > 2 else None
    params = SamplingParams(temperature=0.0 if greedy else temperature, top_p=top_p, top_k=top_k, max_tokens=1)
    return NewSequence(slot, msg.ints[7: 7 + n].tolist(), params, seed, aux, start, bool(done))


# PROPOSE
def encode_propose(requests: list) -> Message:
    """``requests``: :class:`~ssd_eagle.ssd.lookup.SpecRequest` rows (aux float [k + 1, W] or None)."""
    auxes = [r.aux for r in requests if r.aux is not None and r.num_accepted >= 0]
    width = auxes[0].shape[-1] if auxes else 0
    ints = [len(requests), width]
    for r in requests:
        ints += [r.slot, r.num_accepted, r.bonus, r.budget, r.rounds]
    for r in requests:
        ints += list(r.accepted or [])
    floats = None  # (one row's aux goes as it is: the channel copies it into its frame, in the link's dtype)
    if auxes:
        floats = auxes[0].detach().reshape(-1) if len(auxes) == 1 else \
            torch.cat([a.detach().reshape(-1).cpu() for a in auxes])
    return Message(PROPOSE, torch.tensor(ints, dtype=torch.long), floats)


def decode_propose(msg: Message, aux: bool = True) -> list:
    """``aux=False``: the rows without their aux states (no tensor op: all a reply needs to be looked up)."""
    from ssd_eagle.ssd.lookup import SpecRequest

    values = msg.ints.tolist()
    rows, width = values[:2]
    fields = [values[2 + 5 * i: 7 + 5 * i] for i in range(rows)]
    cursor, offset, requests, with_aux = 2 + 5 * rows, 0, [], aux
    for slot, k, bonus, budget, rounds in fields:
        aux = None
        if with_aux and width and k >= 0:
            aux = msg.floats[offset: offset + (k + 1) * width].clone().view(k + 1, width)
            offset += (k + 1) * width
        accepted = values[cursor: cursor + max(k, 0)]
        cursor += max(k, 0)
        requests.append(SpecRequest(slot, k, bonus, budget, aux, accepted, rounds))
    return requests


# REPLY
def _q_support(proposals: list[Proposal]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """(support int64 [n]: the target ids where some q of the reply is nonzero, ascending; every q on it [m, n]),
    or None when no proposal has a q (then no tensor op at all). The q of a drafter with its own vocabulary
    (``q_ids``, one tensor for the whole speculator) is taken over its columns without a scatter."""
    with_q = [p for p in proposals if p.q is not None]
    if not with_q:
        return None
    ids = with_q[0].q_ids
    if all(p.q_ids is ids for p in with_q):  # one column set: the support is the columns used
        used = torch.cat([p.q for p in with_q]).ne(0).any(0)
        cols = used.nonzero().view(-1)
        support = cols if ids is None else ids.to(cols.device)[cols]
        if support.numel() > 1 and not bool((support[1:] > support[:-1]).all()):  # (a vocabulary in any order)
            support, order = support.sort()
            cols = cols[order]
        return support.cpu(), [p.q.index_select(1, cols) for p in with_q]
    parts = []  # mixed column sets: each q's nonzero columns as target ids, merged
    for p in with_q:
        cols = p.q.ne(0).any(0).nonzero().view(-1)
        parts.append((cols if p.q_ids is None else p.q_ids.to(cols.device)[cols], p.q.index_select(1, cols)))
    support = torch.unique(torch.cat([t.cpu() for t, _ in parts]))
    qs = []
    for target_ids, values in parts:
        q = values.new_zeros(values.shape[0], support.numel())
        q[:, torch.searchsorted(support, target_ids.cpu()).to(q.device)] = values
        qs.append(q)
    return support, qs


def encode_reply(proposals: list[Proposal]) -> Message:
    found = _q_support(proposals)
    support, qs = found if found is not None else (None, [])
    rows = []
    for p in proposals:
        is_tree = p.parents is not None
        power = None if p.fanout_power is None else round(p.fanout_power * 1e6)
        backup = None if p.backup is None else BACKUPS.index(p.backup)
        rows += [_none_as(p.cache_hit), _none_as(p.lookup_k), _none_as(p.fanout), _none_as(power), _none_as(backup),
                 len(p.tokens), int(p.q is not None), int(is_tree), *p.tokens, *(p.parents if is_tree else [])]
    # the support (a draft vocabulary: thousands of ids) joins as a tensor, never as Python ints (0.75 -> 0.2 ms)
    ints = torch.tensor([len(proposals), 0 if support is None else support.numel()] + rows, dtype=torch.long)
    if support is not None:
        ints = torch.cat([ints[:2], support.to(device="cpu", dtype=torch.long), ints[2:]])
    floats = torch.cat([q.reshape(-1).cpu() for q in qs]) if qs else None
    return Message(REPLY, ints, floats)


def decode_reply(msg: Message, vocab_size: int) -> list[Proposal]:
    """``vocab_size``: V. A q comes back on the reply's support, ``q`` [m, n] with ``q_ids`` the support (every
    other token's probability is exactly 0; :meth:`~ssd_eagle.drafters.base.Proposal.dense_q` gives [m, V]).

    Raises:
        ValueError: a support id outside [0, V) (a speculator serving another vocabulary)."""
    num_rows, n = msg.ints[:2].tolist()
    support = msg.ints[2: 2 + n].clone()
    values = msg.ints[2 + n:].tolist()  # (the rows only: the support stays a tensor)
    if n and not 0 <= int(support[0]) <= int(support[-1]) < vocab_size:  # (sorted: first and last bound it)
        raise ValueError(f"reply q support [{int(support[0])}, {int(support[-1])}] outside the vocabulary "
                         f"[0, {vocab_size})")
    proposals, cursor, offset = [], 0, 0
    for _ in range(num_rows):
        hit, lookup_k, fanout, power, backup, m, has_q, is_tree = values[cursor: cursor + 8]
        cursor += 8
        tokens = values[cursor: cursor + m]
        cursor += m
        parents = None
        if is_tree:
            parents = values[cursor: cursor + m]
            cursor += m
        q = None
        if has_q:
            q = msg.floats[offset: offset + m * n].clone().view(m, n)
            offset += m * n
        hit = _as_none(hit)
        power = _as_none(power)
        proposals.append(Proposal(tokens, q, None if hit is None else bool(hit), _as_none(lookup_k), parents,
                                  fanout=_as_none(fanout), fanout_power=None if power is None else power / 1e6,
                                  backup=None if backup < 0 else BACKUPS[backup], q_ids=support if has_q else None))
    return proposals


# REMOVE
def encode_remove(slot: int) -> Message:
    return Message(REMOVE, torch.tensor([slot]))


def decode_remove(msg: Message) -> int:
    return int(msg.ints[0])


# STATS (the reply; the request is ``Message(STATS)``)
_CHOICE_FIELDS = (("tokens", SOURCES, 1e6), ("hit_tokens", SOURCES, 1e6), ("next_hit", SOURCES, 1e6),
                  ("verify", SOURCES, 1e9), ("seconds", BACKUPS, 1e9))  # (BackupChoice attribute, keys, scale)
_CHOICE_WORDS = sum(len(keys) for _, keys, _ in _CHOICE_FIELDS) + len(BACKUPS)


def _choice_words(choice: BackupChoice | None) -> list[int]:
    if choice is None:
        return [0] + [-1] * (_CHOICE_WORDS - len(BACKUPS)) + [0] * len(BACKUPS)
    words = [1]
    for name, keys, scale in _CHOICE_FIELDS:
        values = getattr(choice, name)
        words += [-1 if values[k] is None else round(values[k] * scale) for k in keys]
    return words + [choice.chosen[b] for b in BACKUPS]


def _choice_of(words: list[int]) -> dict | None:
    """The :meth:`BackupChoice.summary` of the words :func:`_choice_words` wrote (None: no choice was sent)."""
    if not words[0]:
        return None
    choice, i = BackupChoice(), 1
    for name, keys, scale in _CHOICE_FIELDS:
        getattr(choice, name).update({k: None if w < 0 else w / scale for k, w in zip(keys, words[i: i + len(keys)])})
        i += len(keys)
    choice.chosen.update(zip(BACKUPS, words[i:]))
    return choice.summary()


def encode_stats(stats, intervals: list[float], choice: BackupChoice | None = None) -> Message:
    """``stats``: a :class:`~ssd_eagle.ssd.lookup.SpeculatorStats`; ``intervals``: wall-clock build
    start/end pairs in seconds (``time.time()``); ``choice``: the speculator's backup choice (decoded into
    ``stats.backup``)."""
    ns = [round(x * 1e9) for x in (stats.build_time, *intervals)]
    power = -1 if stats.fanout_power is None else round(stats.fanout_power * 1e6)
    return Message(STATS, torch.tensor([stats.lookups, stats.hits, stats.builds, stats.backup_forwards,
                                        stats.interrupted, power, *_choice_words(choice), len(stats.bonus_ranks),
                                        *stats.bonus_ranks, *ns], dtype=torch.long))


def decode_stats(msg: Message):
    """``(SpeculatorStats, intervals in seconds)``."""
    from ssd_eagle.ssd.lookup import SpeculatorStats

    values = msg.ints.tolist()
    lookups, hits, builds, backup_forwards, interrupted, power = values[:6]
    head = 6 + 1 + _CHOICE_WORDS
    n = values[head]
    build_ns, *intervals = values[head + 1 + n:]
    stats = SpeculatorStats(lookups, hits, values[head + 1: head + 1 + n], build_ns / 1e9, builds, backup_forwards,
                            interrupted, None if power < 0 else power / 1e6, _choice_of(values[6: head]))
    return stats, [x / 1e9 for x in intervals]
