"""Drafting over an EAGLE-3 head's own vocabulary (logits [.., D], :attr:`DraftBackend.vocab`) gives what drafting
over the target's vocabulary (the head's logits scattered into [.., V] with -inf elsewhere) gave: the same tokens,
the same q once made dense (0 off the draft vocabulary; equal to rounding: a softmax over D columns sums its terms
in another order than one over V), the same trees, speculation caches and seeded outputs, at T = 0 and T > 0, with
top-k and Saguaro scaling. Losslessness does not rest on this: the verifier tests every token with the q it was
drawn from. A head whose draft vocabulary is not in ascending target-id order (a third-party checkpoint) drafts,
replies and plans fan-outs correctly too; q on another device than the target's: tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import eagle3_head_for, make_tiny_llama
from ssd_eagle.drafters.backends import Eagle3Backend
from ssd_eagle.drafters.base import Proposal, SaguaroSampling
from ssd_eagle.drafters.eagle3 import Eagle3Drafter
from ssd_eagle.drafters.neural import draft_from_committed
from ssd_eagle.drafters.tree import TreeSettings
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.branch_trees import NodeLayout, draft_land_probabilities
from ssd_eagle.ssd.protocol import decode_reply, encode_reply
from ssd_eagle.ssd.speculator import Speculator, SpecRequest

V, D, K = 80, 24, 3
COMMITTED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


@pytest.fixture(scope="module")
def target_and_head():
    target = make_tiny_llama(vocab_size=V, seed=4, num_layers=8, max_positions=256)
    return target, eagle3_head_for(target, draft_vocab=D, seed=1)


def over_target_vocab(backend: Eagle3Backend) -> Eagle3Backend:
    """The backend as it drafted before: logits scattered into the target's vocabulary, no column map."""
    run = backend.run

    def run_over_target_vocab(batch, features, logits_index=None):
        logits, outputs = run(batch, features, logits_index)
        return backend.head.to_target_logits(logits), outputs

    backend.run = run_over_target_vocab
    backend.vocab = None
    return backend


def backends(head) -> tuple[Eagle3Backend, Eagle3Backend]:
    new = Eagle3Backend(head, 1, 256, fixed_shapes=False)
    assert new.vocab is not None and new.vocab.numel() == D
    return new, over_target_vocab(Eagle3Backend(head, 1, 256, fixed_shapes=False))


def committed_aux(target, head) -> torch.Tensor:
    runner = ModelRunner(target, 1, 256, aux_layer_ids=head.config.aux_layer_ids)
    return runner.forward(ForwardBatch.causal([COMMITTED[:-1]], [0], [0], torch.float64, "cpu"), capture_aux=True,
                          compute_logits=False).aux_hidden[0]


def assert_same(got: Proposal, want: Proposal) -> None:
    assert (got.tokens, got.parents) == (want.tokens, want.parents)
    assert (got.q is None) == (want.q is None)
    if want.q is not None:
        assert want.q_ids is None and got.q_ids is not None and got.q.shape[-1] == D
        torch.testing.assert_close(got.dense_q(V), want.q, rtol=1e-12, atol=1e-15)


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9),
          SamplingParams(temperature=1.0, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "t0.9", "topk-topp"])
@pytest.mark.parametrize("saguaro", [None, SaguaroSampling(0.5, (2, 1))], ids=["plain", "saguaro"])
@pytest.mark.parametrize("tree", [None, TreeSettings(6, K, 2)], ids=["chain", "tree"])
def test_sd_drafts_over_the_draft_vocabulary_equal_the_target_vocabulary_ones(target_and_head, params, saguaro,
                                                                              tree):
    target, head = target_and_head
    aux = committed_aux(target, head)
    drafts = []
    for backend in backends(head):
        pending = backend.prefill(0, COMMITTED, aux)
        seq = SimpleNamespace(slot=0, token_ids=COMMITTED, params=params,
                              draft_generator=torch.Generator().manual_seed(7))
        drafts.append(draft_from_committed(backend, [seq], [len(COMMITTED) - 1], [pending], [K], saguaro, tree)[0])
    assert len(drafts[0].tokens) == (K if tree is None else 6)
    assert_same(*drafts)


@pytest.mark.parametrize("params", PARAMS[:2], ids=["greedy", "t0.9"])
@pytest.mark.parametrize("tree", [None, TreeSettings(6, K, 2)], ids=["chain", "tree"])
def test_speculation_caches_and_replies_are_the_same(target_and_head, params, tree):
    """The build's bonus candidates, land probabilities and branch drafts, and the replies that go on the wire."""
    target, head = target_and_head
    aux = committed_aux(target, head)
    specs = []
    for backend in backends(head):
        spec = Speculator(backend, K, [3] * (K + 1), tree=tree)
        spec.add(0, COMMITTED, params, seed=5, aux=aux)
        first = spec.propose([SpecRequest(0, -1, 0, K)])[0]
        spec.build()
        specs.append((spec, first))
    (new, first_new), (old, first_old) = specs
    assert_same(first_new, first_old)
    assert new.seqs[0].candidates == old.seqs[0].candidates
    assert new.seqs[0].nodes[2] == pytest.approx(old.seqs[0].nodes[2], rel=1e-6)  # (computed in float32)
    assert new.seqs[0].cache.keys() == old.seqs[0].cache.keys() and new.seqs[0].cache
    for key in old.seqs[0].cache:
        assert_same(new.seqs[0].cache[key], old.seqs[0].cache[key])
    wire = decode_reply(encode_reply([new.seqs[0].cache[key] for key in new.seqs[0].cache]), V)
    for got, key in zip(wire, old.seqs[0].cache):
        want = old.seqs[0].cache[key]
        assert got.tokens == want.tokens and (got.q is None) == (want.q is None)
        if want.q is not None:
            assert got.q.shape[-1] <= D  # on its support: at most the draft vocabulary
            torch.testing.assert_close(got.dense_q(V), want.q.to(got.q.dtype), rtol=1e-12, atol=1e-15)


def test_seeded_sd_outputs_are_the_same_at_t1(target_and_head, byte_tokenizer):
    """The engine's rejection test reads q over the drafter's columns (``Proposal.q_ids``): a seeded request
    gives the same tokens as with q over the target's vocabulary."""
    target, head = target_and_head
    prompts = [[7, 7, 1, 2, 3, 9], [4, 4, 8, 1]]
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True)
    outs = []
    for reference in (False, True):
        drafter = Eagle3Drafter(head, num_slots=2, max_len=256)
        if reference:
            over_target_vocab(drafter.backend)
        engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=2,
                           max_model_len=256)
        outs.append([o.token_ids for o in LLM(engine=engine).generate(prompts, params)])
    assert outs[0] == outs[1]


def test_a_reply_mixing_column_sets_keeps_every_q():
    """A reply whose proposals carry q over different columns (a head's vocabulary, the full vocabulary) decodes
    to the same dense q for each."""
    ids = torch.tensor([2, 5, 9])
    own = Proposal([5, 9], torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.25, 0.75]], dtype=torch.float64), q_ids=ids)
    dense = torch.zeros(1, 12, dtype=torch.float64)
    dense[0, [1, 9]] = 0.5
    full = Proposal([1], dense)
    got = decode_reply(encode_reply([own, Proposal([3]), full]), 12)
    assert got[1].q is None
    torch.testing.assert_close(got[0].dense_q(12), own.dense_q(12), rtol=0, atol=0)
    torch.testing.assert_close(got[2].dense_q(12), dense, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode_reply(encode_reply([own]), 9)


# --- a third-party head's vocabulary in any order (found in review)

def descending_head(target):
    """A head whose draft ids map to target ids in descending order: an injective d2t, which
    ``check_vocab_mapping`` accepts (a third-party checkpoint may order its draft vocabulary any way)."""
    head = eagle3_head_for(target, draft_vocab=D, seed=1)
    ids = head.draft_target_ids.flip(0)
    head.set_vocab_mapping(ids - torch.arange(D), head.t2d.clone())  # accepted
    return head




def test_a_sampled_reply_of_a_head_with_an_unsorted_vocabulary_decodes():
    target = make_tiny_llama(vocab_size=V, seed=4, num_layers=8, max_positions=256)
    head = descending_head(target)
    backend = Eagle3Backend(head, 1, 256, fixed_shapes=False)
    pending = backend.prefill(0, COMMITTED, committed_aux(target, head))
    seq = SimpleNamespace(slot=0, token_ids=COMMITTED, params=SamplingParams(temperature=1.0),
                          draft_generator=torch.Generator().manual_seed(7))
    draft = draft_from_committed(backend, [seq], [len(COMMITTED) - 1], [pending], [K])[0]
    got = decode_reply(encode_reply([draft]), V)[0]  # raises: "reply q support [...] outside the vocabulary"
    torch.testing.assert_close(got.dense_q(V), draft.dense_q(V), rtol=0, atol=0)


def test_land_probabilities_of_a_head_with_an_unsorted_vocabulary():
    """Over the draft's columns, the land probabilities equal those over the target's vocabulary."""
    torch.manual_seed(0)
    vocab = torch.tensor([40, 30, 20, 10])  # column c scores target id vocab[c]
    logits = torch.randn(3, 4, dtype=torch.float64)
    dense = torch.full((3, V), float("-inf"), dtype=torch.float64).index_copy_(1, vocab, logits)
    proposal = Proposal([30, 10])  # a chain: node 1 = token 30 (column 1), node 2 = token 10 (column 3)
    nodes = NodeLayout.of(proposal)
    want = draft_land_probabilities(dense, nodes, proposal.tokens)
    got = draft_land_probabilities(logits, nodes, proposal.tokens, vocab)
    assert got == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# a draft LM with a draft vocabulary (``ssd_eagle.draft_vocab`` in its config)

def draft_lm_with_vocab(target, ids: list[int]):
    from ssd_eagle.models.draft_lm import draft_vocab_ids

    draft = make_tiny_llama(vocab_size=V, seed=9, num_layers=2, max_positions=256)
    draft.config.ssd_eagle = {"draft_vocab": ids}
    assert draft_vocab_ids(draft.config).tolist() == ids
    return draft


def masked_to_vocab(backend, ids: torch.Tensor):
    """The reference: the whole output layer, every logit off ``ids`` set to -inf, no column map."""
    run = backend.run

    def run_masked(batch, features=None, logits_index=None):
        logits, out = run(batch, features, logits_index)
        masked = torch.full_like(logits, float("-inf"))
        masked[..., ids] = logits[..., ids]
        return masked, out

    backend.run = run_masked
    return backend


DRAFT_IDS = sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:D].tolist())


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "t0.9", "topk-topp"])
@pytest.mark.parametrize("tree", [None, TreeSettings(6, K, 2)], ids=["chain", "tree"])
def test_a_draft_lm_drafts_over_its_recorded_vocabulary(target_and_head, params, tree):
    from ssd_eagle.drafters.backends import DraftLMBackend

    draft = draft_lm_with_vocab(target_and_head[0], DRAFT_IDS)
    new = DraftLMBackend(draft, 1, 256, fixed_shapes=False)
    assert new.vocab.tolist() == DRAFT_IDS and new.runner.lm_head.weight.shape == (D, 64)
    del draft.config.ssd_eagle
    ref = masked_to_vocab(DraftLMBackend(draft, 1, 256, fixed_shapes=False), torch.tensor(DRAFT_IDS))
    assert ref.vocab is None
    drafts = []
    for backend in (new, ref):
        backend.prefill(0, COMMITTED)
        seq = SimpleNamespace(slot=0, token_ids=COMMITTED, params=params,
                              draft_generator=torch.Generator().manual_seed(7))
        drafts.append(draft_from_committed(backend, [seq], [len(COMMITTED) - 1], [None], [K], None, tree)[0])
    got, want = drafts
    assert got.tokens == want.tokens and set(got.tokens) <= set(DRAFT_IDS)
    if want.q is not None:
        torch.testing.assert_close(got.dense_q(V), want.q, rtol=1e-12, atol=1e-15)


def test_seeded_sd_outputs_of_a_draft_lm_with_a_vocabulary_equal_the_masked_reference(target_and_head,
                                                                                      byte_tokenizer):
    """The rejection test reads the draft LM's q over its columns: a seeded T = 1 request gives the tokens it gives
    with the masked whole-vocabulary draft; at T = 0 the output is the target's greedy decode."""
    from ssd_eagle.drafters.draft_model import DraftModelDrafter

    target = target_and_head[0]
    prompts = [[7, 7, 1, 2, 3, 9], [4, 4, 8, 1]]
    outs = {}
    for name in ("vocab", "masked"):
        draft = draft_lm_with_vocab(target, DRAFT_IDS)
        if name == "masked":
            del draft.config.ssd_eagle
        drafter = DraftModelDrafter(draft, V, num_slots=2, max_len=256)
        if name == "masked":
            masked_to_vocab(drafter.backend, torch.tensor(DRAFT_IDS))
        engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=2,
                           max_model_len=256)
        llm = LLM(engine=engine)
        outs[name] = [o.token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True))]
        if name == "vocab":
            greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                                                ignore_eos=True))]
    assert outs["vocab"] == outs["masked"]
    with torch.no_grad():
        for prompt, got in zip(prompts, greedy):
            want = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None)[0, len(prompt):].tolist()
            assert got == want


def test_a_malformed_draft_vocabulary_is_refused():
    from ssd_eagle.models.draft_lm import draft_vocab_ids

    for ids in ([3, 2], [0, V], [-1, 4], []):
        config = SimpleNamespace(vocab_size=V, ssd_eagle={"draft_vocab": ids})
        with pytest.raises(ValueError, match="draft_vocab"):
            draft_vocab_ids(config)
