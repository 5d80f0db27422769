"""GPU paths: CUDA-graph replays equal eager forwards, the engine stays lossless with graphs, SSD runs as two
processes on one GPU, and a sampled round verifies a q that lives on the CPU (the speculator's default device, or
a reply received over gloo). Run by ``scripts/gpu_check.sh``; skipped where no CUDA device exists."""

from __future__ import annotations

import pytest
import torch

from helpers import eagle3_head_for, make_drafter, make_tiny_llama, noisy_copy, random_prompts, reference_greedy
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.cuda_graphs import StaticForward, runner_forward_fn
from ssd_eagle.drafters.base import Drafter, Proposal
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.protocol import decode_reply, encode_reply

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (scripts/gpu_check.sh runs these on a GPU machine)")


def _cuda(model):
    return model.to("cuda")


def test_graph_replay_equals_eager_forward():
    target = _cuda(make_tiny_llama(seed=7, num_layers=8))
    eager = ModelRunner(target, 4, 512, aux_layer_ids=(2, 4, 5))
    graphed = ModelRunner(target, 4, 512, aux_layer_ids=(2, 4, 5))
    static = StaticForward(runner_forward_fn(graphed, True), graphed.kv, scratch_slot=3, dtype=torch.float64,
                           device="cuda", buckets=(1, 2, 4), widths=(1, 6), enabled=True)
    for runner in (eager, graphed):
        for slot in range(3):
            runner.forward(ForwardBatch.causal([list(range(10 + slot, 40))], [slot], [0], torch.float64, "cuda"))
    for step in range(3):  # replays of one captured graph with new inputs
        tokens = [[1 + step, 2, 3, 4, 5], [6 + step], [7, 8 + step]]
        batch = ForwardBatch.causal(tokens, [0, 1, 2], [30 + 5 * step, 29 + 5 * step, 28 + 5 * step],
                                    torch.float64, "cuda")
        expected = eager.forward(batch, capture_aux=True)
        got = static(batch)
        for row, t in enumerate(tokens):
            torch.testing.assert_close(got["logits"][row, : len(t)], expected.logits[row, : len(t)], rtol=0,
                                       atol=1e-9)
            torch.testing.assert_close(got["aux_hidden"][row, : len(t)], expected.aux_hidden[row, : len(t)],
                                       rtol=0, atol=1e-9)
    assert static._graphs, "no CUDA graph was captured"


@pytest.mark.parametrize("kind", ["ar", "noisy"])
def test_engine_with_cuda_graphs_is_lossless(kind, byte_tokenizer):
    target = _cuda(make_tiny_llama(seed=3))
    engine = LLMEngine(target, byte_tokenizer, make_drafter(kind, target), num_speculative_tokens=4,
                       max_num_seqs=3, max_model_len=512, cuda_graphs=True)
    assert engine.static is not None
    prompts = random_prompts(4, seed=9)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    cpu_target = target.to("cpu")
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(cpu_target, prompt, 16)
    assert engine.static._graphs


def test_ssd_two_processes_on_one_gpu(byte_tokenizer):
    target = _cuda(make_tiny_llama(seed=3))
    draft = noisy_copy(target, 0.02)
    spec = SpeculativeConfig(method="draft_model", model="in-memory", num_speculative_tokens=4, fanout=[2])
    cfg = EngineConfig(model="in-memory", mode="ssd", device="cuda:0", draft_device="cuda:0", max_num_seqs=2,
                       max_model_len=512, speculative_config=spec)
    engine = build(cfg, target, tokenizer=byte_tokenizer, draft=draft)
    try:
        prompts = random_prompts(2, seed=4)
        outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
        cpu_target = target.to("cpu")
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(cpu_target, prompt, 16)
        assert engine.stats.cache_hits > 0
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["eagle3", "draft_lm"])
def test_draft_step_graph_replay_equals_eager(kind):
    """The draft's steps (EAGLE-3 head, draft LM): captured once per shape, replayed with new inputs, equal to the
    dynamic forward; outputs of an earlier replay survive the next one (the trees keep them)."""
    from helpers import eagle3_head_for
    from ssd_eagle.drafters.backends import DraftLMBackend, Eagle3Backend

    target = make_tiny_llama(seed=4, num_layers=8, vocab_size=80, max_positions=256)
    model = eagle3_head_for(target, draft_vocab=80) if kind == "eagle3" else noisy_copy(target, 0.02)
    model = _cuda(model)
    cls = Eagle3Backend if kind == "eagle3" else DraftLMBackend
    eager, graphed = cls(model, 3, 256, fixed_shapes=False), cls(model, 3, 256)
    assert graphed.static is not None and graphed.static.use_graphs
    gen = torch.Generator().manual_seed(0)
    H = graphed.hidden_size
    auxes = [torch.randn(19, 3 * target.config.hidden_size, generator=gen, dtype=torch.float64).cuda() if H else None
             for _ in range(3)]  # (the same prompt states for both backends)
    for b in (eager, graphed):
        for slot in range(3):
            b.prefill(slot, list(range(10 + slot, 30 + slot)), auxes[slot])
    kept = []
    for step in range(3):  # the same (bucket 4, width 4) each time: one capture, then replays
        slots, n = [0, 0, 2], 4
        write = torch.tensor([[20], [24], [28]]) + 4 * step + torch.arange(n)[None, :]
        visible = torch.rand(3, n, int(write.max()) + 1, generator=gen) < 0.3
        visible[:, :, :18] = True
        visible.scatter_(2, write[..., None], True)
        tokens = torch.randint(0, 80, (3, n), generator=gen)
        positions = 19 + step + torch.tensor([[1, 2, 2, 3]] * 3)
        feats = torch.randn(3, n, H, generator=gen, dtype=torch.float64).cuda() if H else None
        expected = eager.step(slots, tokens, positions, write, visible, feats)
        got = graphed.step(slots, tokens, positions, write, visible, feats)
        for g, e in zip(got, expected):
            if e is not None:
                torch.testing.assert_close(g, e, rtol=0, atol=1e-9)
        kept.append((got[0], got[0].clone()))
    for view, copy in kept:
        torch.testing.assert_close(view, copy, rtol=0, atol=0)
    assert len(graphed.static._graphs) == 1, "one shape: captured once, replayed after"


# ----------------------------------------------------------------------------------------------------------------
# sampled rounds whose q lives on another device than the target (drafts over the head's own vocabulary)

QV, QD, QK = 80, 24, 3


def test_in_process_ssd_eagle3_on_a_gpu_target_with_the_cpu_speculator_samples(byte_tokenizer):
    """The default SSD placement on a GPU: target on cuda, speculator (draft_device) on the CPU, T = 1."""
    target = make_tiny_llama(vocab_size=QV, seed=4, num_layers=8, max_positions=256)
    head = eagle3_head_for(target, draft_vocab=QD, seed=1)
    spec = SpeculativeConfig(method="eagle3", model="in-memory", num_speculative_tokens=QK, fanout=[2],
                             speculator="local")
    cfg = EngineConfig(model="in-memory", mode="ssd", device="cuda", draft_device="cpu", max_num_seqs=2,
                       max_model_len=256, speculative_config=spec)
    engine = build(cfg, target.to("cuda"), tokenizer=byte_tokenizer, draft=head)
    outs = LLM(engine=engine).generate([[7, 7, 1, 2, 3, 9], [4, 4, 8, 1]],
                                       SamplingParams(temperature=1.0, max_tokens=16, seed=11, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)
    assert engine.drafter.healthy


class WireDrafter(Drafter):
    """Proposals as :class:`~ssd_eagle.ssd.client.SpeculatorLink` hands them over from a gloo link: decoded from a
    reply, on the CPU (a sampled chain drawn from a uniform q over a few tokens)."""

    def propose(self, seqs, num_tokens):
        out = []
        for n in num_tokens:
            k = min(n, 2)
            q = torch.zeros(k, QV, dtype=torch.float64)
            q[:, [5, 9, 11, 12]] = 0.25
            out.append(decode_reply(encode_reply([Proposal([9] * k, q)]), QV)[0])
        return out


def test_a_reply_decoded_on_the_cpu_is_verified_by_a_gpu_target(byte_tokenizer):
    """``speculator: process`` over gloo (CPU speculator, or one on the target's own GPU): q arrives on the CPU."""
    target = make_tiny_llama(vocab_size=QV, seed=4, num_layers=8, max_positions=256).to("cuda")
    engine = LLMEngine(target, byte_tokenizer, WireDrafter(), num_speculative_tokens=QK, max_num_seqs=1,
                       max_model_len=256)
    out = LLM(engine=engine).generate([[7, 7, 1, 2]], SamplingParams(temperature=1.0, max_tokens=8, seed=3,
                                                                     ignore_eos=True))
    assert len(out[0].token_ids) == 8
