"""The EAGLE-3 drafter inside the engine: greedy losslessness, and incremental head state equal to a fresh
computation from the committed text."""

from __future__ import annotations

import pytest
import torch

from helpers import eagle3_head_for, make_tiny_llama, random_prompts, reference_greedy
from ssd_eagle.drafters.eagle3 import Eagle3Drafter
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.sampling_params import SamplingParams

K = 4


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_greedy_output_equals_target_greedy(tie, byte_tokenizer):
    target = make_tiny_llama(tie=tie, seed=4, num_layers=8)
    drafter = Eagle3Drafter(eagle3_head_for(target), num_slots=3, max_len=512)
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=3, max_model_len=512)
    prompts = random_prompts(6, seed=2)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 16)
    assert engine.stats.num_drafted > 0


class PartlyRightDrafter(Eagle3Drafter):
    """Runs the head as usual, then replaces the first r drafts by the target's greedy continuation (r cycling
    0..K), so that rounds accept every k from 0 to K while the head's own cache keeps its self-fed entries."""

    def __init__(self, target, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.target, self.calls = target, 0

    def propose(self, seqs, num_tokens):
        proposals = super().propose(seqs, num_tokens)
        for seq, p in zip(seqs, proposals):
            r = self.calls % (K + 1)
            p.tokens[:r] = reference_greedy(self.target, seq.token_ids, len(p.tokens[:r]), eos=set())
            self.calls += 1
        return proposals


def test_incremental_head_state_equals_fresh_computation(byte_tokenizer):
    """After rounds with every accepted length 0..K, drafting from the drafter's incremental cache gives the same
    drafts as a new drafter prefilled from scratch with the target's features of the committed text."""
    target = make_tiny_llama(seed=4, num_layers=8)
    head = eagle3_head_for(target, draft_vocab=257)
    drafter = PartlyRightDrafter(target, head, num_slots=2, max_len=512)
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=2, max_model_len=512)
    engine.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=0.0, max_tokens=100,
                                                                    ignore_eos=True))
    for _ in range(2 * (K + 1)):
        engine.step()
    seq = engine.requests["a"]
    assert set(seq.stats.accepted_lengths) == set(range(K + 1))
    incremental = Eagle3Drafter.propose(drafter, [seq], [K])[0].tokens

    runner = ModelRunner(target, 1, 512, aux_layer_ids=drafter.aux_layer_ids)
    committed = seq.token_ids[:-1]
    aux = runner.forward(ForwardBatch.causal([committed], [0], [0], torch.float64, "cpu"), capture_aux=True,
                         compute_logits=False).aux_hidden[0]
    fresh = Eagle3Drafter(head, num_slots=2, max_len=512)
    fresh.add_sequence(seq, aux)
    assert fresh.propose([seq], [K])[0].tokens == incremental


def test_head_that_mismatches_the_target_is_refused(tmp_path):
    from ssd_eagle.models.eagle3_formats import save_eagle3

    target = make_tiny_llama(seed=1)
    save_eagle3(eagle3_head_for(target), tmp_path / "head")
    other = make_tiny_llama(seed=1, max_positions=1024)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Eagle3Drafter.from_pretrained(str(tmp_path / "head"), other, 1, 512)
    assert Eagle3Drafter.from_pretrained(str(tmp_path / "head"), target, 1, 512).aux_layer_ids == (0, 2, 4)
