"""Helpers of the serving-engine tests (chunked prefill, prefix caching, the KV budget): engines over a tiny float64
target in every mode, long prompts, and a drafter that records what ``add_sequence`` hands it.

Import them as ``from serving_helpers import ...`` (``tests/`` is on the path), like :mod:`helpers`.
"""

from __future__ import annotations

import torch

from helpers import eagle3_head_for, make_tiny_llama, noisy_copy
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.drafters import DraftModelDrafter, NgramDrafter
from ssd_eagle.drafters.base import Drafter, Proposal
from ssd_eagle.drafters.eagle3 import Eagle3Drafter
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.engine.factory import build

K = 4
KINDS = ["ar", "ngram", "draft", "eagle3", "ssd"]


def make_target():
    return make_tiny_llama(seed=4, num_layers=8)


def build_engine(kind: str, target, tokenizer, max_num_seqs: int = 2, **engine_args) -> LLMEngine:
    """An engine over ``target`` in one of ``KINDS`` (SSD with its speculator in this process)."""
    if kind == "ssd":
        spec = SpeculativeConfig(method="draft_model", model="in-memory", num_speculative_tokens=K, fanout=[2],
                                 speculator="local")
        cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=max_num_seqs, max_model_len=512,
                           speculative_config=spec)
        # the factory's SSD drafter (an in-process speculator), in an engine with this helper's arguments
        drafter = build(cfg, target, tokenizer=tokenizer, draft=noisy_copy(target, 0.02)).drafter
    else:
        drafter = {"ar": lambda: None, "ngram": lambda: NgramDrafter(1, 3),
                   "draft": lambda: DraftModelDrafter(noisy_copy(target, 0.05), target.config.vocab_size,
                                                      max_num_seqs, 512),
                   "eagle3": lambda: Eagle3Drafter(eagle3_head_for(target, draft_vocab=257),
                                                   num_slots=max_num_seqs, max_len=512)}[kind]()
    return LLMEngine(target, tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=max_num_seqs,
                     max_model_len=512, **engine_args)


def long_prompts(seed: int, lengths=(150, 3, 97, 64, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    if len(prompts) > 2:
        prompts[2] = (prompts[2][:7] * 20)[: lengths[2]]  # repetitive: something for the n-gram drafter
    return prompts


class RecordingAuxDrafter(Drafter):
    """Proposes nothing; records every ``add_sequence`` with its prompt aux states."""

    needs_aux_hidden = True
    name = "recording"

    def __init__(self, aux_layer_ids):
        self.aux_layer_ids, self.added = aux_layer_ids, []

    def add_sequence(self, seq, prompt_aux):
        self.added.append((seq.request_id, list(seq.token_ids), prompt_aux.clone(), seq.num_reused))

    def propose(self, seqs, num_tokens):
        return [Proposal([]) for _ in seqs]
