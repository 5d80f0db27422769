"""The verifier's wait on an SSD hit (issue 13 item 2): a hit replies with no draft work at all (the EAGLE-3 fuse of
the outcome's aux states waits for the build, after the reply), runs no torch op and frees no tensor before the
reply (the spent speculation cache is freed by the build), and when every row of a round is such a hit the
speculator process replies before committing the round (``Speculator.peek``, ``serve``); a miss fuses once, then
drafts. Greedy output stays the target's."""

from __future__ import annotations

import threading
import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import random_prompts, reference_greedy
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.client import SpeculatorLink
from ssd_eagle.ssd.worker import serve
from test_ssd_eagle3 import eagle_ssd_engine, target_and_head  # noqa: F401 - a fixture
from test_ssd_protocol import _pair


def test_an_eagle3_hit_replies_without_fusing_or_drafting(target_and_head, byte_tokenizer):  # noqa: F811
    target, head = target_and_head
    engine = eagle_ssd_engine(target, head, byte_tokenizer, max_num_seqs=1)  # one row a round: its own work
    speculator = engine.drafter.speculator.speculator
    backend = speculator.backend
    fused, work = [], {True: [], False: []}
    fuse, propose = backend.fuse, speculator.propose

    def counting_fuse(aux):
        fused.append(aux.shape[0])
        return fuse(aux)

    def counting_propose(requests):
        calls, forwards = len(fused), backend.forwards
        replies = propose(requests)
        for req, reply in zip(requests, replies):
            if reply.cache_hit is not None and req.budget:  # (the last round of a request may ask for none)
                work[reply.cache_hit].append((len(fused) - calls, backend.forwards - forwards))
        return replies

    backend.fuse, speculator.propose = counting_fuse, counting_propose
    prompts = [[t % 80 for t in q] for q in random_prompts(4, seed=3)]
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=14))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 14, eos=set())
    assert work[True] and work[False], "hits and misses must both occur"
    assert set(work[True]) == {(0, 0)}  # a hit: no fuse, no forward before the reply
    assert all(f == 1 and n > 0 for f, n in work[False])  # a miss fuses its features once, then drafts


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_eagle3_hit_runs_no_torch_op_and_frees_its_spent_cache_after_the_reply(target_and_head,
                                                                                    byte_tokenizer):  # noqa: F811
    target, head = target_and_head
    engine = eagle_ssd_engine(target, head, byte_tokenizer, max_num_seqs=1)
    speculator = engine.drafter.speculator.speculator
    propose, build = speculator.propose, speculator.build
    hits, spent, freed = [], [], []

    def watching_propose(requests):
        (req,) = requests
        seq = speculator.seqs[req.slot]
        tensors = [(x, weakref.ref(x.hidden)) for x in seq.cache.values() if x.hidden is not None]
        counter = _CountOps()
        with counter:
            replies = propose(requests)
        tensors = [ref for x, ref in tensors if x is not seq.proposal]  # (the hit's proposal is the next build's)
        cached = replies[0].cache_hit and req.budget >= speculator.K  # (a shorter budget slices the cached chain)
        if cached:
            hits.append(counter.ops)
        spent.append((tensors, cached))
        return replies

    def watching_build(*args, **kwargs):  # (an assertion here would only turn the drafter unhealthy: noted)
        tensors, cached = spent[-1]
        alive = [ref() is not None for ref in tensors]
        out = build(*args, **kwargs)
        freed.append((cached, alive, [ref() is None for ref in tensors]))
        return out

    speculator.propose, speculator.build = watching_propose, watching_build
    prompts = [[t % 80 for t in q] for q in random_prompts(3, seed=5)]
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=14))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 14, eos=set())
    assert engine.drafter.healthy
    assert hits, "hits must occur"
    assert all(ops == [] for ops in hits), [ops for ops in hits if ops]
    after_hits = [(alive, gone) for cached, alive, gone in freed if cached and alive]
    assert after_hits and all(all(alive) and all(gone) for alive, gone in after_hits)  # alive for the reply, then
    # freed by the build


def _same_replies(a: list, b: list) -> bool:
    """Proposals equal field by field (their q tensors by value)."""
    def fields(p):
        return {k: v for k, v in vars(p).items() if not isinstance(v, torch.Tensor)}

    def tensors_equal(x, y):
        return (x is None) == (y is None) and (x is None or torch.equal(x, y))

    return len(a) == len(b) and all(fields(x) == fields(y) and tensors_equal(x.q, y.q) and
                                    tensors_equal(x.q_ids, y.q_ids) for x, y in zip(a, b))


@pytest.mark.parametrize("temperature,tree", [(0.0, 0), (0.8, 0), (0.0, 6)], ids=["greedy", "sampled", "tree"])
def test_peek_answers_a_plain_hit_as_propose_does_and_changes_nothing(temperature, tree, target_and_head,
                                                                     byte_tokenizer):  # noqa: F811
    """At T > 0 a hit's reply carries the cached chain's q, a tree hit its parents: peek answers them too."""
    target, head = target_and_head
    engine = eagle_ssd_engine(target, head, byte_tokenizer, max_num_seqs=1 if tree else 2, tree=tree,
                              fanout=(20,) if tree else (60,))  # (tree hits are rarer: one row at a time)
    speculator = engine.drafter.speculator.speculator
    propose = speculator.propose
    early = []

    def checking_propose(requests):
        state = [(len(s.token_ids), len(s.raw), s.proposal, s.cache) for s in speculator.seqs.values()]
        lookups = speculator.stats.lookups
        peeked = speculator.peek([replace(r, aux=None) for r in requests])
        assert state == [(len(s.token_ids), len(s.raw), s.proposal, s.cache) for s in speculator.seqs.values()]
        assert speculator.stats.lookups == lookups
        replies = propose(requests)
        if peeked is not None:
            assert _same_replies(peeked, replies) and all(r.cache_hit for r in replies)
            assert all((r.q is not None) == (temperature > 0) and (r.parents is not None) == bool(tree)
                       for r in replies)
            early.append(len(replies))
        else:
            assert not all(r.cache_hit for r in replies) or any(q.budget < speculator.K for q in requests)  # a miss,
            # or a chain cut to a shorter budget
        return replies

    speculator.propose = checking_propose
    prompts = [[t % 80 for t in q] for q in random_prompts(4, seed=6)]
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=temperature, max_tokens=14, seed=3))
    for prompt, out in zip(prompts, outs):
        assert temperature > 0 or out.token_ids == reference_greedy(target, prompt, 14, eos=set())
    assert early, "plain hits must occur"


def test_serve_replies_to_a_plain_hit_before_committing_it_and_stays_lossless(target_and_head,
                                                                              byte_tokenizer):  # noqa: F811
    """The speculator behind a real link, served by ``serve`` on a thread: early replies happen, the output is the
    target's greedy decode."""
    target, head = target_and_head
    engine = eagle_ssd_engine(target, head, byte_tokenizer, max_num_seqs=2)
    speculator = engine.drafter.speculator.speculator
    verifier_end, speculator_end, _store = _pair()
    peek, early = speculator.peek, []

    def counting_peek(requests):
        replies = peek(requests)
        early.append(replies is not None)
        return replies

    speculator.peek = counting_peek
    server = threading.Thread(target=serve, args=(speculator, speculator_end, []))
    server.start()
    engine.drafter.speculator = SpeculatorLink(verifier_end, target.config.vocab_size, timeout=30)
    try:
        prompts = [[t % 80 for t in q] for q in random_prompts(4, seed=7)]
        outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=14))
        assert engine.drafter.healthy
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(target, prompt, 14, eos=set())
    finally:
        engine.drafter.speculator.close()
        server.join(timeout=30)
    assert not server.is_alive()
    assert any(early) and not all(early)  # early replies, and the usual path for the other rounds
