"""The verifier's wait on an SSD hit (issue 13 item 2): a hit replies with no draft work at all (the EAGLE-3 fuse of
the outcome's aux states waits for the build, after the reply); a miss fuses once, then drafts. Greedy output stays
the target's."""

from __future__ import annotations

from helpers import random_prompts, reference_greedy
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from test_ssd_eagle3 import eagle_ssd_engine, target_and_head  # noqa: F401 - a fixture


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
