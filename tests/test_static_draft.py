"""Fixed-shape draft steps (what CUDA graphs replay; eager on CPU) equal the dynamic ones: the EAGLE-3 head and the
draft LM, in ``extend`` and ``step``, in chains, trees and the speculator's branch batches (hits and misses); SD and
SSD runs through the fixed-shape path equal the target's greedy decode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import eagle3_head_for, make_tiny_llama, noisy_copy, random_prompts, reference_greedy
from test_ssd_eagle3 import K, eagle_ssd_engine, target_aux
from ssd_eagle.cuda_graphs import EAGER_BUFFERS, EAGER_KV_STEP, StaticForward, cache_lengths, shape_sets
from ssd_eagle.drafters.backends import DRAFT_MAX_ROWS, DraftLMBackend, Eagle3Backend
from ssd_eagle.drafters.eagle3 import Eagle3Drafter
from ssd_eagle.drafters.neural import draft_from_committed
from ssd_eagle.drafters.tree import TreeSettings
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import ForwardBatch, KVCache
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.speculator import Speculator, SpecRequest

TOL = dict(rtol=0, atol=1e-10)
PROMPTS = {0: [3, 1, 4, 1, 5, 9, 2, 6], 1: [7, 7, 1, 2, 3, 9], 2: [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]}


@pytest.fixture(scope="module")
def models():
    target = make_tiny_llama(seed=4, num_layers=8, vocab_size=80, max_positions=256)
    return target, eagle3_head_for(target, draft_vocab=80), noisy_copy(target, 0.02)


def backend_pair(models, kind: str, num_slots: int = 3, captured: bool = True):
    """The same draft twice: dynamic shapes, and fixed shapes with a counter of fixed-shape runs; ``captured``:
    with the shape sets CUDA captures (rows and cache lengths in powers of two: padding rows and columns), else
    with the CPU's default sets."""
    target, head, draft = models
    cls, model = (Eagle3Backend, head) if kind == "eagle3" else (DraftLMBackend, draft)
    dynamic, fixed = cls(model, num_slots, 256, fixed_shapes=False), cls(model, num_slots, 256)
    if captured:
        fixed.use_fixed_shapes(True, *shape_sets(True, DRAFT_MAX_ROWS, fixed.kv.max_len))
    assert dynamic.static is None and fixed.static is not None
    run, fixed.static_runs = fixed.static._run, []
    fixed.static._run = lambda buf, *a: fixed.static_runs.append(buf["input_ids"].shape) or run(buf, *a)
    pending = {}
    for slot, prompt in PROMPTS.items():
        aux = target_aux(target, head, prompt) if kind == "eagle3" else None
        for b in (dynamic, fixed):
            pending[slot] = b.prefill(slot, prompt, aux)
    return dynamic, fixed, pending


def assert_same_out(got, expected):
    torch.testing.assert_close(got[0], expected[0], **TOL)
    assert (got[1] is None) == (expected[1] is None)
    if expected[1] is not None:
        torch.testing.assert_close(got[1], expected[1], **TOL)


def assert_same_cache(fixed, dynamic, num_slots: int = 3):
    """Every sequence slot's cache is the same (padding rows wrote only into the scratch slot)."""
    for store_f, store_d in ((fixed.kv.keys, dynamic.kv.keys), (fixed.kv.values, dynamic.kv.values)):
        for layer_f, layer_d in zip(store_f, store_d):
            cap = min(layer_f.shape[2], layer_d.shape[2])
            torch.testing.assert_close(layer_f[:num_slots, :, :cap], layer_d[:num_slots, :, :cap], **TOL)


def assert_same_proposals(got, expected):
    for g, e in zip(got, expected):
        assert (g.tokens, g.parents) == (e.tokens, e.parents)
        for a, b in ((g.q, e.q), (g.hidden, e.hidden)):
            assert (a is None) == (b is None)
            if b is not None:
                torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("kind", ["eagle3", "draft_lm"])
def test_fixed_shape_extend_and_step_equal_dynamic(kind, models):
    dynamic, fixed, _ = backend_pair(models, kind)
    off, H = fixed.offset, fixed.hidden_size
    gen = torch.Generator().manual_seed(0)
    chunks, slots = [[5, 6], [7], [8, 9, 10]], [0, 1, 2]
    starts = [len(PROMPTS[s]) - 1 - off for s in slots]
    feats = [torch.randn(len(c), H, generator=gen, dtype=torch.float64) for c in chunks] if H else None
    assert_same_out(fixed.extend(slots, chunks, starts, feats), dynamic.extend(slots, chunks, starts, feats))
    # a tree-masked step over 3 rows (bucket 4: one padding row), two of them trees of one sequence
    slots, n = [0, 0, 2], 4
    region = torch.tensor([starts[0] + 2, starts[0] + 2 + n, starts[2] + 3])[:, None]
    write = region + torch.arange(n)[None, :]
    kv_len = int(write.max()) + 1
    visible = torch.rand(3, n, kv_len, generator=gen) < 0.3
    for r, s in enumerate(slots):
        visible[r, :, : len(PROMPTS[s]) - 1 - off] = True
        visible[r].scatter_(1, write[r][:, None], True)
    tokens = torch.randint(0, 80, (3, n), generator=gen)
    positions = torch.tensor([[9, 10, 10, 11], [9, 9, 10, 11], [11, 12, 12, 13]])
    step_feats = torch.randn(3, n, H, generator=gen, dtype=torch.float64) if H else None
    assert_same_out(fixed.step(slots, tokens, positions, write, visible, step_feats),
                    dynamic.step(slots, tokens, positions, write, visible, step_feats))
    assert_same_cache(fixed, dynamic)
    assert fixed.static_runs == [(4, 3), (4, n)], "both forwards must run in fixed shapes (rows padded to 4)"
    assert fixed.forwards == dynamic.forwards == 2


@pytest.mark.parametrize("captured", [True, False], ids=["captured-sets", "cpu-sets"])
@pytest.mark.parametrize("tree", [None, TreeSettings(6, K, 2)], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["eagle3", "draft_lm"])
def test_fixed_shape_chains_and_trees_equal_dynamic(kind, tree, captured, models):
    dynamic, fixed, pending = backend_pair(models, kind, captured=captured)
    proposals = []
    for b in (dynamic, fixed):  # a greedy row and two sampled ones, with the same generators in both runs
        seqs = [SimpleNamespace(slot=s, token_ids=p, params=SamplingParams(temperature=0.0 if s == 0 else 0.8),
                                draft_generator=torch.Generator().manual_seed(s)) for s, p in PROMPTS.items()]
        proposals.append(draft_from_committed(b, seqs, [len(p) - 1 for p in PROMPTS.values()],
                                              [pending[s] for s in PROMPTS], [K, K - 1, K], tree=tree))
    assert_same_proposals(proposals[1], proposals[0])
    assert_same_cache(fixed, dynamic)
    assert len(fixed.static_runs) == fixed.forwards > 1


def _outcome(speculator: Speculator, slot: int, hit: bool, width: int) -> SpecRequest:
    """A verifier report for ``slot``: a cached outcome (hit) or an uncached bonus after the same path (miss)."""
    seq = speculator.seqs[slot]
    path, bonus = next(iter(seq.cache)) if hit else ((), next(t for t in range(80) if ((), t) not in seq.cache))
    aux = torch.randn(len(path) + 1, width, generator=torch.Generator().manual_seed(slot), dtype=torch.float64)
    return SpecRequest(slot, len(path), bonus, K, aux=aux if speculator.backend.needs_aux else None,
                       accepted=list(path))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("tree", [None, TreeSettings(6, K, 2)], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["eagle3", "draft_lm"])
def test_fixed_shape_branch_batches_equal_dynamic(kind, tree, temperature, models):
    """Seeded: the padding branches (the fixed shapes' fan-out budget, a short row's in both) draw nothing from
    the sequence's generator, so the sampled branches are the same whatever the batch's width."""
    target, head, _ = models
    dynamic, fixed, _ = backend_pair(models, kind)
    width = 3 * target.config.hidden_size
    fanout, fanout_miss = [2, 1, 1, 1], [3, 1, 1, 1]
    specs = [Speculator(b, K, fanout, fanout_miss, tree=tree) for b in (dynamic, fixed)]
    for spec in specs:
        for slot in (0, 1):  # fresh prefill: the fixture's slots are overwritten from position 0
            prompt = PROMPTS[slot]
            aux = target_aux(target, head, prompt) if kind == "eagle3" else None
            spec.add(slot, prompt, SamplingParams(temperature=temperature), seed=slot, aux=aux)
    replies = [spec.propose([SpecRequest(0, -1, 0, K), SpecRequest(1, -1, 0, K)]) for spec in specs]
    for spec in specs:
        spec.build()
    for rnd in range(2):  # slot 0 hits, slot 1 misses; then the other way round
        assert_same_proposals(replies[1], replies[0])
        for slot in (0, 1):
            got, expected = specs[1].seqs[slot].cache, specs[0].seqs[slot].cache
            assert got.keys() == expected.keys() and got
            assert_same_proposals(list(got.values()), list(expected.values()))
        if rnd == 1:
            break
        requests = [_outcome(specs[0], 0, True, width), _outcome(specs[0], 1, False, width)]
        replies = [spec.propose(requests) for spec in specs]
        assert [r.cache_hit for r in replies[1]] == [True, False]
        for spec in specs:
            spec.build()
    branches = max(sum(fanout), sum(fanout_miss))
    assert any(shape[1] == branches for shape in fixed.static_runs), "branches run at the fan-out budget's width"


@pytest.mark.parametrize("tree", [0, 6], ids=["chain", "tree"])
def test_ssd_eagle3_through_fixed_shapes_equals_greedy(tree, models, byte_tokenizer):
    target, head, _ = models
    engine = eagle_ssd_engine(target, head, byte_tokenizer, tree=tree, fanout=(20,) if tree else (60,))
    backend = engine.drafter.speculator.speculator.backend
    backend.use_fixed_shapes(True, *shape_sets(True, DRAFT_MAX_ROWS, backend.kv.max_len))  # padding rows too
    prompts = [[t % 80 for t in p] for p in random_prompts(4, seed=3)]
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=14))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 14, eos=set())
    stats = engine.stats
    assert stats.cache_hits > 0 and stats.cache_lookups - stats.cache_hits > 0, "hits and misses must both occur"
    assert backend.static._buffers, "the draft steps must have run in fixed shapes"


def test_sd_eagle3_tree_through_fixed_shapes_equals_greedy(models, byte_tokenizer):
    target, head, _ = models
    drafter = Eagle3Drafter(head, num_slots=3, max_len=256, tree=TreeSettings(6, K, 2))  # the default: fixed
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=3, max_model_len=200,
                       max_draft_tokens=6)
    prompts = [[t % 80 for t in p] for p in random_prompts(3, seed=5)]
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 12, eos=set())
    assert drafter.backend.static._buffers


def test_eager_turns_the_draft_steps_dynamic(models, byte_tokenizer):
    target, head, _ = models
    drafter = Eagle3Drafter(head, num_slots=2, max_len=256)
    assert drafter.backend.static is not None
    LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=2, max_model_len=200,
              cuda_graphs=False)
    assert drafter.backend.static is None


def test_seeded_ssd_gives_the_same_tokens_in_fixed_and_dynamic_shapes(models, byte_tokenizer):
    """A seeded sampled request: the fixed shapes' padding branches (always the larger of the hit and miss
    budgets wide) draw nothing from its generator, so it gets the same tokens as in dynamic shapes."""
    target, head, _ = models
    prompts = [[t % 80 for t in p] for p in random_prompts(2, seed=11)]
    spec = SpeculativeConfig(method="eagle3", model="in-memory", num_speculative_tokens=4, fanout=[40, 3, 2, 1],
                             fanout_miss=[60, 4, 2, 1], speculator="local")
    cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=2, max_model_len=256, speculative_config=spec)
    outputs = []
    for fixed in (False, True):
        engine = build(cfg, target, tokenizer=byte_tokenizer, draft=head)
        backend = engine.drafter.speculator.speculator.backend
        backend.use_fixed_shapes(fixed, *shape_sets(True, DRAFT_MAX_ROWS, backend.kv.max_len))
        outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.5, max_tokens=14, seed=7))
        outputs.append([o.token_ids for o in outs])
        assert engine.stats.cache_hits > 0
        assert bool(backend.static is not None and backend.static._buffers) == fixed
    assert outputs[0] == outputs[1]


def test_the_default_draft_path_on_cpu_is_fixed_shapes_with_the_cpu_sets(models, byte_tokenizer):
    target, head, draft = models
    for backend in (Eagle3Drafter(head, num_slots=2, max_len=100).backend, DraftLMBackend(draft, 2, 100),
                    eagle_ssd_engine(target, head, byte_tokenizer).drafter.speculator.speculator.backend):
        static = backend.static
        assert static is not None and not static.use_graphs
        assert static.buckets == tuple(range(1, DRAFT_MAX_ROWS + 1))  # no padding rows on CPU
        L = backend.kv.max_len
        assert static.kv_lengths == tuple(range(EAGER_KV_STEP, L, EAGER_KV_STEP)) + (L,)
        assert static.scratch == backend.kv.num_slots - 1


def test_shape_sets_and_shape_for_on_a_hand_checked_table():
    assert shape_sets(True, 256, 1000) == ((1, 2, 4, 8, 16, 32, 64, 128, 256), (128, 256, 512, 1000))
    assert shape_sets(True, 6, 128) == ((1, 2, 4), (128,))
    assert shape_sets(False, 4, 50) == ((1, 2, 3, 4), (16, 32, 48, 50))
    kv = SimpleNamespace(max_len=300, reserve=None)
    static = StaticForward(None, kv, 0, torch.float32, "cpu", buckets=(1, 2, 4), widths=None,
                           kv_lengths=cache_lengths(300, None))
    assert static.kv_lengths == (128, 256, 300)
    # (rows, width, attended length) -> (bucket, width, padded length); the length must hold the new tokens too
    table = {(3, 1, 130): (4, 1, 256), (1, 6, 250): (1, 6, 256), (1, 6, 251): (1, 6, 300), (2, 24, 100): (2, 24, 128),
             (1, 1, 299): (1, 1, 300), (1, 1, 300): None, (5, 1, 10): None}
    for args, expected in table.items():
        assert static.shape_for(*args) == expected, args
    rows, lengths = shape_sets(False, 4, 300)
    eager = StaticForward(None, kv, 0, torch.float32, "cpu", rows, widths=None, kv_lengths=lengths)
    assert [eager.shape_for(3, 1, 20), eager.shape_for(4, 5, 27), eager.shape_for(1, 1, 299)] == \
        [(3, 1, 32), (4, 5, 32), (1, 1, 300)]
    with pytest.raises(ValueError, match="step"):
        cache_lengths(100, 0)
    with pytest.raises(ValueError, match="max_len"):
        StaticForward(None, kv, 0, torch.float32, "cpu", kv_lengths=(128, 256))


def test_eager_fixed_shapes_keep_a_bounded_set_of_buffers():
    """Eager runs (CPU sets: a new shape every 16 cached tokens) keep only the most recently used buffer sets."""
    kv = KVCache(1, 2, 1, 4, 2048, torch.float64, "cpu")
    rows, lengths = shape_sets(False, 4, 2048)
    static = StaticForward(lambda batch: {"logits": batch.input_ids[..., None].double()}, kv, 1, torch.float64,
                           "cpu", rows, widths=None, kv_lengths=lengths)
    for start in range(0, 1600, 16):  # 100 cache lengths
        static(ForwardBatch.causal([[3]], [0], [start], torch.float64, "cpu"))
    assert len(static._buffers) == EAGER_BUFFERS
    assert next(reversed(static._buffers)) == (1, 1, 1600, 0), "the latest shape is kept"


@pytest.mark.parametrize("tree", [None, TreeSettings(6, K, 2)], ids=["chain", "tree"])
def test_a_backup_draft_outside_inference_mode_reuses_buffers_a_build_made_inside(tree, models):
    """The SSD worker drafts its neural backup outside inference mode, after builds (in inference mode) made the
    fixed-shape buffers: inference tensors, which an in-place fill outside inference mode may not touch. Regression:
    a tree backup crashed the speculator process with "Inplace update to inference tensor outside InferenceMode"."""
    _, fixed, pending = backend_pair(models, "eagle3")
    seqs = [SimpleNamespace(slot=s, token_ids=p, params=SamplingParams(temperature=0.0),
                            draft_generator=torch.Generator().manual_seed(s)) for s, p in PROMPTS.items()]
    args = (fixed, seqs, [len(p) - 1 for p in PROMPTS.values()], [pending[s] for s in PROMPTS], [K] * len(seqs))
    with torch.inference_mode():
        first = draft_from_committed(*args, tree=tree)
    again = draft_from_committed(*args, tree=tree)
    assert [p.tokens for p in again] == [p.tokens for p in first]
