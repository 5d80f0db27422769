"""Shared test helpers: tiny models and tokenizers, reference decodes, the exact output law, and the CI rule.

Import them as ``from helpers import ...`` (``tests/`` is on the path); test modules never import each other.
Exact-token tests run the tiny models in float64, where batched and one-token forwards agree far below any logit
gap, so token equality is a fair test. The byte-level tokenizer maps token i < 256 to byte i, so multi-byte UTF-8
characters are split across tokens (streaming tests need that); id 256 is ``<eos>``.

The CI rule: a test that needs a packaged real model or prompt package skips when it is missing, except under
``CI=true``, where it must run and a missing package fails it (:func:`real_model_or_skip`).
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ssd_eagle.drafters import DraftModelDrafter, NgramDrafter
from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel

EOS_ID = 256
LAW_VOCAB, LAW_TOKENS = 4, 4  # the output-law tests: a 4-token vocabulary, 4 sampled tokens (256 sequences)


# ----------------------------------------------------------------------------------------------------------------
# tiny tokenizer and models

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what the ByteLevel pre-tokenizer uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer of the module docstring, with a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>")
    tok.add_special_tokens({"eos_token": "<eos>"})
    assert tok.eos_token_id == EOS_ID
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tok


def make_tiny_llama(vocab_size: int = 257, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4,
                    num_kv_heads: int = 2, tie: bool = False, seed: int = 0, dtype=torch.float64,
                    max_positions: int = 512, init_std: float = 0.3) -> LlamaForCausalLM:
    """A random Llama target; ``init_std`` well above the default gives peaked, decisive logits."""
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=tie, initializer_range=init_std,
                      bos_token_id=None, eos_token_id=EOS_ID if vocab_size > EOS_ID else None,
                      pad_token_id=None, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


# ----------------------------------------------------------------------------------------------------------------
# drafts and prompts

def reference_greedy(model, prompt: list[int], max_tokens: int, eos: set[int] = frozenset({EOS_ID})) -> list[int]:
    """The target's own greedy decode, recomputed from scratch every token (no cache at all)."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            out.append(token)
            if token in eos:
                break
    return out


def noisy_copy(model, scale: float, seed: int = 1):
    """A draft that agrees with the target most of the time."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) * scale * p.std())
    return draft


def make_drafter(kind: str, target, num_slots: int = 4):
    """The SD drafter named ``kind``: ``ar`` (None), ``ngram``, ``exact`` (a draft equal to the target) or
    ``noisy`` (:func:`noisy_copy`)."""
    if kind == "ar":
        return None
    if kind == "ngram":
        return NgramDrafter(1, 3)
    scale = {"exact": 0.0, "noisy": 0.05}[kind]
    return DraftModelDrafter(noisy_copy(target, scale), target.config.vocab_size, num_slots, 512)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` byte prompts of 1-40 tokens; the first is one token long, the second repetitive (n-gram hits)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 41, (n,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (L,), generator=g).tolist() for L in lengths]
    prompts[0] = [7]  # a one-token prompt
    # repetitive prompts give the n-gram drafter something to find
    prompts[1] = (prompts[1][:5] * 8)[:40]
    return prompts


def eagle3_head_for(target, draft_vocab: int = 200, seed: int = 0) -> Eagle3DraftModel:
    """A random float64 EAGLE-3 head for ``target`` (peaked logits: ``std=0.3``), sharing its embeddings."""
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab, torch_dtype="float64")
    torch.manual_seed(seed)
    head = Eagle3DraftModel(cfg).to(torch.float64)
    head.init_weights(std=0.3)
    used = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head.set_vocab_mapping(*Eagle3DraftModel.build_vocab_mapping(used, target.config.vocab_size, draft_vocab))
    head.set_embeddings(target.get_input_embeddings())
    return head.eval()


# ----------------------------------------------------------------------------------------------------------------
# the output law at T > 0

def exact_law(target, prompt: list[int], temperature: float) -> np.ndarray:
    """P(x_1..x_4 | prompt) under the target sampled at ``temperature``, for all ``LAW_VOCAB ** LAW_TOKENS``
    continuations (flattened, first token most significant)."""
    law = np.ones([LAW_VOCAB] * LAW_TOKENS)
    seqs = list(itertools.product(range(LAW_VOCAB), repeat=LAW_TOKENS - 1))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        probs = torch.softmax(target(ids).logits[:, len(prompt) - 1:] / temperature, dim=-1).numpy()
    for row, s in enumerate(seqs):
        for x4 in range(LAW_VOCAB):
            full = (*s, x4)
            p = 1.0
            for j, tok in enumerate(full):
                p *= probs[row, j, tok]
            law[full] = p
    return law.reshape(-1)


def pooled_chisquare(counts: np.ndarray, law: np.ndarray) -> float:
    """Chi-square p-value, pooling cells whose expected count is below 5 into one."""
    expected = law / law.sum() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


# ----------------------------------------------------------------------------------------------------------------
# the CI rule

def real_model_required() -> bool:
    """Under CI the real-model tests must run: a missing model package fails them instead of skipping."""
    return os.environ.get("CI", "").lower() == "true"


@contextmanager
def real_model_or_skip(reason: str | None = None) -> Iterator[None]:
    """Around loading a packaged model or prompt package: a ``FileNotFoundError`` skips the test (with ``reason``,
    default the error's message), except under ``CI=true`` where it propagates and fails the test."""
    try:
        yield
    except FileNotFoundError as err:
        if real_model_required():
            raise
        pytest.skip(reason or str(err))
