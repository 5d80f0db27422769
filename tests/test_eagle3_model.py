"""The EAGLE-3 head: exact forward against an independent composition, cached chain drafting, vocabulary mapping,
config checks against the target."""

import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from ssd_eagle.kv_cache import ForwardBatch, KVCache, cache_kwarg
from ssd_eagle.model_runner import default_aux_layer_ids
from ssd_eagle.models.eagle3 import (
    Eagle3Config,
    Eagle3DraftModel,
    build_vocab_mapping,
    check_vocab_mapping,
)

VOCAB, DRAFT_VOCAB, H, H_TARGET = 50, 20, 32, 24
THETA = 500000.0


def target_config(**kw) -> LlamaConfig:
    base = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                num_hidden_layers=8, vocab_size=VOCAB, max_position_embeddings=128, rope_theta=THETA,
                rms_norm_eps=1e-5)
    base.update(kw)
    return LlamaConfig(**base)


def make_head(attn="sdpa", seed=0, target_hidden=H_TARGET) -> tuple[Eagle3DraftModel, nn.Embedding]:
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(target_config(), DRAFT_VOCAB, target_hidden_size=target_hidden)
    model = Eagle3DraftModel(cfg, attn_implementation=attn).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    used = torch.randperm(VOCAB)[:DRAFT_VOCAB]
    model.set_vocab_mapping(*build_vocab_mapping(used, VOCAB, DRAFT_VOCAB))
    emb = nn.Embedding(VOCAB, H).double()
    if cfg.owns_embeddings:  # H != H_target: the head runs on its own [VOCAB, H] table
        model.set_owned_embeddings(emb.weight)
    else:
        model.set_embeddings(emb)
    return model, emb


# ---------------------------------------------------------------- independent reference (plain torch)

# transformers' Llama numerics keep three float32 islands even in a float64 model: RMSNorm statistics, rotary
# angles and (eager attention only) the softmax. The reference reproduces them; everything else is float64.

def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary(positions, head_dim, theta, dtype):
    # angles in float32, as transformers' LlamaRotaryEmbedding computes them, then cast
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = positions.float()[..., None] * inv_freq
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def reference_forward(model, emb, ids, hidden, positions, softmax_dtype):
    cfg = model.config
    sd = {k: v for k, v in model.state_dict().items()}
    eps, nh, nkv, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, n, _ = hidden.shape
    x = torch.cat([rms(emb.weight[ids], sd["midlayer.input_layernorm.weight"], eps),
                   rms(hidden, sd["midlayer.hidden_norm.weight"], eps)], dim=-1)
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(b, n, nh, hd).transpose(1, 2)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(b, n, nkv, hd).transpose(1, 2)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(b, n, nkv, hd).transpose(1, 2)
    cos, sin = rotary(positions, hd, cfg.rope_parameters["rope_theta"], hidden.dtype)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    attn = (scores.softmax(-1, dtype=softmax_dtype).to(hidden.dtype) @ v).transpose(1, 2).reshape(b, n, nh * hd)
    h1 = hidden + attn @ sd["midlayer.self_attn.o_proj.weight"].T
    y = rms(h1, sd["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = y @ sd["midlayer.mlp.gate_proj.weight"].T, y @ sd["midlayer.mlp.up_proj.weight"].T
    out = h1 + (nn.functional.silu(gate) * up) @ sd["midlayer.mlp.down_proj.weight"].T
    logits = rms(out, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
    return out, logits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_equals_independent_composition(attn):
    model, emb = make_head(attn)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 7))
    aux = torch.randn(2, 7, 3 * H_TARGET, dtype=torch.float64)
    hidden = model.fuse(aux)
    assert hidden.shape == (2, 7, H)
    torch.testing.assert_close(hidden, aux @ model.state_dict()["fc.weight"].T, rtol=0, atol=1e-12)
    positions = torch.stack([torch.arange(7), torch.arange(7) + 5])  # rows at different offsets
    out = model(ids, hidden, positions)
    softmax_dtype = torch.float32 if attn == "eager" else torch.float64
    ref_out, ref_logits = reference_forward(model, emb, ids, hidden, positions, softmax_dtype)
    assert (out - ref_out).abs().max() < 1e-10
    assert (model.compute_logits(out) - ref_logits).abs().max() < 1e-10


def test_residual_is_hidden_not_embedding():
    model, _ = make_head()
    with torch.no_grad():
        model.midlayer.self_attn.o_proj.weight.zero_()
        model.midlayer.mlp.down_proj.weight.zero_()
    ids = torch.randint(0, VOCAB, (1, 5))
    hidden = torch.randn(1, 5, H, dtype=torch.float64)
    assert torch.equal(model(ids, hidden, torch.arange(5)[None]), hidden)


def test_cache_requires_mask():
    model, _ = make_head()
    cache = KVCache(1, 1, 2, 8, 16, torch.float64, "cpu")
    with pytest.raises(ValueError, match="attn_mask"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, H, dtype=torch.float64),
              torch.zeros(1, 1, dtype=torch.long), None, cache)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cached_chain_drafting_equals_uncached_recomputation(attn):
    model, _ = make_head(attn, seed=3)
    cfg = model.config
    torch.manual_seed(4)
    lengths, k_steps = [6, 4], 5
    tokens = [torch.randint(0, VOCAB, (n,)) for n in lengths]
    fused = [model.fuse(torch.randn(n, 3 * H_TARGET, dtype=torch.float64)) for n in lengths]
    cache = KVCache(1, 2, cfg.num_key_value_heads, cfg.head_dim, 64, torch.float64, "cpu", initial_capacity=4)

    # prefill the n (token, feature) pairs of both rows (right-padded), then K single-token steps per row
    batch = ForwardBatch.causal([t.tolist() for t in tokens], [0, 1], [0, 0], torch.float64, "cpu")
    hidden = torch.zeros(2, max(lengths), H, dtype=torch.float64)
    for r, n in enumerate(lengths):
        hidden[r, :n] = fused[r]
    with torch.no_grad():
        out = model(batch.input_ids, hidden, batch.position_ids, batch.attn_mask, cache.bind(batch))
    seq_ids = [t.clone() for t in tokens]
    seq_hidden = [f.clone() for f in fused]
    seq_out = [out[r, :n] for r, n in enumerate(lengths)]
    last = torch.stack([out[r, n - 1] for r, n in enumerate(lengths)])
    for step in range(k_steps):
        draft = model.compute_logits(last).argmax(-1)
        nxt = model.draft_to_target(draft)
        assert bool(model.t2d[nxt].all())
        starts = [n + step for n in lengths]
        batch = ForwardBatch.causal([[int(t)] for t in nxt], [0, 1], starts, torch.float64, "cpu")
        with torch.no_grad():
            step_out = model(batch.input_ids, last[:, None], batch.position_ids, batch.attn_mask, cache.bind(batch))
        for r in range(2):
            seq_ids[r] = torch.cat([seq_ids[r], nxt[r : r + 1]])
            seq_hidden[r] = torch.cat([seq_hidden[r], last[r : r + 1]])
            seq_out[r] = torch.cat([seq_out[r], step_out[r]])
        last = step_out[:, 0]

    for r in range(2):
        total = lengths[r] + k_steps
        with torch.no_grad():
            full = model(seq_ids[r][None], seq_hidden[r][None], torch.arange(total)[None])[0]
        # transformers' eager attention takes its softmax in float32: on an AVX2-only CPU (AMD EPYC Zen 3) the padded
        # batch and the single row round it differently (2.4e-6 on outputs of magnitude ~50); AVX512 CPUs matched
        assert (full - seq_out[r]).abs().max() < (1e-10 if attn == "sdpa" else 1e-5)


# ---------------------------------------------------------------- vocabulary

def test_build_vocab_mapping_offsets_and_injective():
    d2t, t2d = build_vocab_mapping([7, 3, 3, 9], vocab_size=12, draft_vocab_size=3)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert d2t.tolist() == [3, 6, 7]  # used = [3, 7, 9] sorted, d2t[i] = used[i] - i
    assert torch.nonzero(t2d).flatten().tolist() == [3, 7, 9]
    targets = torch.arange(3) + d2t
    assert targets.unique().numel() == 3
    check_vocab_mapping(d2t, t2d, 12)


def test_build_vocab_mapping_priority_and_padding():
    d2t, t2d = build_vocab_mapping([9, 2, 5, 1], vocab_size=12, draft_vocab_size=2)
    assert (torch.arange(2) + d2t).tolist() == [2, 9]  # the first two (most frequent), sorted
    d2t, t2d = build_vocab_mapping([5], vocab_size=12, draft_vocab_size=3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 5]  # padded with the smallest unused ids
    assert int(t2d.sum()) == 3
    d2t, t2d = build_vocab_mapping(range(12), vocab_size=12, draft_vocab_size=12)
    assert not d2t.any() and bool(t2d.all())  # identity
    with pytest.raises(ValueError):
        build_vocab_mapping([12], vocab_size=12, draft_vocab_size=3)
    with pytest.raises(ValueError):
        build_vocab_mapping([1], vocab_size=12, draft_vocab_size=13)


def test_check_vocab_mapping_catches_inconsistent_pairs():
    d2t, t2d = build_vocab_mapping([3, 7, 9], 12, 3)
    with pytest.raises(ValueError, match="disagrees"):
        check_vocab_mapping(d2t, torch.zeros(12, dtype=torch.bool), 12)  # zeroed t2d
    with pytest.raises(ValueError, match="same target"):
        check_vocab_mapping(torch.tensor([1, 0, 0]), t2d, 12)  # draft 0 and 1 -> target 1
    with pytest.raises(ValueError, match="outside"):
        check_vocab_mapping(torch.tensor([0, 0, 10]), t2d, 12)
    with pytest.raises(ValueError, match="int64"):
        check_vocab_mapping(d2t.int(), t2d, 12)


def test_to_target_logits_scatters_with_minus_inf():
    model, _ = make_head()
    logits = torch.randn(2, 3, DRAFT_VOCAB, dtype=torch.float64)
    full = model.to_target_logits(logits)
    assert full.shape == (2, 3, VOCAB)
    targets = model.draft_target_ids
    assert torch.equal(full[..., targets], logits)
    assert bool(torch.isneginf(full[..., ~model.t2d]).all())
    assert int(torch.isfinite(full).sum()) == 2 * 3 * DRAFT_VOCAB
    assert torch.equal(full.argmax(-1), model.draft_to_target(logits.argmax(-1)))


# ---------------------------------------------------------------- embeddings and parameters

def test_shared_embeddings_are_not_parameters_and_get_no_gradient():
    model, emb = make_head(target_hidden=H)
    assert "embed_tokens.weight" not in model.state_dict()
    assert all(p is not emb.weight for p in model.parameters())
    ids = torch.randint(0, VOCAB, (1, 4))
    hidden = model.fuse(torch.randn(1, 4, 3 * H, dtype=torch.float64))
    model.compute_logits(model(ids, hidden, torch.arange(4)[None])).sum().backward()
    assert emb.weight.grad is None
    assert model.fc.weight.grad is not None and model.midlayer.self_attn.q_proj.weight.grad is not None
    expected = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == model.num_parameters(trainable_only=True) == expected
    with pytest.raises(ValueError):
        model.set_embeddings(nn.Embedding(VOCAB + 1, H))


def test_owned_embeddings_are_frozen_and_replaced_by_shared():
    model, emb = make_head(target_hidden=H)
    model.set_owned_embeddings(torch.randn(VOCAB, H, dtype=torch.float64))
    assert "embed_tokens.weight" in model.state_dict()
    assert not model.embed_tokens.weight.requires_grad
    assert model.num_parameters(trainable_only=True) == model.num_parameters() - VOCAB * H
    model.set_embeddings(emb)
    assert "embed_tokens.weight" not in model.state_dict()


def test_moving_the_head_away_from_a_shared_table_copies_it():
    """A GPU target's table with the head in a CPU speculator (found on an H200: index_select across devices): the
    head's ``.to()`` gives it a frozen copy on its device; the target's table stays where it is."""
    model, emb = make_head(target_hidden=H)
    model.to(torch.float32)  # a dtype change on the same device: still the target's own table
    assert model._shared_embeddings is emb
    model.to("meta")
    table = model._shared_embeddings
    assert table is not emb and table.weight.device.type == "meta" and not table.weight.requires_grad
    assert emb.weight.device.type == "cpu" and "embed_tokens.weight" not in model.state_dict()


def test_cached_drafting_under_the_pre_5_25_cache_keyword(monkeypatch):
    """The cached-vs-uncached check with ``LlamaAttention`` as transformers before 5.25 has it: the cache comes as
    ``past_key_values`` and a ``cache=`` keyword is ignored (the head's drafts broke so on transformers 5.17)."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    real = LlamaAttention.forward

    def old_style(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                  **kwargs):
        kwargs.pop("cache", None)
        return real(self, hidden_states, position_embeddings, attention_mask,
                    **{cache_kwarg(real): past_key_values}, **kwargs)

    monkeypatch.setattr(LlamaAttention, "forward", old_style)
    assert make_head()[0].midlayer._cache_kwarg == "past_key_values"
    test_cached_chain_drafting_equals_uncached_recomputation("sdpa")


def test_cache_keyword_follows_the_installed_transformers():
    """transformers 5.25 renamed the layers' ``past_key_values`` to ``cache``; an older one puts ``cache=`` in its
    ``**kwargs`` and attends over the new keys alone (the head's drafts broke silently on transformers 5.17)."""
    def new(hidden_states, attention_mask=None, cache=None, **kwargs): ...
    def old(hidden_states, attention_mask=None, past_key_values=None, **kwargs): ...
    assert cache_kwarg(new) == "cache" and cache_kwarg(old) == "past_key_values"
    model, _ = make_head(target_hidden=H)
    assert model.midlayer._cache_kwarg == cache_kwarg(model.midlayer.self_attn.forward)


def test_missing_embeddings_raise():
    cfg = Eagle3Config.from_target(target_config(), DRAFT_VOCAB)
    model = Eagle3DraftModel(cfg)
    with pytest.raises(RuntimeError, match="set_embeddings"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, H), torch.zeros(1, 1, dtype=torch.long))


def test_module_layout_reuses_transformers_modules():
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
    model, _ = make_head()
    mid = model.midlayer
    assert isinstance(mid.self_attn, LlamaAttention) and isinstance(mid.mlp, LlamaMLP)
    assert all(isinstance(m, LlamaRMSNorm) for m in (mid.input_layernorm, mid.hidden_norm,
                                                     mid.post_attention_layernorm, model.norm))
    assert mid.self_attn.q_proj.weight.shape == (4 * 8, 2 * H)
    assert mid.self_attn.k_proj.weight.shape == (2 * 8, 2 * H)
    assert model.fc.weight.shape == (H, 3 * H_TARGET)
    assert model.lm_head.weight.shape == (DRAFT_VOCAB, H)
    assert model.d2t.dtype == torch.long and model.t2d.dtype == torch.bool


def narrow_head(width=16, seed=0) -> Eagle3DraftModel:
    """A head ``width`` wide for the H-wide ``target_config()``, random float64 weights."""
    torch.manual_seed(seed)
    model = Eagle3DraftModel(Eagle3Config.from_target(target_config(), DRAFT_VOCAB, hidden_size=width)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


def test_narrow_head_owns_a_frozen_table_and_keeps_it_against_the_target():
    model = narrow_head()
    cfg = model.config
    assert cfg.owns_embeddings and (cfg.hidden_size, cfg.target_hidden_size) == (16, H)
    assert model.fc.weight.shape == (16, 3 * H) and model.lm_head.weight.shape == (DRAFT_VOCAB, 16)
    assert model.state_dict()["embed_tokens.weight"].shape == (VOCAB, 16)
    assert not model.embed_tokens.weight.requires_grad
    assert model.num_parameters(trainable_only=True) == model.num_parameters() - VOCAB * 16
    own = model.embed_tokens.weight.clone()
    model.set_embeddings(nn.Embedding(VOCAB, H).double())  # the target's table: checked, not used
    assert torch.equal(model.embed_tokens.weight, own)
    with pytest.raises(ValueError, match="needs"):
        model.set_embeddings(nn.Embedding(VOCAB, 16).double())
    ids = torch.randint(0, VOCAB, (2, 5))
    hidden = model.fuse(torch.randn(2, 5, 3 * H, dtype=torch.float64))
    out = model(ids, hidden, torch.arange(5).expand(2, 5))
    assert out.shape == (2, 5, 16) and model.compute_logits(out).shape == (2, 5, DRAFT_VOCAB)
    assert torch.equal(model.embed(ids), own[ids])


def test_projected_embeddings_keep_the_target_geometry_up_to_rank_h():
    """E @ P with P the top-16 right singular vectors: exact inner products for a rank-16 table, the best rank-16
    approximation's for a full one."""
    model = narrow_head()
    low_rank = torch.randn(VOCAB, 16, dtype=torch.float64) @ torch.randn(16, H, dtype=torch.float64)
    model.project_target_embeddings(low_rank)
    e = model.embed_tokens.weight
    torch.testing.assert_close(e @ e.T, low_rank @ low_rank.T, rtol=1e-9, atol=1e-9)
    full = torch.randn(VOCAB, H, dtype=torch.float64)
    model.project_target_embeddings(full)
    u, s, vh = torch.linalg.svd(full, full_matrices=False)
    best = (u[:, :16] * s[:16]) @ vh[:16]
    e = model.embed_tokens.weight
    torch.testing.assert_close(e @ e.T, best @ best.T, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="expected"):
        model.project_target_embeddings(torch.randn(VOCAB, 16))
    with pytest.raises(ValueError, match="shares"):
        make_head(target_hidden=H)[0].project_target_embeddings(full)


def test_narrow_geometry_is_scaled_from_the_target():
    cfg = Eagle3Config.from_target(target_config(), DRAFT_VOCAB, hidden_size=16)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (2, 1, 8, 64)
    cfg.validate_against_target(target_config())  # another width is a valid head for this target
    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                       num_hidden_layers=30, vocab_size=VOCAB, head_dim=64)
    cfg = Eagle3Config.from_target(smol, DRAFT_VOCAB, hidden_size=384)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (6, 2, 64, 1024)
    assert Eagle3Config.from_target(smol, DRAFT_VOCAB, hidden_size=384, intermediate_size=512).intermediate_size == 512
    with pytest.raises(ValueError, match="multiple of the target's head_dim"):
        Eagle3Config.from_target(target_config(), DRAFT_VOCAB, hidden_size=12)
    with pytest.raises(ValueError, match="ratio"):
        Eagle3Config.from_target(smol, DRAFT_VOCAB, hidden_size=64)


# ---------------------------------------------------------------- config

def test_from_target_copies_geometry_and_defaults():
    tc = target_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = Eagle3Config.from_target(tc, DRAFT_VOCAB, saguaro_c=0.5, saguaro_fanout=3)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (H, 4, 2, 8)
    assert cfg.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA}
    assert cfg.max_position_embeddings == 128 and cfg.rms_norm_eps == 1e-5
    assert cfg.vocab_size == VOCAB and cfg.target_hidden_size == H
    assert cfg.aux_layer_ids == default_aux_layer_ids(8) == (2, 4, 5)
    assert (cfg.saguaro_c, cfg.saguaro_fanout) == (0.5, 3)
    cfg.validate_against_target(tc)
    llama = cfg.to_llama_config()
    assert llama.num_hidden_layers == 1 and llama.tie_word_embeddings is False
    assert llama.rope_parameters["rope_type"] == "linear"
    with pytest.raises(ValueError, match="no_such_field"):
        Eagle3Config.from_target(tc, DRAFT_VOCAB, no_such_field=1)
    with pytest.raises(ValueError):
        Eagle3Config.from_target(tc, VOCAB + 1)


@pytest.mark.parametrize("change, field", [
    (dict(rope_theta=10000.0), "rope_parameters"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), "rope_parameters"),
    (dict(max_position_embeddings=256), "max_position_embeddings"),
    (dict(hidden_size=64, num_attention_heads=8), "target_hidden_size"),
    (dict(vocab_size=51), "vocab_size"),
    (dict(num_hidden_layers=4), "aux_layer_ids"),
])
def test_validate_against_target_names_the_mismatch(change, field):
    cfg = Eagle3Config.from_target(target_config(), DRAFT_VOCAB)
    with pytest.raises(ValueError, match=field):
        cfg.validate_against_target(target_config(**change))


def test_validate_against_target_rejects_repeated_aux_ids_and_lists_all():
    cfg = Eagle3Config.from_target(target_config(), DRAFT_VOCAB, aux_layer_ids=(2, 2, 5))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        cfg.validate_against_target(target_config())
    cfg = Eagle3Config.from_target(target_config(), DRAFT_VOCAB)
    with pytest.raises(ValueError) as err:
        cfg.validate_against_target(target_config(vocab_size=60, max_position_embeddings=64))
    assert "vocab_size" in str(err.value) and "max_position_embeddings" in str(err.value)


def test_shallow_target_default_ids_are_distinct():
    cfg = Eagle3Config.from_target(target_config(num_hidden_layers=2), DRAFT_VOCAB)
    assert cfg.aux_layer_ids == (0, 1, 2)
    cfg.validate_against_target(target_config(num_hidden_layers=2))


def test_per_layer_type_rope_uses_full_attention_entry():
    from transformers import Gemma3TextConfig
    tc = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=H, num_attention_heads=4, num_key_value_heads=1,
                          head_dim=8, num_hidden_layers=6, intermediate_size=48)
    cfg = Eagle3Config.from_target(tc, DRAFT_VOCAB)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    cfg.validate_against_target(tc)


def test_unknown_attention_implementation_is_refused():
    with pytest.raises(ValueError, match="attn_implementation"):
        Eagle3DraftModel(Eagle3Config.from_target(target_config(), DRAFT_VOCAB), attn_implementation="flash")


def test_output_side_initialised_from_the_target_gives_the_targets_logits_on_the_draft_vocabulary():
    model, _ = make_head(target_hidden=H)
    lm_head, norm_w = torch.randn(VOCAB, H, dtype=torch.float64), torch.rand(H, dtype=torch.float64) + 0.5
    model.init_output_from_target(lm_head, norm_w)
    x = torch.randn(2, 3, H, dtype=torch.float64)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps) * norm_w
    target_logits = normed @ lm_head.T  # [2, 3, VOCAB]
    full = model.to_target_logits(model.compute_logits(x))
    ids = model.draft_target_ids
    torch.testing.assert_close(full[..., ids], target_logits[..., ids], rtol=1e-5, atol=1e-5)  # RMSNorm: float32
    assert torch.isinf(full).sum() == 2 * 3 * (VOCAB - DRAFT_VOCAB)
    with pytest.raises(ValueError, match="expected"):
        model.init_output_from_target(lm_head[:, :8], norm_w)
    with pytest.raises(ValueError, match="another width"):
        narrow_head().init_output_from_target(lm_head, norm_w)
