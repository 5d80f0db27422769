"""Which requests run in an engine step: admission under a KV memory budget, and the step's token budget (vLLM's
scheduler with chunked prefill, reduced to what :class:`~ssd_eagle.engine.llm_engine.LLMEngine` needs).

Admission is first come, first served: the oldest waiting request gets the lowest free cache slot when one is
free and, under a KV budget, when the store it would need still fits. The target's store is ``rows x capacity``
positions (:class:`~ssd_eagle.kv_cache.KVCache`): rows up to the highest live slot, capacity the longest
*reservation* of a live request, ``prompt + max_tokens + one round`` (the last token and ``max_draft_tokens``
draft positions), so every admitted request has room to its worst case. The drafts' stores count against the same
budget (:class:`~ssd_eagle.kv_cache.DraftKV`: an EAGLE-3 head's one layer, a draft LM's layers, an SSD
speculator's store in its own process with a round's branches past the text), so the budget bounds the server's
and the speculator's KV memory together. Cached prefix blocks count against the budget too and are evicted before
a request is made to wait; a request that cannot fit even alone is refused when it is added.

Each step has a token budget, ``max_num_batched_tokens``: every decoding request's round (one token plus up to
``max_draft_tokens`` drafts) counts first, and what is left goes to prompt chunks of the prefilling requests, in
admission order, at most ``prefill_chunk`` tokens each, so a long prompt is prefilled a chunk per step while the
running requests keep their rounds. A request whose prompt completes joins that step's round, so a step may pass
the budget by that request's round. The drafter prefills the same chunks after the target (an SD draft's forward,
an SSD speculator's ADD message), so the budget bounds a step's draft prefill too; a prompt prefix reused from the
prefix cache is not prefilled by the target, but the drafter catches up on it in chunks of the same budget
(:func:`~ssd_eagle.prefix_cache.feed_reused_prefix`) before the rest of the prompt is prefilled. The drafts' stores
follow the same :meth:`Scheduler.store_shape` (:meth:`~ssd_eagle.kv_cache.KVCache.fit`).
"""

from __future__ import annotations

from collections import deque

from ssd_eagle.engine.sequence import Sequence, SequenceStatus
from ssd_eagle.kv_cache import DraftKV, KVCache
from ssd_eagle.prefix_cache import PrefixCache

GIB = 2**30
POSITION_GRANULARITY = 256  # the store's capacity grows in multiples of this many positions (see KVCache.reserve)
SHRINK_BELOW = 0.75  # without a KV budget, the target's store shrinks when the live requests need at most this share


class Scheduler:
    """Waiting and running requests, their slots, and the two budgets.

    Args:
        max_num_seqs: requests running together (cache slots ``0 .. max_num_seqs-1``).
        max_num_batched_tokens: tokens one step may forward (rounds first, then prompt chunks).
        prefill_chunk: most prompt tokens of one request per step.
        tokens_per_round: most tokens a running request's round forwards (1 + most draft tokens).
        max_len: the most positions a slot can hold.
        bytes_per_position: bytes of one position of one slot in the target's store.
        kv_cache_memory: the KV budget in GiB (the target's and the drafts' stores plus cached prefixes), or None
            for no budget.
        draft_kv: the drafts' store geometry (counted against the budget), or None (no draft store).

    Raises:
        ValueError: a non-positive ``max_num_batched_tokens``, ``prefill_chunk`` or ``kv_cache_memory``.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk: int, tokens_per_round: int,
                 max_len: int, bytes_per_position: int, kv_cache_memory: float | None = None,
                 draft_kv: DraftKV | None = None):
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens), ("prefill_chunk", prefill_chunk),
                            ("kv_cache_memory", 1 if kv_cache_memory is None else kv_cache_memory)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.tokens_per_round = tokens_per_round
        self.max_len = max_len
        self.bytes_per_position = bytes_per_position
        self.draft_kv = draft_kv or DraftKV(0)
        self.budget = int(kv_cache_memory * GIB) if kv_cache_memory is not None else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest slot first

    # the KV budget
    def reservation(self, seq: Sequence, slack: int | None = None) -> int:
        """Positions ``seq`` may ever write in the target's store: prompt + max_tokens + one round, rounded up to
        the store's growth step (at most ``max_len``); in a draft's store (``slack`` given) + the larger of one round
        and ``slack`` (at most ``max_len + slack``)."""
        extra = self.tokens_per_round if slack is None else max(self.tokens_per_round, slack)
        need = seq.num_prompt_tokens + seq.params.max_tokens + extra
        return min(-(-need // POSITION_GRANULARITY) * POSITION_GRANULARITY, self.max_len + (slack or 0))

    def store_shape(self) -> tuple[int, int]:
        """(rows, capacity) the target's store needs for the running requests (at least one row and one step)."""
        rows = max((s.slot for s in self.running), default=0) + 1
        capacity = max((self.reservation(s) for s in self.running), default=POSITION_GRANULARITY)
        return rows, min(capacity, self.max_len)

    def prefill_positions(self) -> int:
        """Positions the prompts being prefilled will fill: the longest one's and a round (0: none)."""
        return max((s.num_prompt_tokens + self.tokens_per_round for s in self.running if s.prefilling), default=0)

    def reserved_bytes(self, extra: Sequence | None = None, slot: int = -1) -> tuple[int, int]:
        """(target, drafts): bytes the target's store and the drafts' stores reserve for the running requests, and
        ``extra`` in ``slot`` when given: rows up to the highest slot, each store's capacity its longest
        :meth:`reservation` (the drafts' from their :class:`~ssd_eagle.kv_cache.DraftKV` geometry)."""
        seqs = self.running + ([extra] if extra is not None else [])
        rows = max([s.slot for s in self.running] + [slot, 0]) + 1
        target = min(max((self.reservation(s) for s in seqs), default=POSITION_GRANULARITY), self.max_len)
        draft = max((self.reservation(s, self.draft_kv.slack) for s in seqs), default=POSITION_GRANULARITY)
        return (rows * target * self.bytes_per_position,
                rows * draft * self.draft_kv.bytes_per_position)

    def fit(self, kv: KVCache, prefixes: PrefixCache | None, resize: bool = True) -> tuple[int, int]:
        """Resize the target's store ``kv`` to the running requests (unless ``resize`` is False: CUDA graphs pin
        its addresses; :meth:`KVCache.fit`), growing it at once to the :meth:`prefill_positions` (a long prompt's
        chunks would each regrow, so copy, the whole store), and trim ``prefixes`` to what the KV budget leaves.
        Without a KV budget the store shrinks only when that frees a quarter of it (``KVCache.fit``'s
        ``shrink_below``), so a full batch does not copy its store at every request that ends. Returns the
        :meth:`store_shape` (the drafts' stores follow it too)."""
        rows, capacity = self.store_shape()
        if resize:  # a prompt being prefilled fills its length: the store grows to it once, not a chunk at a time
            kv.fit(rows, capacity, shrink_below=SHRINK_BELOW if self.budget is None else 1.0)
            kv.reserve(min(self.prefill_positions(), capacity))
        if prefixes is not None and self.budget is not None:
            prefixes.make_room(self.budget - sum(self.reserved_bytes()))
        return rows, capacity

    def max_new_tokens(self, num_prompt_tokens: int) -> int | None:
        """The largest ``max_tokens`` whose reservations alone (target and drafts) fit the KV budget (may be < 1),
        or None when the budget bounds nothing below ``max_len``."""
        per_position = self.bytes_per_position + self.draft_kv.bytes_per_position
        if self.budget is None or self.budget // per_position >= self.max_len:
            return None
        positions = self.budget // per_position // POSITION_GRANULARITY * POSITION_GRANULARITY
        return positions - num_prompt_tokens - max(self.tokens_per_round, self.draft_kv.slack)

    def check_fits(self, seq: Sequence) -> None:
        """Raises ValueError (naming ``max_tokens`` and ``kv_cache_memory``) when ``seq`` alone would not fit."""
        if self.budget is None:
            return
        target = self.reservation(seq) * self.bytes_per_position
        draft = self.reservation(seq, self.draft_kv.slack) * self.draft_kv.bytes_per_position
        if target + draft > self.budget:
            drafts = f" (target {target / GIB:.3g} GiB + drafts {draft / GIB:.3g} GiB)" if draft else ""
            raise ValueError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) needs "
                f"{(target + draft) / GIB:.3g} GiB of KV cache{drafts}, more than kv_cache_memory "
                f"({self.budget / GIB:.3g} GiB)")

    def _fits(self, seq: Sequence, slot: int, prefixes: PrefixCache | None) -> bool:
        if self.budget is None:
            return True
        need = sum(self.reserved_bytes(seq, slot))
        if need > self.budget:
            return False
        if prefixes is not None:
            prefixes.make_room(self.budget - need)
        return True

    # admission and release
    def admit(self, prefixes: PrefixCache | None = None) -> list[Sequence]:
        """Move waiting requests into free slots, oldest first, while the KV budget allows; returns them."""
        admitted = []
        while self.waiting and self._free_slots and self._fits(self.waiting[0], self._free_slots[-1], prefixes):
            seq = self.waiting.popleft()
            seq.slot = self._free_slots.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def remove(self, seq: Sequence) -> None:
        """Forget ``seq`` (waiting or running); a running request's slot is freed."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
            self._free_slots.sort(reverse=True)
            seq.slot = -1

    # the token budget
    def prefill_chunks(self, num_decoding: int) -> list[tuple[Sequence, int]]:
        """This step's prompt chunks ``(request, tokens)`` once ``num_decoding`` rounds have taken their share."""
        budget = self.max_num_batched_tokens - num_decoding * self.tokens_per_round
        chunks = []
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.prefilling:
                continue
            end = seq.num_reused if seq.num_cached < seq.num_reused else seq.num_prompt_tokens  # (a drafter's catch-up)
            n = min(end - seq.num_cached, self.prefill_chunk, budget)
            chunks.append((seq, n))
            budget -= n + (self.tokens_per_round if n == seq.num_prompt_tokens - seq.num_cached else 0)
        return chunks
