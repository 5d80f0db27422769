"""Automatic prefix caching: the target's keys/values of prompt prefixes, reused by later requests that share them
(a system prompt, the earlier turns of a conversation).

As in vLLM's automatic prefix caching, tokens are cut into blocks of ``block_size`` and block i is keyed by a hash
chained over blocks ``0 .. i`` (SHA-256 of the previous key and the block's token ids), so a key names the whole
prefix up to the block's end and two requests share a block only when they agree on every token before it. A
block holds, for its positions, the keys and values of every layer and, when the drafter needs them (EAGLE-3), the
target's aux hidden states: a drafter's ``add_sequence`` takes the aux states of the whole prompt, cached part
included.

The cache is bounded in bytes and evicts least recently used blocks first. Under a KV budget
(``kv_cache_memory``) its blocks count against that budget too, as vLLM's cached blocks live in the KV pool: the
scheduler hands it the room the live requests leave (:meth:`PrefixCache.make_room`), so cached prefixes are the
first to go when live requests need memory, and a save never holds more than that room. A lookup or insert
refreshes a chain from its tail to its head, so a prefix's first block is always more recent than its later ones
and eviction cuts chains from the tail, never orphaning a tail whose head is gone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ssd_eagle.drafters.base import Drafter
from ssd_eagle.kv_cache import KVCache


@dataclass
class Block:
    """One cached block.

    Attributes:
        kv: ``[num_layers, 2, kv_heads, block_size, head_dim]`` keys (0) and values (1), as
            :meth:`KVCache.read` returns them.
        aux: float ``[block_size, 3 * H]`` aux hidden states of the block's positions, or None.
    """

    kv: torch.Tensor
    aux: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.aux.nbytes if self.aux is not None else 0)


class PrefixCache:
    """A bounded LRU map from chained block hashes to cached blocks.

    Args:
        max_bytes: the most bytes its blocks may hold (keys, values and aux states).
        block_size: tokens per block.

    Raises:
        ValueError: ``block_size`` < 1 or ``max_bytes`` < 0.
    """

    def __init__(self, max_bytes: int, block_size: int = 64):
        if block_size < 1 or max_bytes < 0:
            raise ValueError(f"block_size must be >= 1 and max_bytes >= 0, got {block_size} and {max_bytes}")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.room: int | None = None  # what the KV budget leaves the cache (None: no budget), see make_room

    @property
    def bound(self) -> int:
        """The most bytes the cache may hold now: ``max_bytes``, or less when the KV budget leaves less room."""
        return self.max_bytes if self.room is None else max(0, min(self.max_bytes, self.room))

    def __len__(self) -> int:
        return len(self.blocks)

    def hashes(self, tokens: list[int]) -> list[bytes]:
        """Chained keys of the full blocks of ``tokens`` (a trailing partial block has none)."""
        keys, key = [], b""
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            key = hashlib.sha256(key + array("q", tokens[start: start + self.block_size]).tobytes()).digest()
            keys.append(key)
        return keys

    def load(self, tokens: list[int], kv: KVCache, slot: int) -> tuple[int, torch.Tensor | None]:
        """Copy the longest cached prefix of ``tokens`` into positions ``0 ..`` of ``slot``.

        Returns:
            (cached tokens n, a multiple of ``block_size``; their aux states ``[n, 3H]`` or None).
        """
        blocks = []
        for key in self.hashes(tokens):
            block = self.blocks.get(key)
            if block is None:
                break
            blocks.append((key, block))
        if not blocks:
            return 0, None
        self._refresh([key for key, _ in blocks])
        kv.write(slot, 0, torch.cat([b.kv for _, b in blocks], dim=3))
        aux = [b.aux for _, b in blocks]
        return len(blocks) * self.block_size, torch.cat(aux) if all(a is not None for a in aux) else None

    def save(self, tokens: list[int], kv: KVCache, slot: int, aux: torch.Tensor | None) -> None:
        """Cache the full blocks of ``tokens``, whose keys/values are positions ``0 .. len(tokens)-1`` of ``slot``
        (and whose aux states are ``aux[: len(tokens)]`` when given); blocks already cached are only refreshed.
        Evicts least recently used blocks to stay within ``max_bytes``."""
        keys = self.hashes(tokens)
        new = [i for i, key in enumerate(keys) if key not in self.blocks]
        if new and self.bound > 0:
            bs, first = self.block_size, new[0]
            data = kv.read(slot, first * bs, len(keys) * bs)
            for i in new:
                part = slice((i - first) * bs, (i - first + 1) * bs)
                block = Block(data[:, :, :, part].clone(), aux[i * bs: (i + 1) * bs].clone() if aux is not None
                              else None)
                self.blocks[keys[i]] = block
                self.nbytes += block.nbytes
        self._refresh([key for key in keys if key in self.blocks])
        self.evict(self.bound)

    def reuse(self, seq, kv: KVCache, needs_aux: bool, drafter=None) -> None:
        """Copy the longest cached prefix of ``seq``'s prompt but its last token (whose logits give the first output
        token) into its slot: ``seq.num_reused`` is its length and ``seq.prompt_aux`` its aux states (when
        ``needs_aux``). A ``drafter`` with a ``prefill`` of its own (a draft store: the drafts have no prefix cache)
        must first catch up on it: ``seq.num_cached`` then stays 0 and the engine's prompt chunks over the reused
        positions go to the drafter alone (:func:`feed_reused_prefix`), within the step's token budget like any
        prefill; otherwise ``seq.num_cached`` is the reused length at once."""
        n, aux = self.load(seq.token_ids[: seq.num_prompt_tokens - 1], kv, seq.slot)
        own_prefill = getattr(getattr(drafter, "prefill", None), "__func__", Drafter.prefill)  # wrappers delegate
        drafts = drafter is not None and drafter.healthy and own_prefill is not Drafter.prefill
        seq.num_reused, seq.num_cached = n, 0 if drafts else n
        seq.prompt_aux = [aux] if needs_aux and n else []

    def save_sequence(self, seq, kv: KVCache, needs_aux: bool) -> None:
        """Offer the committed tokens of ``seq`` (an engine :class:`~ssd_eagle.engine.sequence.Sequence` in cache
        slot ``seq.slot`` of ``kv``; the prompt only when ``needs_aux``: the aux states of an output are not
        kept) to the cache."""
        n = min(seq.num_cached, len(seq.token_ids))
        aux = torch.cat(seq.prompt_aux) if needs_aux and seq.prompt_aux else None
        if needs_aux:
            n = min(n, len(aux) if aux is not None else 0)
        self.save(seq.token_ids[:n], kv, seq.slot, aux)

    def make_room(self, room: int) -> None:
        """The KV budget leaves ``room`` bytes to cached prefixes: evict down to it (least recently used first)
        and keep later saves within it."""
        self.room = room
        self.evict(self.bound)

    def evict(self, max_bytes: int) -> None:
        """Drop least recently used blocks until at most ``max_bytes`` are held."""
        while self.nbytes > max_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.nbytes -= block.nbytes

    def _refresh(self, chain: list[bytes]) -> None:
        for key in reversed(chain):  # the head ends most recent: eviction takes tails first
            self.blocks.move_to_end(key)


def feed_reused_prefix(seq, n: int, call_drafter) -> bool:
    """When ``seq``'s drafter is catching up on its reused prefix (:meth:`PrefixCache.reuse`), hand it the next
    ``n`` positions (``call_drafter("prefill", seq, aux)``, the engine's guarded call; the target holds them
    already) and return True; False for an ordinary prompt chunk (``seq.num_cached >= seq.num_reused``)."""
    if seq.num_cached >= seq.num_reused:
        return False
    seq.num_cached += n
    call_drafter("prefill", seq, [seq.prompt_aux[0][: seq.num_cached]] if seq.prompt_aux else None)
    return True
