"""The verifier's wait on SSD's two paths (issue 13 item 2): a hit replies with no draft work at all (the EAGLE-3
fuse of the outcome's aux states waits for the build, after the reply), and an outcome that arrives mid-build is
read at once: the build goes on only if it caches that outcome sooner than a backup drafts, so a miss never waits
for branches it cannot use. Greedy output stays the target's."""

from __future__ import annotations

import threading
import time

from helpers import make_tiny_llama, noisy_copy, random_prompts, reference_greedy
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd import protocol as p
from ssd_eagle.ssd.speculator import SpecRequest
from ssd_eagle.ssd.worker import serve
from test_spec_budget import SlowForward
from test_spec_interrupt import _speculator
from test_ssd import K
from test_ssd_eagle3 import eagle_ssd_engine, target_and_head  # noqa: F401 - a fixture
from test_ssd_protocol import _pair

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


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


def _built_speculator(draft, fanout=2):
    """A speculator after round 1 (backup) and its full build: ``(speculator, a cached outcome, a missing one)``."""
    spec = _speculator(draft, fanout)
    spec.add(0, [5, 6, 7, 8, 9], GREEDY, seed=0)
    first = spec.propose([SpecRequest(0, -1, 0, K)])[0].tokens
    spec.build()
    path, bonus = min(spec.seqs[0].cache)
    second = spec.propose([SpecRequest(0, len(path), bonus, K)])[0]
    assert second.cache_hit is True and first
    miss = next(t for t in range(200) if t not in spec.seqs[0].candidates.get((), []) and t != second.tokens[0])
    return spec, second, miss


def test_a_build_reads_the_waiting_outcome_finishes_for_a_hit_and_stops_for_a_miss():
    draft = noisy_copy(make_tiny_llama(seed=3), 0.02)
    for outcome, backup_s, finishes in (("hit", 1.0, True), ("hit", 0.0, False), ("miss", 1.0, False),
                                        ("no drafts asked", 1.0, False)):
        spec, _, miss = _built_speculator(draft)
        spec.budget.worth_finishing = lambda remaining_s: True  # the hit-rate guess would always finish
        spec.budget.backup_s = backup_s  # 0: finishing can never beat the backup
        checks, waiting = [], []

        def poll():
            checks.append(1)
            if len(checks) == 2:  # the outcome lands during the proposal's forward (before the first branch's)
                best = spec.seqs[0].candidates[()][0]  # a branch the build caches: no token accepted, best bonus
                waiting.append(SpecRequest(0, 0, miss if outcome == "miss" else best, K))
                spec.expect([SpecRequest(0, 0, waiting[0].bonus, 0)] if outcome == "no drafts asked" else waiting)
            return len(checks) >= 2

        assert spec.build(poll) is finishes, outcome
        assert len(checks) == (K + 1 if finishes else 2), outcome  # a stopped build checks no further
        assert spec.stats.interrupted == (not finishes)
        assert spec.propose(waiting)[0].cache_hit is finishes, outcome


def test_a_miss_arriving_mid_build_is_answered_within_a_backup_and_one_forward():
    """Through the worker's loop and a real link: the draft's forward sleeps 40 ms, a build lasts 1 + K forwards;
    the miss's outcome arrives 10 ms into the build. Answered at once: the forward in flight, then the backup, not
    the rest of the build first (the hit-rate guess is made to say 'finish')."""
    verifier, speculator_end, _store = _pair()
    draft = noisy_copy(make_tiny_llama(seed=3), 0.02)
    spec, proposal, _ = _built_speculator(draft, fanout=1)
    spec.build()  # (the build after round 2, so that round 3 is a plain PROPOSE)
    miss = 199  # not the round-3 build's root candidate (fan-out 1) nor its proposal's first token: a miss
    forward_s = 0.04
    spec.backend.forward = SlowForward(spec.backend.forward, forward_s, 0.0)
    spec.budget.worth_finishing = lambda remaining_s: True
    spec.budget.backup_s = 1.0  # finishing a build that caches the outcome would beat the backup
    latency, backups, backup = [], [], spec._neural_backup

    def timed_backup(*args):
        start = time.perf_counter()
        out = backup(*args)
        backups.append(time.perf_counter() - start)
        return out

    spec._neural_backup = timed_backup

    def verifier_rounds():
        verifier.send(p.encode_propose([SpecRequest(0, len(proposal.tokens), 3, K)]))  # round 3 (its answer)
        verifier.recv(timeout=30)
        time.sleep(0.01)  # ... 10 ms into the build the next outcome arrives: no token accepted, an uncached bonus
        start = time.perf_counter()
        verifier.send(p.encode_propose([SpecRequest(0, 0, miss, K, accepted=[])]))
        reply = p.decode_reply(verifier.recv(timeout=30), 200)[0]
        latency.append((time.perf_counter() - start, reply.cache_hit))
        verifier.send(p.Message(p.SHUTDOWN))

    thread = threading.Thread(target=verifier_rounds)
    thread.start()
    serve(spec, speculator_end, [])
    thread.join()
    (seconds, hit), = latency
    assert hit is False and spec.stats.interrupted >= 1
    # besides the backup itself, at most the forward in flight (with room for the link and a loaded machine);
    # finishing the build first would add its K branch forwards
    assert seconds - backups[-1] < 2 * forward_s < K * forward_s, (seconds, backups)
