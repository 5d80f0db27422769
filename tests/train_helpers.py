"""Trainer test fixtures shared by the training, export and Saguaro-training tests: a random EAGLE-3 head over a
40-token vocabulary, a tiny on-disk target with training and held-out conversations, its training config, and an
in-process trainer run (one-rank gloo world)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from helpers import make_byte_tokenizer, make_tiny_llama
from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel, build_vocab_mapping
from train.config import config_from_dict

REPO = Path(__file__).resolve().parents[1]
VOCAB, DRAFT_VOCAB, H = 40, 16, 32
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
EOS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_head(seed=0, num_layers=8, dtype=torch.float64, attn="sdpa") -> tuple[Eagle3DraftModel, nn.Embedding]:
    """A random EAGLE-3 head (float64) over a 40-token target vocabulary, 16 draft tokens."""
    torch.manual_seed(seed)
    tc = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                     num_hidden_layers=num_layers, vocab_size=VOCAB, max_position_embeddings=128, rope_theta=1e4)
    head = Eagle3DraftModel(Eagle3Config.from_target(tc, DRAFT_VOCAB), attn_implementation=attn).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    head.set_vocab_mapping(*build_vocab_mapping(torch.randperm(VOCAB)[:DRAFT_VOCAB], VOCAB, DRAFT_VOCAB))
    emb = nn.Embedding(VOCAB, H).to(dtype)
    head.set_embeddings(emb)
    return head, emb


def write_tiny_setup(root: Path, num_convs: int = 48, seed: int = 0, num_layers: int = 8) -> dict:
    """A tiny float32 Llama target with a byte-level tokenizer (chat turns closed by ``<eos>``), training and
    held-out conversations. Returns the paths."""
    root.mkdir(parents=True, exist_ok=True)
    tok = make_byte_tokenizer()
    tok.chat_template = EOS_TEMPLATE
    model = make_tiny_llama(num_layers=num_layers, hidden_size=64, dtype=torch.float32, max_positions=512, seed=seed)
    target = root / "target"
    model.save_pretrained(target)
    tok.save_pretrained(target)
    rng = random.Random(seed)

    def conv(prefix=""):
        return {"messages": [
            {"role": "user", "content": prefix + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))},
            {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))}]}
    data, heldout = root / "data.jsonl", root / "heldout.jsonl"
    data.write_text("".join(json.dumps(conv()) + "\n" for _ in range(num_convs)))
    heldout.write_text("".join(json.dumps(conv("held ")) + "\n" for _ in range(3)))
    return {"target": str(target), "data": str(data), "heldout": str(heldout), "root": root}


def tiny_config(setup: dict, out: Path, **overrides) -> dict:
    """Training config values for the tiny setup (online EAGLE-3, ZeRO-2)."""
    values = dict(target=setup["target"], data=setup["data"], heldout_data=setup["heldout"], check_heldout=False,
                  output_dir=str(out), draft_vocab_size=24, ttt_steps=3, max_length=128, lr=3e-3, warmup_steps=2,
                  max_steps=6, save_every=3, eval_every=3, log_every=1, progress=False, heldout_samples=2,
                  deepspeed_config=str(REPO / "configs" / "ds_zero2.json"))
    values.update(overrides)
    return values


def run_trainer(**values):
    """Build and run a :class:`train.train_draft.Trainer` in this process (one-rank gloo world)."""
    from train.train_draft import Trainer, init_distributed

    init_distributed()
    trainer = Trainer(config_from_dict(values))
    result = trainer.train()
    return trainer, result
