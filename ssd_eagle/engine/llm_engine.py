"""The step-based decoding engine: requests in, rounds of draft-then-verify, outputs out.

``add_request`` queues a request; each ``step`` admits waiting requests into free cache slots, prefills prompt
chunks within the step's token budget (:mod:`ssd_eagle.engine.scheduler`; the drafter prefills each chunk after
the target, and the chunk that completes a prompt samples its first token), then runs one round for every running
request together: the drafter proposes up to K tokens per request, the target scores ``[last token, drafts]`` of
all rows in one batched forward, and verification keeps the longest acceptable prefix plus a bonus token
(:mod:`ssd_eagle.verify`). Autoregressive decoding is the same loop with no drafter (K = 0). A prompt prefix whose
keys/values are in the prefix cache (:mod:`ssd_eagle.prefix_cache`) is copied into the slot instead of prefilled.
The target's store and the drafts' (``Drafter.fit_kv``) are resized to the live requests after every step, so
their memory follows them, not the longest request ever seen. Stopping rules are applied token by token, so
nothing past an EOS, a stop string, ``max_tokens`` or ``max_model_len`` is ever emitted, even inside an accepted
block.

A drafter that raises is marked unhealthy (``drafter.healthy = False``) and never called again: every request
continues with ordinary decoding, losing nothing. Greedy rows are verified by argmax match, sampled rows by rejection sampling with the exact q the drafter sampled
from; one batch may mix them. Every sequence carries its own random generators, so a seeded request reproduces
its output regardless of what else is in the batch.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque

import torch

from ssd_eagle.drafters.base import Drafter, Proposal
from ssd_eagle.engine.detokenizer import IncrementalDetokenizer
from ssd_eagle.engine.scheduler import GIB, Scheduler
from ssd_eagle.engine.sequence import RequestOutput, Sequence, SequenceStatus, TokenLogprob
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner, RunnerOutput
from ssd_eagle.prefix_cache import PrefixCache, feed_reused_prefix
from ssd_eagle.sampling import SamplingTensors, logits_to_probs, sample
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.stats import SpecStats
from ssd_eagle.verify import (chain_acceptance_probs, greedy_verify, rejection_verify, tree_child_probs,
                              tree_verify)

log = logging.getLogger(__name__)


class LLMEngine:
    """Decodes many requests together with an optional drafter.

    Args:
        model: the target transformers causal LM (already on its device, in its dtype).
        tokenizer: the target's tokenizer.
        drafter: a :class:`Drafter`, or None for autoregressive decoding.
        num_speculative_tokens: K, most draft tokens per round (ignored without a drafter).
        max_num_seqs: requests decoded together.
        max_model_len: longest prompt + output (default: the target's ``max_position_embeddings``).
        eos_token_ids: ids that end a request (default: the model's generation config and tokenizer EOS ids).
        seed: seeds the generators of requests that bring no seed.
        prefill_chunk: most prompt tokens of one request per step.
        max_draft_tokens: most draft tokens (tree nodes) in one proposal (default: K).
        cuda_graphs: on a CUDA target, capture verification forwards as CUDA graphs (``--eager`` turns them off;
            see :mod:`ssd_eagle.cuda_graphs`). Ignored on CPU.
        compile: ``torch.compile`` the target's decoder body (see :class:`~ssd_eagle.model_runner.ModelRunner`).
        max_num_batched_tokens: tokens one step forwards: the rounds of running requests first, then prompt
            chunks (vLLM's chunked prefill; see :mod:`ssd_eagle.engine.scheduler`).
        enable_prefix_caching: reuse cached keys/values (and aux states) of prompt prefixes, in blocks of 64 tokens.
        prefix_cache_memory: GiB the prefix cache may hold (and no more than the KV budget leaves; 64 MiB keeps a
            long request's RSS within 1.1x of a warm server's: scripts/bench_prefill.py rss).
        kv_cache_memory: GiB budget of the target's KV store, the drafts' (``drafter.kv_geometry``) and the prefix
            cache (None: unbounded). Admission reserves prompt + max_tokens + one round per request in each store;
            requests that do not fit now wait.

    Raises:
        ValueError: a non-positive ``max_num_batched_tokens``, ``prefill_chunk`` or ``kv_cache_memory``.
    """

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, num_speculative_tokens: int = 5,
                 max_num_seqs: int = 8, max_model_len: int | None = None, eos_token_ids: set[int] | None = None,
                 seed: int = 0, prefill_chunk: int = 512, max_draft_tokens: int | None = None,
                 cuda_graphs: bool = True, compile: bool = False, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True, prefix_cache_memory: float = 0.0625,
                 kv_cache_memory: float | None = None):
        from ssd_eagle.assets import eos_token_ids as model_eos_ids

        self.tokenizer = tokenizer
        self.drafter = drafter
        self.K = num_speculative_tokens if drafter is not None else 0
        self.max_draft_tokens = max(max_draft_tokens or 0, self.K)
        self.mode_name = "ar" if drafter is None else f"{getattr(drafter, 'mode', 'sd')}:{drafter.name}"
        cfg = model.config.get_text_config()
        self.vocab_size = cfg.vocab_size
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids is not None else model_eos_ids(model, tokenizer)
        aux_ids = getattr(drafter, "aux_layer_ids", None) if drafter is not None and drafter.needs_aux_hidden \
            else None
        # one slot more than sequences: the scratch row of fixed-shape (CUDA-graph) batches; one round (the last
        # token and every draft node) past the text
        self.target = ModelRunner(model, max_num_seqs + 1, self.max_model_len + self.max_draft_tokens + 1, aux_ids,
                                  compile=compile, ragged_attention=True)
        self.needs_aux = aux_ids is not None
        self.static = None
        if cuda_graphs and self.target.device.type == "cuda":
            from ssd_eagle.cuda_graphs import StaticForward, runner_forward_fn

            widths = {1, self.K + 1, self.max_draft_tokens + 1}
            if self.max_draft_tokens > self.K and getattr(drafter, "mode", "sd") == "sd":  # an SD tree's sizes
                from ssd_eagle.planner import tree_size_ladder

                widths |= {n + 1 for n in tree_size_ladder(self.max_draft_tokens)}
            self.static = StaticForward(runner_forward_fn(self.target, self.needs_aux), self.target.kv,
                                        scratch_slot=max_num_seqs, dtype=self.target.dtype,
                                        device=self.target.device, widths=sorted(widths),
                                        buckets=[b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_num_seqs]
                                        + [max_num_seqs])
        if not cuda_graphs and getattr(drafter, "backend", None) is not None:
            drafter.backend.use_fixed_shapes(False)  # --eager: the draft's steps stay dynamic too
        self._rng = random.Random(seed)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, prefill_chunk, 1 + self.max_draft_tokens,
                                   self.target.kv.max_len, self.target.kv.bytes_per_position, kv_cache_memory,
                                   getattr(drafter, "kv_geometry", None))
        self.prefix_cache = PrefixCache(int(prefix_cache_memory * GIB)) if enable_prefix_caching else None
        self._call_drafter("set_token_budget", max_num_batched_tokens)  # its lazy catch-ups' forwards
        self.requests: dict[str, Sequence] = {}
        self.stats = SpecStats()  # aggregate over all rounds (times counted once per batched round)
        self.planner = None  # a ssd_eagle.planner.Planner choosing each round's K (set by the engine factory)

    # public API
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request. ``prompt`` is text (tokenized with the tokenizer's special tokens) or token ids.

        Raises:
            ValueError: duplicate ``request_id``, empty ``prompt``, token ids out of the vocabulary, or
                ``prompt`` tokens + ``max_tokens`` over ``max_model_len``, or a request that alone needs more KV
                memory than ``kv_cache_memory``.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt).input_ids
        else:
            text, ids = None, [int(t) for t in prompt]
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
        device = self.target.device
        seq = Sequence(
            request_id=request_id, prompt=text, token_ids=list(ids), num_prompt_tokens=len(ids), params=params,
            generator=torch.Generator(device).manual_seed(seed),
            draft_generator=torch.Generator(device).manual_seed(seed ^ 0x5DEECE66D),
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                               params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None,
        )
        self.scheduler.check_fits(seq)
        self.requests[request_id] = seq
        self.waiting.append(seq)

    def close(self) -> None:
        """Release the drafter's resources (an SSD speculator process and its link). Idempotent."""
        if self.drafter is not None:
            self.drafter.close()

    def abort(self, request_id: str) -> None:
        """Stop a request now; its slot is freed and it is reported no more. Unknown ids are ignored."""
        seq = self.requests.get(request_id)
        if seq is None:
            return
        seq.finish_reason = "abort"
        seq.status = SequenceStatus.FINISHED
        self._release(seq)
        self._fit_kv()

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def kv_cache_usage(self) -> tuple[int, int | None]:
        """(bytes the target's KV store, the drafts' stores (reserved for the live requests) and the prefix cache
        hold now, the ``kv_cache_memory`` budget or None)."""
        cached = self.prefix_cache.nbytes if self.prefix_cache is not None else 0
        return self.target.kv.nbytes + self.scheduler.reserved_bytes()[1] + cached, self.scheduler.budget

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, prefill prompt chunks within the token budget, run one round for every running
        request whose prompt is cached, and report every request that advanced."""
        self._admit()
        decoding = [s for s in self.running if not s.prefilling and not s.finished]
        ready = self._prefill(self.scheduler.prefill_chunks(len(decoding)))
        # in slot order: a batch whose slots form a range reads the cache as views instead of gathering it
        live = sorted((s for s in decoding + ready if not s.finished), key=lambda s: s.slot)
        if live:
            self._round(live)
        touched = ready + [s for s in live if s not in ready]
        outputs = [seq.report() for seq in touched]
        for seq in touched:
            if seq.finished:
                self._release(seq)
        self._fit_kv()
        return outputs

    # scheduling
    def _admit(self) -> None:
        admitted = self.scheduler.admit(self.prefix_cache)
        if not admitted:
            return
        self._fit_kv()
        if self._reuses_prefixes:  # (a drafter then catches up on the reused prefix chunk by chunk: _prefill)
            for seq in admitted:
                self.prefix_cache.reuse(seq, self.target.kv, self.needs_aux, self.drafter)

    @property
    def _local_target(self) -> bool:
        # a tensor-parallel driver's worker ranks hold their own shards: copies and resizes of rank 0's store
        # would not reach them
        return isinstance(self.target, ModelRunner)

    @property
    def _reuses_prefixes(self) -> bool:
        return self.prefix_cache is not None and self._local_target

    def _fit_kv(self) -> None:  # (CUDA graphs pin the store's addresses); the drafts' stores follow the target's
        shape = self.scheduler.fit(self.target.kv, self.prefix_cache, self.static is None and self._local_target)
        self._call_drafter("fit_kv", *shape)

    def _release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            if self._reuses_prefixes:
                self.prefix_cache.save_sequence(seq, self.target.kv, self.needs_aux)
            self._call_drafter("remove_sequence", seq)
        self.scheduler.remove(seq)
        if self.planner is not None:
            self.planner.forget(seq.request_id)
        seq.prompt_aux = []
        self.requests.pop(seq.request_id, None)

    def _call_drafter(self, method: str, *args, default=None):
        """Call the drafter unless it failed before; on an exception mark it unhealthy and return ``default``."""
        if self.drafter is None or not self.drafter.healthy:
            return default
        try:
            return getattr(self.drafter, method)(*args)
        except Exception as err:  # noqa: BLE001 - any drafter failure degrades to ordinary decoding
            log.exception("drafter %s failed in %s; continuing with ordinary decoding", self.drafter.name, method)
            self.drafter.healthy, self.drafter.error = False, f"{type(err).__name__}: {err}"
            return default

    # model work
    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Prefill the next ``n`` prompt tokens of each ``(seq, n)``; a request whose prompt is then cached samples
        its first token from the last prompt logits and is handed to the drafter. Returns those requests."""
        if not chunks:
            return []
        start = time.perf_counter()
        prefilled = [seq for seq, _ in chunks]
        chunks = [c for c in chunks if not feed_reused_prefix(*c, self._call_drafter)]  # (the drafter's catch-up)
        last_logits: dict[int, torch.Tensor] = {}
        max_len = self.target.kv.max_len
        while chunks:  # pad tokens of a short row write past its end: a row too close to max_len runs alone
            width = max(n for _, n in chunks)  # (rows are padded to the widest: a chunk under 3/4 of it waits for
            group = [c for c in chunks if 4 * c[1] >= 3 * width and c[0].num_cached + width <= max_len] \
                or chunks[:1]  # a forward of its own, padding costs as much as tokens)
            chunks = [c for c in chunks if all(c[0] is not seq for seq, _ in group)]
            seqs = [seq for seq, _ in group]
            tokens = [seq.token_ids[seq.num_cached: seq.num_cached + n] for seq, n in group]
            finishing = [seq.num_cached + n == seq.num_prompt_tokens for seq, n in group]
            batch = ForwardBatch.causal(tokens, [s.slot for s in seqs], [s.num_cached for s in seqs],
                                        self.target.dtype, self.target.device)
            index = torch.tensor([[n - 1] for _, n in group], device=self.target.device)
            out = self.target.forward(batch, logits_index=index, capture_aux=self.needs_aux,
                                      compute_logits=any(finishing))
            for row, (seq, n) in enumerate(group):
                if self.needs_aux:
                    seq.prompt_aux.append(out.aux_hidden[row, :n])
                if finishing[row]:
                    last_logits[id(seq)] = out.logits[row, 0]
                seq.num_cached += n
                if not finishing[row]:  # the drafter prefills chunk by chunk too (the last with add_sequence)
                    self._call_drafter("prefill", seq, seq.prompt_aux if self.needs_aux else None)
        elapsed = time.perf_counter() - start
        for seq in prefilled:
            seq.stats.prefill_time += elapsed
        ready = [seq for seq in prefilled if id(seq) in last_logits]
        for seq in ready:
            logits = last_logits[id(seq)][None]  # [1, V]
            if seq.params.greedy:
                token = int(logits.argmax(dim=-1))
            else:
                probs = logits_to_probs(logits, SamplingTensors.from_params([seq.params], logits.device))
                token = int(sample(probs, [seq.generator]))
            self._append(seq, [token], logits)
            if self.needs_aux:
                seq.prompt_aux = [torch.cat(seq.prompt_aux)]
            if self._reuses_prefixes:
                self.prefix_cache.save_sequence(seq, self.target.kv, self.needs_aux)
            if not seq.finished:
                self._call_drafter("add_sequence", seq, seq.prompt_aux[0] if self.needs_aux else None)
        return ready

    def _draft_budget(self, seq: Sequence) -> int:
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids))
        return max(0, min(self.K, room - 1))

    def _round(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        budgets = [self._draft_budget(s) for s in seqs]
        if self.planner is not None:
            budgets = self.planner.plan(seqs, budgets, self.stats)
            tree = getattr(self.planner, "tree_round", None)  # (a stand-in without it leaves the shape alone)
            if tree is not None:
                self._call_drafter("set_shape", tree)
        # called even with zero budgets: stateful drafters track every round
        proposals = self._call_drafter("propose", seqs, budgets) or [Proposal([]) for _ in seqs]
        proposals = [p.within(b, self.max_draft_tokens) for p, b in zip(proposals, budgets)]
        t1 = time.perf_counter()
        slots, starts = [s.slot for s in seqs], [s.num_cached for s in seqs]
        if any(p.parents is not None for p in proposals):
            parents = [p.parents if p.parents is not None else list(range(len(p.tokens))) for p in proposals]
            batch = ForwardBatch.tree([s.token_ids[-1] for s in seqs], [p.tokens for p in proposals], parents,
                                      slots, starts, self.target.dtype, self.target.device)
        else:
            batch = ForwardBatch.causal([[s.token_ids[-1]] + p.tokens for s, p in zip(seqs, proposals)], slots,
                                        starts, self.target.dtype, self.target.device)
        out = self._verify_forward(batch)
        paths, bonus, chances = self._verify(seqs, proposals, out.logits)
        t2 = time.perf_counter()
        self.stats.draft_time += t1 - t0
        self.stats.verify_time += t2 - t1
        if self.planner is not None:  # (the drafter's catch-up on skipped rounds is learnt apart from drafting)
            catch_up = getattr(self.drafter, "catch_up_seconds", 0.0) if self.drafter is not None else 0.0
            self.planner.observe_round(seqs, proposals, paths, t1 - t0, t2 - t1, catch_up,
                                       chances={seqs[i].request_id: chance for i, chance in chances.items()})
        for row, (seq, p) in enumerate(zip(seqs, proposals)):
            path = paths[row]
            k = len(path)
            if path != list(range(1, k + 1)):  # a tree branch: move its keys/values next to the prefix
                self.target.kv.compact(seq.slot, torch.tensor(path, device=self.target.device) + seq.num_cached,
                                       seq.num_cached + 1)
            keep = [0] + path
            emitted = self._append(seq, [p.tokens[j - 1] for j in path] + [bonus[row]], out.logits[row, keep])
            seq.num_cached += k + 1
            for stats in (seq.stats, self.stats):
                stats.record_round(len(p.tokens), k, emitted)
                if p.cache_hit is not None and budgets[row]:  # a planned-off round's cache answer goes unused
                    stats.record_lookup(p.lookup_k, p.cache_hit, emitted, t1 - t0, p.fanout, p.fanout_power, p.backup)
            seq.stats.draft_time += t1 - t0
            seq.stats.verify_time += t2 - t1
            if not seq.finished:
                self._call_drafter("on_verified", seq, k, out.aux_hidden[row, keep] if self.needs_aux else None)

    def _verify_forward(self, batch: ForwardBatch) -> RunnerOutput:
        """The target's forward over a round's tokens: a replayed CUDA graph when one covers the batch."""
        if self.static is not None:
            out = self.static(batch)
            if out is not None:
                return RunnerOutput(out["logits"], out.get("aux_hidden"), None)
        return self.target.forward(batch, capture_aux=self.needs_aux)

    def _verify(self, seqs: list[Sequence], proposals: list[Proposal],
                logits: torch.Tensor) -> tuple[list[list[int]], list[int], dict[int, list]]:
        """Accepted node path (1-based; a chain accepting k gives ``[1..k]``) and bonus token of every row, and for
        the sampled rows that drafted what the planner learns acceptance from, by row: a chain's chance that each
        tried draft was accepted (its first ``min(k + 1, n)``, :func:`~ssd_eagle.verify.chain_acceptance_probs`), a
        tree's target probability of each child at each depth tried (:func:`~ssd_eagle.verify.tree_child_probs`)."""
        B, n = logits.shape[:2]
        device = logits.device
        paths: list[list[int]] = [[] for _ in range(B)]
        bonus = [0] * B
        chances: dict[int, list] = {}
        trees = [i for i, p in enumerate(proposals) if p.parents is not None]
        chains = [i for i, p in enumerate(proposals) if p.parents is None]
        for i in trees:
            probs = None
            if not seqs[i].params.greedy:
                probs = logits_to_probs(logits[i: i + 1], SamplingTensors.from_params([seqs[i].params], device))[0]
            paths[i], bonus[i] = tree_verify(logits[i], proposals[i].tokens, proposals[i].parents, probs,
                                             seqs[i].generator)
            if probs is not None and self.planner is not None:
                chances[i] = tree_child_probs(probs, proposals[i].tokens, proposals[i].parents, paths[i])
        if not chains:
            return paths, bonus, chances
        drafts = torch.zeros(B, n - 1, dtype=torch.long)
        for row in chains:
            drafts[row, : len(proposals[row].tokens)] = torch.tensor(proposals[row].tokens, dtype=torch.long)
        drafts = drafts.to(device)
        num_draft = torch.tensor([len(p.tokens) for p in proposals], device=device)
        accepted = torch.zeros(B, dtype=torch.long, device=device)
        bonus_t = torch.zeros(B, dtype=torch.long, device=device)
        greedy = [i for i in chains if seqs[i].params.greedy]
        sampled = [i for i in chains if not seqs[i].params.greedy]
        chance = None  # the sampled rows' chances of acceptance per draft (with a planner)
        if greedy:
            accepted[greedy], bonus_t[greedy] = greedy_verify(logits[greedy], drafts[greedy], num_draft[greedy])
        if sampled:
            p = logits_to_probs(logits[sampled], SamplingTensors.from_params([seqs[i].params for i in sampled],
                                                                             device))
            q = None
            if any(proposals[i].q is not None for i in sampled):
                q = torch.zeros(len(sampled), n - 1, p.shape[-1], dtype=p.dtype, device=device)
                for j, i in enumerate(sampled):
                    prop = proposals[i]
                    if prop.q is not None:  # (over the drafter's own columns when it has q_ids: 0 elsewhere)
                        prop.dense_q(p.shape[-1], out=q[j, : len(prop.tokens)])
                    elif prop.tokens:  # deterministic proposal: point masses
                        q[j, torch.arange(len(prop.tokens)), drafts[i, : len(prop.tokens)]] = 1.0
            accepted[sampled], bonus_t[sampled] = rejection_verify(
                p, q, drafts[sampled], num_draft[sampled], [seqs[i].generator for i in sampled])
            if self.planner is not None:
                chance = chain_acceptance_probs(p, q, drafts[sampled]).tolist()
        accepted, bonus_t = accepted.tolist(), bonus_t.tolist()
        for i in chains:
            paths[i], bonus[i] = list(range(1, accepted[i] + 1)), bonus_t[i]
        for j, i in enumerate(sampled if chance is not None else []):
            tried = min(accepted[i] + 1, len(proposals[i].tokens))
            if tried:
                chances[i] = chance[j][:tried]
        return paths, bonus, chances

    # bookkeeping
    def _append(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> int:
        """Emit ``tokens`` one by one, applying every stopping rule; returns how many were emitted."""
        params = seq.params
        logprobs = torch.log_softmax(logits.float(), dim=-1) if seq.logprobs is not None else None
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if logprobs is not None:
                top = logprobs[i].topk(params.logprobs) if params.logprobs else None
                seq.logprobs.append(TokenLogprob(
                    token, float(logprobs[i, token]),
                    {int(t): float(v) for t, v in zip(top.indices, top.values)} if top is not None else {}))
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                self._finish(seq, "stop", token)
            elif seq.detokenizer.add_token(token):
                self._finish(seq, "stop", seq.detokenizer.stop_matched)
            elif seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                self._finish(seq, "length", None)
            if seq.finished:
                return i + 1
        return len(tokens)

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.detokenizer.flush()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.finish_time = time.monotonic()
