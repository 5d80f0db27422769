"""SSD / Saguaro: losslessness (greedy and the output law at T > 0) with cache hits and misses, the exact
(k, bonus) cache key, and the speculator in its own process (overlap, and death mid-request)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import (LAW_TOKENS, LAW_VOCAB, exact_law, make_tiny_llama, noisy_copy, pooled_chisquare, random_prompts,
                     reference_greedy)
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.speculator import SpecRequest

K = 4


def ssd_engine(target, draft, tokenizer, speculator="local", max_num_seqs=4, k=K, **spec):
    spec = {"method": "draft_model", "model": "in-memory", "num_speculative_tokens": k, "fanout": [2],
            "speculator": speculator, **spec}
    cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=max_num_seqs, max_model_len=512,
                       speculative_config=SpeculativeConfig(**spec))
    return build(cfg, target, tokenizer=tokenizer, draft=draft)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(fanout_strategy="geometric", fanout_budget=10, fanout_acceptance=0.6, fanout_power=1.0),
    dict(backup="fast", fanout=[1, 2, 1, 1, 3]),
    dict(saguaro_c=0.5, fanout_miss=[3]),
], ids=["uniform", "geometric", "fast_backup", "saguaro"])
def test_greedy_output_equals_target_greedy_with_hits_and_misses(variant, byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, **variant)
    prompts = random_prompts(8, seed=1)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 24)
    stats = engine.stats
    assert stats.cache_hits > 0 and stats.cache_lookups - stats.cache_hits > 0, "hits and misses must both occur"
    assert max(stats.accepted_lengths) >= 2


def test_a_hit_requires_the_exact_outcome(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer)
    speculator = engine.drafter.speculator.speculator
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()  # prefill + first round (no lookup), then the cache is built
    seq = speculator.seqs[engine.requests["a"].slot]
    proposal = seq.proposal.tokens
    cached = sorted(seq.cache)
    assert cached and all(b in seq.candidates[path] for path, b in cached)
    (path, bonus) = cached[0]
    k = len(path)
    assert path == tuple(proposal[:k])
    not_cached = next(t for t in range(257) if (path, t) not in seq.cache)
    snapshot, base_tokens, base_cached = dict(seq.cache), list(seq.token_ids), seq.num_cached

    def lookup(k_: int, b_: int) -> bool:
        seq.cache, seq.token_ids, seq.num_cached = dict(snapshot), list(base_tokens), base_cached
        return speculator._commit(seq, SpecRequest(seq.slot, k_, b_, K))

    assert lookup(k, bonus) is True
    assert lookup(k, not_cached) is False
    other_k = next(kk for kk in range(K + 1) if (tuple(proposal[:kk]), bonus) not in snapshot)
    assert lookup(other_k, bonus) is False


# ---------------------------------------------------------------------------------------------------------------
# the output law at T > 0 on a 4-token vocabulary

V, T_OUT, N_REQ = LAW_VOCAB, LAW_TOKENS, 4000


@pytest.mark.parametrize("variant", [
    # (auto would pick fast: a propose call has >= fast_backup_batch rows here); drafts (backup and cached branches)
    # from a sharpened q (the saguaro and fast-backup variants draft at s = 1)
    dict(backup="neural", draft_temperature_scale=0.5),
    dict(backup="neural", saguaro_c=0.3, fanout=[1]),
    dict(backup="fast", fanout_strategy="geometric", fanout_budget=4, fanout_acceptance=0.5),
], ids=["neural_backup_uniform_sharpened", "saguaro", "fast_backup_geometric"])
def test_output_law_equals_the_targets(variant, byte_tokenizer):
    target = make_tiny_llama(vocab_size=V, seed=6, init_std=0.15)
    draft = noisy_copy(target, 0.5, seed=9)
    engine = ssd_engine(target, draft, byte_tokenizer, max_num_seqs=128, k=2, **variant)
    prompt = [1, 3, 0, 2, 2]
    temperature = 0.9
    params = [SamplingParams(temperature=temperature, max_tokens=T_OUT, ignore_eos=True, seed=i)
              for i in range(N_REQ)]
    outs = LLM(engine=engine).generate([prompt] * N_REQ, params)
    flat = np.array([sum(t * V ** (T_OUT - 1 - j) for j, t in enumerate(o.token_ids)) for o in outs])
    counts = np.bincount(flat, minlength=V**T_OUT)
    stats = engine.stats
    assert stats.cache_hits > 50 and stats.cache_lookups - stats.cache_hits > 50, "need hits and misses"
    assert pooled_chisquare(counts, exact_law(target, prompt, temperature)) > 1e-4


# ---------------------------------------------------------------------------------------------------------------
# the speculator as its own process

class SlowTarget:
    """Wraps a model runner's forward: sleeps, and records the wall-clock interval of every verification."""

    def __init__(self, runner, delay: float):
        self.forward, self.delay, self.intervals = runner.forward, delay, []

    def __call__(self, batch, **kwargs):
        start = time.time()
        time.sleep(self.delay)
        out = self.forward(batch, **kwargs)
        self.intervals.append((start, time.time()))
        return out


def test_speculator_process_overlaps_verification_and_is_lossless(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    # unplanned: the planner's cost table is timed at build, before the 50 ms sleep; on a loaded machine it turned
    # every round of this tiny model off (0 lookups, a CI failure)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, speculator="process", adaptive=False)
    try:
        slow = SlowTarget(engine.target, delay=0.05)
        engine.target.forward = slow
        prompts = random_prompts(3, seed=4)
        outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(target, prompt, 20)
        stats, build_intervals = engine.drafter.speculator.stats()
        assert stats.hits > 0
        builds = list(zip(build_intervals[::2], build_intervals[1::2]))
        overlapping = sum(any(bs < ve and vs < be for vs, ve in slow.intervals) for bs, be in builds)
        assert overlapping >= len(builds) // 2, f"only {overlapping} of {len(builds)} builds overlapped a verify"
    finally:
        engine.drafter.close()


def test_killing_the_speculator_mid_request_still_completes_it(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, speculator="process",
                        speculator_timeout=20.0)
    try:
        prompt = [9, 8, 7, 6, 5]
        engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        for _ in range(3):
            engine.step()
        assert engine.drafter.healthy
        engine.drafter.speculator.process.kill()
        engine.drafter.speculator.process.join(timeout=10)
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                final = out
        assert final.token_ids == reference_greedy(target, prompt, 40, eos=set())
        assert not engine.drafter.healthy
    finally:
        engine.drafter.close()


def test_a_backup_scales_with_the_miss_fanout_it_is_cached_with(byte_tokenizer, monkeypatch):
    """Saguaro scales the top-(F_k + 1) the speculator caches: a backup (after a miss) uses ``fanout_miss``."""
    import ssd_eagle.drafters.chain as chain_module

    seen = []
    original = chain_module.sample_draft_tokens

    def recording(logits, seqs, position, saguaro=None, vocab=None, temperature_scale=1.0):
        seen.append((logits.shape[0], saguaro.fanout if saguaro is not None else None))
        return original(logits, seqs, position, saguaro, vocab, temperature_scale)

    monkeypatch.setattr(chain_module, "sample_draft_tokens", recording)
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, max_num_seqs=1, saguaro_c=0.5,
                        fanout=[1], fanout_miss=[3])
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=3, seed=0, ignore_eos=True))
    engine.step()  # no cache yet: the first proposal is a backup; then the cache is built from it
    backup = [f for rows, f in seen if rows == 1]
    branches = [f for rows, f in seen if rows > 1]
    assert backup and all(f == (3,) * (K + 1) for f in backup)
    assert branches and all(f == (1,) * (K + 1) for f in branches)


# ---------------------------------------------------------------------------------------------------------------
# the speculator's link: its own process group, released by LLM.close / with / garbage collection and exit

def _greedy_outputs_match(llm, target, prompts, max_tokens=12) -> None:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, max_tokens)
    assert llm.engine.drafter.healthy


def test_two_ssd_llms_live_at_once_and_close_on_leaving_the_block(byte_tokenizer):
    """Each SSD engine's speculator link is a process group of its own: two in one process, used in turn."""
    target = make_tiny_llama(seed=3)
    prompts = random_prompts(2, seed=5)
    # (adaptive off: a planner would turn these noisy drafts off, and rounds without speculation build nothing)
    with LLM(engine=ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, speculator="process",
                               adaptive=False)) as a, \
            LLM(engine=ssd_engine(target, noisy_copy(target, 0.03, seed=2), byte_tokenizer, speculator="process",
                                  adaptive=False)) as b:
        for llm in (a, b, a):
            _greedy_outputs_match(llm, target, prompts)
        processes = [llm.engine.drafter.speculator.process for llm in (a, b)]
        assert all(proc.is_alive() for proc in processes)
        assert all(llm.engine.drafter.speculator.stats()[0].hits > 0 for llm in (a, b))
    assert not any(proc.is_alive() for proc in processes)
    a.close()  # idempotent


def test_ssd_starts_after_deepspeed_made_the_default_process_group(byte_tokenizer, monkeypatch):
    """SSD inside a process that already has a default group (DeepSpeed's, gloo on CPU): the link ignores it. The
    group is left up, as a trainer leaves it, for whatever runs next in this process."""
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        port = store.port
        del store  # free the port for DeepSpeed's rendezvous
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(port)).items():
            monkeypatch.setenv(key, value)
        deepspeed.init_distributed(dist_backend="gloo")
    assert dist.is_initialized()
    target = make_tiny_llama(seed=3)
    # unplanned: the planner may switch a tiny model's SSD off after two rounds (its lookups then count nothing)
    with LLM(engine=ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, speculator="process",
                               adaptive=False)) as llm:
        _greedy_outputs_match(llm, target, random_prompts(2, seed=6))
        assert llm.engine.stats.cache_hits > 0


def test_an_llm_that_built_its_engine_releases_it_when_collected_or_at_exit(tmp_path, byte_tokenizer):
    import gc

    target = make_tiny_llama(seed=3)
    target.save_pretrained(tmp_path / "target")
    byte_tokenizer.save_pretrained(tmp_path / "target")
    noisy_copy(target, 0.02).save_pretrained(tmp_path / "draft")
    byte_tokenizer.save_pretrained(tmp_path / "draft")  # a plain draft folder is a whole model
    config = EngineConfig(model=str(tmp_path / "target"), mode="ssd", dtype="float64", max_model_len=256,
                          max_num_seqs=2, pin_cpus=False,
                          speculative_config={"method": "draft_model", "model": str(tmp_path / "draft"),
                                              "num_speculative_tokens": K, "fanout": [2]})
    llm = LLM(config=config)
    _greedy_outputs_match(llm, target, random_prompts(2, seed=7))
    process = llm.engine.drafter.speculator.process
    assert llm._release.atexit and llm._release.alive  # registered for interpreter exit
    del llm
    gc.collect()
    process.join(timeout=10)
    assert not process.is_alive()


@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_warm_up_leaves_no_sequence_and_a_fresh_speculator_shares_its_backend(kind):
    """The speculator process warms its draft up on synthetic requests (ssd_eagle.ssd.worker.warm_up), then serves
    a fresh speculator on the same backend: nothing of the warm-up (sequences, statistics) is left."""
    from helpers import eagle3_head_for
    from ssd_eagle.ssd.worker import SpeculatorSettings, build_speculator, warm_up

    target = make_tiny_llama(seed=4, num_layers=2)
    draft = eagle3_head_for(target, draft_vocab=100) if kind == "eagle3" else make_tiny_llama(seed=5, num_layers=1)
    settings = SpeculatorSettings(kind, 3, [2, 2, 2, 2], None, "neural", 8, 1.0, (1, 4), 2, 256, vocab_size=257)
    speculator = build_speculator(settings, draft)
    warm_up(speculator)
    assert speculator.seqs == {} and speculator.stats.lookups > 0 and speculator.backend.forwards > 0
    fresh = build_speculator(settings, draft, backend=speculator.backend)
    assert fresh.backend is speculator.backend and fresh.stats.lookups == 0 and fresh.budget.verify_s is None
