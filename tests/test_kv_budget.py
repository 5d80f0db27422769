"""Bounded KV memory: the target's store and the drafts' stores (SD drafters, the SSD speculator) follow the live
requests (they shrink back after a long one), admission reserves prompt + max_tokens + one round against
``kv_cache_memory`` (requests that do not fit now wait, one that never fits is refused naming the field), and
cached prefixes count against that budget and give way to live requests."""

from __future__ import annotations

import pytest

from helpers import make_tiny_llama, reference_greedy
from serving_helpers import build_engine, long_prompts
from ssd_eagle.prefix_cache import PrefixCache
from ssd_eagle.engine import scheduler
from ssd_eagle.engine.scheduler import GIB
from ssd_eagle.kv_cache import KVCache
from ssd_eagle.sampling_params import SamplingParams

POSITION = 2 * 4 * 2 * 16 * 8  # bytes per position of make_tiny_llama(): layers x (k, v) x kv heads x head dim x 8


def run(engine, usage: list | None = None) -> None:
    while engine.has_unfinished():
        engine.step()
        if usage is not None:
            usage.append(engine.kv_cache_usage[0])


def run_within(engine, budget: int) -> dict[str, list[int]]:
    """Run to the end, checking the KV usage against ``budget`` after every step; the outputs' token ids."""
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        assert engine.kv_cache_usage[0] <= budget
    return outputs


def test_the_store_shrinks_back_after_a_long_request(byte_tokenizer):
    target = make_tiny_llama(seed=4)
    engine = build_engine("ar", target, byte_tokenizer, max_num_seqs=4, enable_prefix_caching=False)
    kv = engine.target.kv
    assert kv.bytes_per_position == POSITION
    engine.add_request("warm", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    run(engine)
    idle = kv.nbytes
    assert idle == 256 * POSITION  # one row of one growth step
    engine.add_request("long", long_prompts(seed=1, lengths=(400,))[0], SamplingParams(max_tokens=8))
    engine.add_request("short", [4, 5], SamplingParams(temperature=0.0, max_tokens=60))
    peak = []
    run(engine, peak)
    assert max(peak) >= 2 * 400 * POSITION
    assert kv.nbytes == idle and engine.kv_cache_usage == (idle, None)


def test_a_request_that_can_never_fit_is_refused_naming_the_field(byte_tokenizer):
    target = make_tiny_llama(seed=4)
    engine = build_engine("ar", target, byte_tokenizer, kv_cache_memory=512 * POSITION / GIB)
    engine.add_request("fits", [1] * 200, SamplingParams(max_tokens=300))  # 501 positions: 512 reserved
    with pytest.raises(ValueError, match="max_tokens.*kv_cache_memory"):
        engine.add_request("never", [1] * 300, SamplingParams(max_tokens=212))  # 513 positions
    assert "never" not in engine.requests
    for value in (0, -1.0):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            build_engine("ar", target, byte_tokenizer, kv_cache_memory=value)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        build_engine("ar", target, byte_tokenizer, max_num_batched_tokens=0)


@pytest.mark.parametrize("kind", ["ar", "ngram"])
def test_requests_wait_for_room_and_the_budget_holds(kind, byte_tokenizer):
    target = make_tiny_llama(seed=4)
    budget = 2 * 512 * POSITION  # two rows of 512 positions, or one long request
    engine = build_engine(kind, target, byte_tokenizer, max_num_seqs=3, kv_cache_memory=budget / GIB,
                          prefix_cache_memory=budget / GIB)
    prompts = long_prompts(seed=2, lengths=(300, 250, 20, 30))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (150, 10, 10, 200)]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    engine.step()
    # "0" reserves 512 positions in slot 0 and "1" 512 in slot 1: the store is full; "2" waits although a slot is
    # free, and "3" (first come, first served) waits behind it
    assert [s.request_id for s in engine.running] == ["0", "1"]
    assert [s.request_id for s in engine.waiting] == ["2", "3"]
    outputs = run_within(engine, budget)
    assert engine.prefix_cache.nbytes > 0  # the prefix cache filled what live requests left
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        assert outputs[str(i)] == reference_greedy(target, prompt, p.max_tokens, eos=set())


def test_resize_keeps_the_contents_that_fit():
    import torch

    kv = KVCache(2, 3, 2, 4, 1024, torch.float64, "cpu")
    kv.reserve(600)
    for store in (*kv.keys, *kv.values):
        store.copy_(torch.randn(store.shape, dtype=store.dtype))
    before = kv.read(1, 0, 300)
    kv.resize(2, 300)
    assert (kv.num_rows, kv.capacity, kv.nbytes) == (2, 300, 2 * 300 * kv.bytes_per_position)
    torch.testing.assert_close(kv.read(1, 0, 300), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="resize"):
        kv.resize(4, 300)


@pytest.mark.parametrize("kind", ["draft", "eagle3", "ssd"])
def test_the_drafts_stores_shrink_back_after_a_long_request(kind, byte_tokenizer):
    target = make_tiny_llama(seed=4)
    engine = build_engine(kind, target, byte_tokenizer, max_num_seqs=2, enable_prefix_caching=False)
    drafter = engine.drafter
    kv = (drafter.speculator.speculator if kind == "ssd" else drafter).backend.kv
    engine.add_request("warm", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    run(engine)
    idle = kv.nbytes
    assert idle == 256 * kv.bytes_per_position  # one row of one growth step (from num_slots + 1 rows)
    engine.add_request("long", long_prompts(seed=1, lengths=(400,))[0], SamplingParams(max_tokens=8))
    engine.add_request("short", [4, 5], SamplingParams(temperature=0.0, max_tokens=60))
    peak = []
    while engine.has_unfinished():
        engine.step()
        peak.append(kv.nbytes)
    assert max(peak) >= 2 * 400 * kv.bytes_per_position
    assert kv.nbytes == idle


def test_cached_prefixes_count_against_the_budget_and_give_way_to_live_requests(byte_tokenizer):
    target = make_tiny_llama(seed=4)
    budget = 2 * 512 * POSITION
    engine = build_engine("ar", target, byte_tokenizer, max_num_seqs=2, kv_cache_memory=budget / GIB,
                          prefix_cache_memory=1.0)
    first, a, b = long_prompts(seed=3, lengths=(300, 200, 210))
    engine.add_request("first", first, SamplingParams(temperature=0.0, max_tokens=4))
    run(engine)
    cached = engine.prefix_cache.nbytes
    assert cached >= 4 * 64 * POSITION  # its 4 full blocks stay while the store is idle (1 row x 512)
    # two requests reserving 512 positions each fill the budget: the cached prefix goes, nobody waits
    for rid, prompt in (("a", a), ("b", b)):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    engine.step()
    assert [s.request_id for s in engine.running] == ["a", "b"] and not engine.waiting
    assert engine.prefix_cache.nbytes == 0 and engine.kv_cache_usage[0] <= budget
    while engine.has_unfinished():
        engine.step()
        assert engine.kv_cache_usage[0] <= budget  # a finished request's prefix is saved only within the room


def test_a_save_keeps_within_the_room_the_budget_leaves():
    import torch

    kv = KVCache(2, 1, 2, 4, 1024, torch.float64, "cpu")
    kv.reserve(256)
    block = 64 * kv.bytes_per_position
    cache = PrefixCache(max_bytes=10 * block)
    cache.make_room(2 * block)
    cache.save(list(range(256)), kv, 0, None)  # 4 full blocks offered, room for 2
    assert cache.nbytes == 2 * block and cache.bound == 2 * block
    cache.make_room(0)
    assert len(cache) == 0
    cache.save(list(range(256)), kv, 0, None)
    assert len(cache) == 0


def reserved(positions: int) -> int:
    return -(-positions // 256) * 256


@pytest.mark.parametrize("kind", ["draft", "eagle3", "ssd"])
def test_the_drafts_kv_counts_against_the_budget(kind, byte_tokenizer):
    target = make_tiny_llama(seed=4)
    probe = build_engine(kind, target, byte_tokenizer)
    geometry = probe.drafter.kv_geometry
    store = (probe.drafter.speculator.speculator if kind == "ssd" else probe.drafter).backend.kv  # (SSD: in line)
    assert geometry.bytes_per_position == store.bytes_per_position
    assert (geometry.slack > 0) == (kind == "ssd")  # (an SD draft's store follows the target's)
    prompt, max_tokens = 200, 300  # the target's store reserves 512 positions, the draft's as many plus its slack
    positions = min(reserved(prompt + max_tokens + max(1 + 4, geometry.slack)),
                    probe.target.kv.max_len + geometry.slack)
    draft_bytes = positions * geometry.bytes_per_position
    # the target's 512 positions alone would fit: with the draft's they never do
    engine = build_engine(kind, target, byte_tokenizer, kv_cache_memory=512 * POSITION / GIB)
    with pytest.raises(ValueError, match="max_tokens.*drafts.*kv_cache_memory"):
        engine.add_request("never", [1] * prompt, SamplingParams(max_tokens=max_tokens))
    # room for two requests' target stores but one draft store: the second waits
    budget = 2 * 512 * POSITION + draft_bytes
    engine = build_engine(kind, target, byte_tokenizer, kv_cache_memory=budget / GIB, enable_prefix_caching=False)
    prompts = long_prompts(seed=5, lengths=(prompt, prompt))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.step()
    assert [s.request_id for s in engine.running] == ["0"] and [s.request_id for s in engine.waiting] == ["1"]
    # /metrics' usage counts the draft's store as reserved (the speculator's lies in its process)
    assert engine.kv_cache_usage[0] == engine.target.kv.nbytes + draft_bytes
    outputs = run_within(engine, budget)
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == reference_greedy(target, p, max_tokens, eos=set())


def test_an_eagle3_speculators_store_is_one_layer():
    from helpers import eagle3_head_for
    from ssd_eagle.config import SpeculativeConfig
    from ssd_eagle.drafters.backends import Eagle3Backend
    from ssd_eagle.engine.factory import speculator_kv

    head = eagle3_head_for(make_tiny_llama(seed=4))
    spec = SpeculativeConfig(method="eagle3", model="in-memory", num_speculative_tokens=3, fanout=[2])
    geometry = speculator_kv(spec, head)
    assert geometry.bytes_per_position == Eagle3Backend(head, 1, 64, False).kv.bytes_per_position == POSITION // 4
    assert geometry.slack == spec.kv_slack("speculator")


def test_a_request_whose_draft_kv_can_never_fit_gets_a_400_naming_the_field(byte_tokenizer):
    from fastapi.testclient import TestClient

    from inference.api_server import build_app

    target = make_tiny_llama(seed=4)
    engine = build_engine("draft", target, byte_tokenizer, kv_cache_memory=512 * POSITION / GIB)
    with TestClient(build_app(engine, "tiny")) as client:
        refused = client.post("/v1/completions", json={"prompt": [1] * 200, "max_tokens": 300})
        ok = client.post("/v1/completions", json={"prompt": [1] * 100, "max_tokens": 100, "temperature": 0})
        metrics = client.get("/metrics").text
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "kv_cache_exceeded") and "drafts" in error["message"]
    assert ok.status_code == 200, ok.text
    assert "ssd_eagle_kv_cache_usage_bytes" in metrics


def test_a_full_batch_does_not_copy_its_store_at_every_request_that_ends():
    import torch

    kv = KVCache(2, 8, 2, 4, 2048, torch.float64, "cpu")
    kv.reserve(1024)
    for store in (*kv.keys, *kv.values):
        store.copy_(torch.randn(store.shape, dtype=store.dtype))
    assert (kv.num_rows, kv.capacity) == (8, 1024)
    kv.fit(7, 1024, shrink_below=0.75)  # the highest slot ended: 7 of 8 rows is more than 3/4 of the store
    kv.fit(8, 1024, shrink_below=0.75)  # the next request is admitted in it
    kv.fit(8, 900, shrink_below=0.75)  # the longest request ended
    assert (kv.num_rows, kv.capacity) == (8, 1024)
    kv.fit(4, 1024, shrink_below=0.75)  # half the rows: a quarter or more is freed
    assert (kv.num_rows, kv.capacity) == (4, 1024)
    kv.fit(5, 900, shrink_below=0.75)  # growing by rows keeps the positions, which would shrink by under a quarter
    assert (kv.num_rows, kv.capacity) == (5, 1024)
    torch.testing.assert_close(kv.read(4, 0, 1024), torch.zeros(2, 2, 2, 1024, 4, dtype=torch.float64),
                               rtol=0, atol=0)  # a new row holds zeros
    kv.fit(5, 768)  # the default follows the live requests exactly
    assert (kv.num_rows, kv.capacity) == (5, 768)
    with pytest.raises(ValueError, match="shrink_below"):
        kv.fit(5, 768, shrink_below=0.0)


def _resizes_of_a_full_batch(byte_tokenizer) -> list[tuple[int, int]]:
    """The store shapes a batch of 8 goes through while 16 requests end and refill its slots in every order."""
    target = make_tiny_llama(seed=4)
    engine = build_engine("ar", target, byte_tokenizer, max_num_seqs=8, enable_prefix_caching=False)
    kv, resizes = engine.target.kv, []
    resize = kv.resize

    def recording(num_rows, capacity):
        if (num_rows, capacity) != (kv.num_rows, kv.capacity):
            resizes.append((num_rows, capacity))
        return resize(num_rows, capacity)

    kv.resize = recording
    prompts = long_prompts(seed=5, lengths=[40 + 7 * i for i in range(16)])
    lengths = [(13 * i) % 29 + 2 for i in range(16)]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert outputs[str(i)] == reference_greedy(target, prompt, n, eos=set())
    assert kv.nbytes == 256 * POSITION  # back to one row of one growth step
    return resizes


def test_the_store_without_a_budget_is_not_copied_at_every_request_that_ends(byte_tokenizer, monkeypatch):
    kept = _resizes_of_a_full_batch(byte_tokenizer)
    monkeypatch.setattr(scheduler, "SHRINK_BELOW", 1.0)  # following the live requests exactly
    exact = _resizes_of_a_full_batch(byte_tokenizer)
    assert len(kept) <= 3 < len(exact)
