"""Shared fixtures: tiny random Llama models built in memory and a byte-level tokenizer.

Exact-token tests run the tiny models in float64, where batched and one-token forwards agree far below any logit
gap, so token equality is a fair test. The byte-level tokenizer maps token i < 256 to byte i, so multi-byte UTF-8
characters are split across tokens (streaming tests need that); id 256 is ``<eos>``.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_ID = 256

# Tiny models gain nothing from intra-op threads, and OpenMP threads waiting for a busy core (the SSD speculator
# process, another test worker) turn microseconds into milliseconds.
torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def byte_tokenizer():
    return make_byte_tokenizer()


def real_model_required() -> bool:
    """Under CI the real-model tests must run: a missing model package fails them instead of skipping."""
    return os.environ.get("CI", "").lower() == "true"
