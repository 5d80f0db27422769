"""``backup: auto`` (issue 13, "a speculator that never stalls the verifier"): the backup on a cache miss is chosen
per round from measured costs (:mod:`ssd_eagle.ssd.backup`): a neural backup that is slow against the verification
loses to the n-gram lookup, a cheap one keeps drafting, and greedy output stays the target's either way; the choice
shows in ``spec_stats``."""

from __future__ import annotations

import time

import pytest

from helpers import make_tiny_llama, noisy_copy, random_prompts
from ssd_eagle.ssd.backup import BackupChoice
from ssd_eagle.ssd.budget import BuildBudget
from ssd_eagle.stats import SpecStats
from test_spec_budget import greedy_with_hits_and_misses
from test_ssd import SlowTarget, ssd_engine


def measured_choice(neural_s: float, neural_tokens: float, fast_s: float = 1e-3, fast_tokens: float = 1.3,
                    hit_tokens: float | None = None, **kwargs) -> BackupChoice:
    choice = BackupChoice(**{"prior_weight": 0.0, "neural_margin": 0.0, **kwargs})  # the rates by hand
    for backup, seconds, tokens in (("neural", neural_s, neural_tokens), ("fast", fast_s, fast_tokens)):
        choice.observe_backup(backup, 99.0)  # the first call is warm-up: not timed
        choice.observe_backup(backup, seconds)
        choice.observe_tokens(backup, tokens)
    if hit_tokens is not None:
        choice.observe_tokens("hit", hit_tokens)
    return choice


def test_auto_picks_the_backup_with_more_expected_tokens_per_second():
    V = 100e-3
    # a draft LM's 5-step chain (95 ms) against a 100 ms verification: 2.0 / 0.195 = 10.3 tok/s < 1.3 / 0.101 = 12.9
    slow = measured_choice(95e-3, 2.0)
    assert slow.rate("neural", V) == pytest.approx(2.0 / 0.195) and slow.rate("fast", V) == pytest.approx(1.3 / 0.101)
    assert slow.choose(V, 0, 1) == "fast"
    # the same drafts in 10 ms: 2.0 / 0.110 = 18.2 tok/s
    assert measured_choice(10e-3, 2.0).choose(V, 0, 1) == "neural"
    # drafts accepted long enough pay for the slow chain: 3.0 / 0.195 = 15.4 > 12.9
    assert measured_choice(95e-3, 3.0).choose(V, 0, 1) == "neural"
    # rows answered from the cache wait for the backup too: 3 hits of 3 tokens, one miss, a 30 ms neural backup:
    # (9 + 2) / 0.130 = 84.6 < (9 + 1.3) / 0.101 = 102 (alone it would keep neural: 2 / 0.13 = 15.4 > 12.9)
    shared = measured_choice(30e-3, 2.0, hit_tokens=3.0)
    assert shared.preferred(V, 0, 1) == "neural" and shared.preferred(V, 3, 1) == "fast"


def test_auto_weighs_each_sources_verification_time():
    """An empty n-gram proposal is verified by a one-token step: at V_fast = 50 ms the lookup's 1.3 tokens per
    51 ms (25.5 tok/s) beat the head's 2.0 per 10 + 100 ms (18.2), which one V for both would pick (12.9 < 18.2)."""
    V = 100e-3
    choice = measured_choice(10e-3, 2.0)
    assert choice.preferred(V) == "neural"
    choice.observe_verify({"neural"}, V)
    choice.observe_verify({"fast"}, 50e-3)
    assert choice.verify == {"hit": None, "neural": V, "fast": 50e-3}
    assert choice.rate("fast", V) == pytest.approx(1.3 / 0.051) and choice.preferred(V) == "fast"


def test_auto_weighs_the_hit_rate_of_the_lookup_after_each_backup():
    """The long-run rate of the module docstring, by hand. Hits bring 3 tokens and are followed by a hit half the
    time; after the head's proposal the next lookup hits 0.1 of the time, after the lookup's 0.9. One round alone
    favours the head (2 / 0.110 = 18.2 > 1.3 / 0.101 = 12.9); over the long run the head spends pi = 0.1 / 0.6 = 1/6
    of its rounds on hits: (3/6 + 2 * 5/6) / (0.1/6 + 0.110 * 5/6) = 20.0 tok/s, the lookup pi = 0.9 / 1.4 = 9/14:
    (3 * 9 + 1.3 * 5) / (0.1 * 9 + 0.101 * 5) = 23.8."""
    V = 100e-3
    choice = measured_choice(10e-3, 2.0, hit_tokens=3.0)
    assert choice.rate("neural", V) == pytest.approx(2.0 / 0.110) and choice.preferred(V) == "neural"
    choice.next_hit.update(hit=0.5, neural=0.1, fast=0.9)
    assert choice.rate("neural", V) == pytest.approx(20.0)
    assert choice.rate("fast", V) == pytest.approx(33.5 / 1.405)
    assert choice.preferred(V) == "fast"
    # two rows: a round waits for the backup unless both hit ((1/6)^2 of the head's rounds)
    assert choice.rate("neural", V, hits=1, misses=1) == pytest.approx(2 * (13 / 6) / (0.1 / 36 + 0.110 * 35 / 36))
    # a backup whose proposals are never followed by a hit: every round is its own
    choice.next_hit.update(neural=0.0)
    assert choice.rate("neural", V) == pytest.approx(2.0 / 0.110)


def test_auto_weighs_the_tokens_of_the_hits_after_each_backup():
    """A hit right after an empty lookup proposal comes from a cache built for one outcome from fresh target
    features, and is accepted longer than one after the head's K-token proposal (SmolLM2, T = 0: ~1.6-2.1 tokens
    against ~1.2-1.8). The module docstring's chain with the next-hit shares of the test above (hit 0.5, neural 0.1,
    fast 0.9): half the hits come right after the backup. Hits after the head bring 1 token, after the lookup 3,
    after a hit 2: the head (1/6 (0.5 + 1) + 5/6 2) / (0.1/6 + 0.110 * 5/6) = 17.7 tok/s, the lookup
    (9/14 (1.5 + 1) + 5/14 1.3) / (0.1 * 9/14 + 0.101 * 5/14) = 20.6; with one mean of 2 for every hit the head
    would win, 18.5 against 17.4."""
    V = 100e-3
    choice = measured_choice(10e-3, 2.0, token_memory=1e12)  # (plain means)
    choice.next_hit.update(hit=0.5, neural=0.1, fast=0.9)
    for after, tokens in (("neural", 1), ("fast", 3), ("hit", 2)):
        choice.observe_tokens("hit", tokens, after=after)
    assert choice.tokens["hit"] == pytest.approx(2.0)
    assert choice.hit_tokens == pytest.approx({"hit": 2.0, "neural": 1.0, "fast": 3.0})
    assert choice.rate("neural", V) == pytest.approx((1.5 / 6 + 2 * 5 / 6) / (0.1 / 6 + 0.110 * 5 / 6))
    assert choice.rate("fast", V) == pytest.approx(29 / 1.405)
    assert choice.preferred(V) == "fast"
    choice.hit_tokens.update(neural=None, fast=None, hit=None)  # (unknown: every hit counts the mean of 2)
    assert choice.rate("neural", V) == pytest.approx(2 / (0.1 / 6 + 0.110 * 5 / 6)) and choice.preferred(V) == "neural"


def test_one_lucky_round_of_a_backup_seen_once_does_not_flip_the_choice():
    """A source's tokens are shrunk toward the mean of all sources by ``prior_weight`` pseudo-observations (plain
    means here: no fading). The lookup emitted 1.5 tokens in 10 rounds, the head once 2.5: alone, 2.5 / 0.12 = 20.8
    tok/s beat 1.5 / 0.101 = 14.9; shrunk, (2.5 + 4 * 17.5/11) / 5 = 1.773 tokens (14.8 tok/s) lose to the lookup's
    (15 + 4 * 17.5/11) / 14 = 1.526 (15.1)."""
    V = 100e-3

    def choice_with(prior_weight: float) -> BackupChoice:
        choice = BackupChoice(prior_weight=prior_weight, neural_margin=0.0, token_memory=1e12)
        for backup, seconds in (("neural", 20e-3), ("fast", 1e-3)):
            for _ in range(2):
                choice.observe_backup(backup, seconds)
        for _ in range(10):
            choice.observe_tokens("fast", 1.5)
        choice.observe_tokens("neural", 2.5)
        return choice

    assert choice_with(0.0).preferred(V) == "neural"
    shrunk = choice_with(4.0)
    assert shrunk.shrunk("tokens", "neural") == pytest.approx((2.5 + 4 * 17.5 / 11) / 5)
    assert shrunk.shrunk("tokens", "fast") == pytest.approx((15 + 4 * 17.5 / 11) / 14)
    assert shrunk.preferred(V) == "fast"


def test_auto_keeps_the_lookup_unless_the_head_beats_it_by_the_margin():
    """The lookup's 1.3 tokens per 101 ms (12.9 tok/s) against the head's drafts at 110 ms: 1.45 tokens (13.2, 2%
    more) and 1.55 (14.1, 9% more) keep the lookup under the default 10% margin, 1.6 (14.5, 13% more) picks the
    head."""
    V = 100e-3
    for tokens, expected in ((1.45, "fast"), (1.55, "fast"), (1.6, "neural")):
        assert measured_choice(10e-3, tokens, neural_margin=0.1).preferred(V) == expected
    assert measured_choice(10e-3, 1.45).preferred(V) == "neural"  # (no margin)


def test_the_speculator_measures_the_next_hit_and_the_verification_per_source(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, backup="neural")
    speculator = engine.drafter.speculator.speculator
    greedy_with_hits_and_misses(engine, target, random_prompts(2, seed=5), max_tokens=32)
    choice, stats = speculator.choice, engine.stats
    assert choice.next_hit["fast"] is None and 0 < choice.next_hit["hit"] < 1 and choice.next_hit["neural"] < 1
    assert choice.summary()["next_hit"]["neural"] == round(choice.next_hit["neural"], 3)
    # every sequence's first hit follows the head's proposal: its tokens are counted as a hit after neural
    assert choice.hit_tokens["neural"] is not None and choice.hit_tokens["fast"] is None
    sources = set(speculator._replied)
    assert sources and sources <= {"hit", "neural"}
    speculator.observe_verify(0.03)  # (the worker measures it; an in-process speculator has no V)
    assert speculator.budget.verify_s == 0.03 and all(choice.verify[s] == 0.03 for s in sources)


def test_auto_measures_neural_then_fast_probes_the_loser_and_keeps_the_batch_rule():
    choice = BackupChoice(probe_every=4, prior_weight=0.0, neural_margin=0.0)
    assert choice.choose(None, 0, 1) == "neural"  # no verification measured: the paper's default
    assert choice.choose(0.1, 0, 8) == "fast"  # fast_batch rows: fast whatever the costs
    for _ in range(2):
        choice.observe_backup("neural", 0.2)
    assert choice.seconds["neural"] == 0.2 and choice.choose(0.1, 0, 1) == "neural"  # no tokens seen yet
    choice.observe_tokens("neural", 3)
    assert choice.choose(0.1, 0, 1) == "fast"  # neural measured, fast not yet
    for _ in range(2):
        choice.observe_backup("fast", 1e-3)
    choice.observe_tokens("fast", 1)
    # neural 3 / 0.3 = 10 tok/s, fast 1 / 0.101 = 9.9: neural; fast probed after 4 measured rounds, then after 8
    assert [choice.choose(0.1, 0, 1) for _ in range(13)] == ["neural"] * 3 + ["fast"] + ["neural"] * 7 + ["fast",
                                                                                                         "neural"]
    assert choice.chosen == {"neural": 2 + 11, "fast": 2 + 2}
    for _ in range(3):  # fast's drafts turn longer: fast wins, and neural is probed 4 rounds after the change
        choice.observe_tokens("fast", 3)
    assert [choice.choose(0.1, 0, 1) for _ in range(5)] == ["fast"] * 3 + ["neural", "fast"]


def test_finishing_a_build_weighs_tokens_and_reduces_to_the_time_rule():
    V, R, p = 100e-3, 20e-3, 0.4
    equal = measured_choice(50e-3, 2.0, fast_s=40e-3, fast_tokens=1.0, hit_tokens=2.0)  # neural preferred
    assert equal.preferred(V) == "neural"
    for remaining in (10e-3, 19.9e-3, 20.1e-3, 30e-3):  # equal tokens: finish iff R < p W = 20 ms
        assert equal.worth_finishing(remaining, V, p) == (remaining < p * 50e-3)
    # a fast backup answers in 1 ms, but a hit brings 3 tokens against its 1.3: finishing pays (time alone: stop)
    fast = measured_choice(95e-3, 2.0, hit_tokens=3.0)
    assert fast.preferred(V) == "fast" and fast.worth_finishing(R, V, p) is True
    assert not R < p * fast.seconds["fast"]
    assert BackupChoice().worth_finishing(R, V, p) is None  # nothing measured: the caller decides by time
    budget = BuildBudget()
    assert not budget.ready() and budget.worth_finishing(R)  # (a build not measured yet finishes)


def test_record_lookup_counts_the_fast_backups_merges_and_summarises():
    stats = SpecStats()
    stats.record_lookup(1, False, 2, backup="fast")
    stats.record_lookup(0, False, 1, backup="neural")
    stats.record_lookup(2, True, 3)
    total = SpecStats().merge(stats).merge(stats)
    assert (total.rounds_on_fast_backup, total.rounds_on_miss) == (2, 4)
    assert total.summary()["rounds_on_fast_backup"] == 2


class SlowBackup:
    """Wraps a speculator's neural backup: sleeps ``seconds`` first (the builds keep their own speed)."""

    def __init__(self, backup, seconds: float):
        self.inner, self.seconds = backup, seconds

    def __call__(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("slow", [True, False], ids=["slow_neural", "cheap_neural"])
def test_auto_drops_a_slow_neural_backup_keeps_a_cheap_one_and_stays_lossless(slow, byte_tokenizer):
    """A neural backup of 300 ms against a 20 ms verification loses to the lookup whatever its drafts; a tiny
    draft's backup (a few ms) against a 500 ms verification keeps drafting: the lookup only runs to be measured
    (twice) and as a probe every 16th measured miss."""
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, backup="auto", max_num_seqs=2)
    speculator = engine.drafter.speculator.speculator
    speculator.budget.observe_verify(20e-3 if slow else 0.5)  # (an in-process speculator measures no verification)
    if slow:
        speculator._neural_backup = SlowBackup(speculator._neural_backup, 0.3)
    else:  # the cheap backup costs 3 ms and the lookup 0.5 ms on every machine (measured, the draft's took 3-10 ms
        observe = speculator.choice.observe_backup  # and the choices it led to changed with the machine's speed)
        speculator.choice.observe_backup = lambda backup, seconds: observe(backup, 3e-3 if backup == "neural" else 5e-4)
    # (a choice is made on misses after a lookup only: a first round is the draft's anyway)
    greedy_with_hits_and_misses(engine, target, random_prompts(4, seed=2), max_tokens=48)
    chosen, stats = speculator.choice.chosen, engine.stats
    assert sum(chosen.values()) >= 12, chosen
    if slow:
        assert chosen["fast"] >= 3 * chosen["neural"], speculator.choice.summary()
        assert stats.rounds_on_fast_backup >= 0.7 * stats.rounds_on_miss
    else:
        assert chosen["neural"] >= 3 * chosen["fast"], speculator.choice.summary()
        assert stats.rounds_on_fast_backup <= 0.3 * stats.rounds_on_miss
    assert stats.summary()["rounds_on_fast_backup"] == stats.rounds_on_fast_backup


@pytest.mark.parametrize("backup", ["neural", "fast"])
def test_explicit_backups_show_in_spec_stats(backup, byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, backup=backup)
    greedy_with_hits_and_misses(engine, target, random_prompts(3, seed=1))
    stats = engine.stats
    assert stats.rounds_on_fast_backup == (stats.rounds_on_miss if backup == "fast" else 0)


def test_auto_in_the_speculator_process_measures_the_verification_and_stays_lossless(byte_tokenizer):
    """The worker measures V (here a 40 ms verification) and auto weighs it; the backup's name crosses the link."""
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, speculator="process", backup="auto",
                        adaptive=False)  # (unplanned: every round drafts)
    try:
        engine.target.forward = SlowTarget(engine.target, delay=0.04)
        greedy_with_hits_and_misses(engine, target, random_prompts(3, seed=4), max_tokens=20)
        stats = engine.stats
        # V measured: auto has tried the lookup (it never does without a V), and the replies said so
        assert 1 <= stats.rounds_on_fast_backup <= stats.rounds_on_miss
    finally:
        engine.drafter.close()
