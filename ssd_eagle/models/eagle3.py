"""The EAGLE-3 draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv 2503.01840), assembled from transformers' Llama modules (no modeling code copied).

Per draft step (``docs/design.md`` section 1), with ``e = embed(token)`` from the target's frozen embeddings and
``h`` the fused target feature ``fc(concat(low, mid, high))`` on the first step, the head's own previous output
afterwards::

    x   = concat(input_layernorm(e), hidden_norm(h))          # [B, n, 2H]
    h'  = h + o_proj(attention(q/k/v_proj(x)))                 # residual is h, not the embedding
    out = h' + mlp(post_attention_layernorm(h'))               # fed back as the next step's h
    logits = lm_head(norm(out))                                # [B, n, draft_vocab]

Draft id ``i`` is target id ``i + d2t[i]``; ``t2d[v]`` says whether target id ``v`` is in the draft vocabulary
(``docs/design.md`` section 3). The head's configuration is
:class:`~ssd_eagle.models.eagle3_config.Eagle3Config`; its aux layer ids use the input-of-layer convention of
``docs/design.md`` section 2, the same as :mod:`ssd_eagle.model_runner` and vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from ssd_eagle.kv_cache import cache_kwarg
from ssd_eagle.models.eagle3_config import Eagle3Config
from ssd_eagle.sampling import upcast_logits


# ----------------------------------------------------------------------------------------------------------------
# vocabulary mapping (``docs/design.md`` section 3)

def build_vocab_mapping(used_target_ids: Iterable[int] | torch.Tensor, vocab_size: int,
                        draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft-vocabulary tensors of EAGLE-3 from the target ids the draft should cover.

    Args:
        used_target_ids: target token ids in priority order (most frequent first); duplicates are ignored. The first
            ``draft_vocab_size`` distinct ids are kept; when there are fewer, the smallest unused ids pad the set.
        vocab_size: target vocabulary size V.
        draft_vocab_size: D <= V.

    Returns:
        ``d2t`` int64 [D] with ``d2t[i] = used[i] - i`` over the kept ids sorted ascending (all zeros = identity),
        and ``t2d`` bool [V] with ``t2d[v] = v in used``.

    Raises:
        ValueError: D not in [1, V], or an id outside [0, V).
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    ids = torch.as_tensor(list(used_target_ids) if not torch.is_tensor(used_target_ids) else used_target_ids,
                          dtype=torch.long).flatten()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"target ids must be in [0, {vocab_size}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    seen: dict[int, None] = {}
    for v in ids.tolist():
        if len(seen) == draft_vocab_size:
            break
        seen.setdefault(v, None)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    if seen:
        t2d[torch.tensor(list(seen), dtype=torch.long)] = True
    missing = draft_vocab_size - len(seen)
    if missing:
        t2d[torch.nonzero(~t2d).flatten()[:missing]] = True
    used = torch.nonzero(t2d).flatten()
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.long)
    return d2t, t2d


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Validate a (d2t, t2d) pair: int64/bool, draft ids map injectively into [0, V) and t2d marks exactly them.

    Catches the reported failure modes of ``docs/design.md`` section 7 (zeroed or regenerated tensors that disagree).

    Raises:
        ValueError: describing the first inconsistency.
    """
    if d2t.dtype != torch.long or d2t.dim() != 1:
        raise ValueError(f"d2t must be a 1-D int64 tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.shape != (vocab_size,):
        raise ValueError(f"t2d must be a bool tensor of shape ({vocab_size},), got {t2d.dtype} {tuple(t2d.shape)}")
    targets = torch.arange(d2t.numel(), device=d2t.device) + d2t
    if d2t.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
    if torch.unique(targets).numel() != targets.numel():
        raise ValueError("d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[targets.to(t2d.device)].all()):
        raise ValueError(f"t2d (marks {int(t2d.sum())} ids) disagrees with d2t ({d2t.numel()} draft ids)")


# ----------------------------------------------------------------------------------------------------------------
# model

class Eagle3MidLayer(nn.Module):
    """The single EAGLE-3 decoder layer, built from transformers' ``LlamaAttention`` (q/k/v widened to 2H inputs),
    ``LlamaMLP`` and three ``LlamaRMSNorm``. Parameter names match the public checkpoints (``midlayer.*``)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.self_attn = LlamaAttention(config, layer_idx=0)
        self._cache_kwarg = cache_kwarg(self.self_attn.forward)
        # the attention input is concat(input_layernorm(embeds), hidden_norm(h)): 2H wide. LlamaAttention.forward
        # only uses hidden_states.shape[:-1], so widening the projections is all that is needed.
        bias = config.attention_bias
        self.self_attn.q_proj = nn.Linear(2 * h, config.num_attention_heads * hd, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * h, config.num_key_value_heads * hd, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * h, config.num_key_value_heads * hd, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn_out, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                     **{self._cache_kwarg: cache})
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(nn.Module):
    """EAGLE-3 draft head: ``fc``, one ``midlayer``, ``norm``, ``lm_head`` and the ``d2t``/``t2d`` mapping.

    Token embeddings are the target's: attach them with :meth:`set_embeddings` (not registered as a parameter, so
    ``state_dict()`` and optimizers never see them). A checkpoint that carries ``embed_tokens.weight`` gets an owned,
    frozen ``embed_tokens`` instead (see :meth:`set_owned_embeddings`). A head of another width than its target
    (``config.owns_embeddings``: H != H_target) always owns a frozen ``embed_tokens`` [vocab, H], registered at
    construction (so in ``state_dict()`` and every export), initialised from the target's table by
    :meth:`project_target_embeddings` when trained here.

    Args:
        config: the head's :class:`Eagle3Config`.
        attn_implementation: transformers attention backend for the midlayer, "sdpa" or "eager".

    Raises:
        ValueError: another attention implementation.

    Buffers: ``d2t`` int64 [draft_vocab] (identity by default), ``t2d`` bool [vocab].
    """

    def __init__(self, config: Eagle3Config, attn_implementation: str = "sdpa"):
        super().__init__()
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}")
        self.config = config
        llama = config.to_llama_config()
        llama._attn_implementation = attn_implementation
        self.llama_config = llama
        h = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3MidLayer(llama)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_module("embed_tokens", None)
        object.__setattr__(self, "_shared_embeddings", None)
        self.init_weights()
        if config.owns_embeddings:
            self.set_owned_embeddings(torch.zeros(config.vocab_size, h))

    # --- construction helpers -----------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Llama-style init: linear weights ~ N(0, std), biases 0, norm weights 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, LlamaRMSNorm):
                module.weight.fill_(1.0)

    def set_embeddings(self, embeddings: nn.Module) -> None:
        """Share the target's input embeddings (``target.get_input_embeddings()``), frozen and unregistered.

        Drops an owned ``embed_tokens`` loaded from a checkpoint: the target's embeddings are authoritative. A head
        of another width (``config.owns_embeddings``) keeps its own table and only checks that ``embeddings`` is the
        target's [vocab_size, target_hidden_size] (what SGLang's ``set_embed`` does for such a head).

        Raises:
            ValueError: the embedding table is not [vocab_size, hidden_size] ([vocab_size, target_hidden_size] for a
                head of another width).
        """
        weight = embeddings.weight
        cfg = self.config
        expected = (cfg.vocab_size, cfg.target_hidden_size if cfg.owns_embeddings else cfg.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"embeddings are {tuple(weight.shape)}, the head needs {expected}")
        if cfg.owns_embeddings:
            return
        self.embed_tokens = None
        object.__setattr__(self, "_shared_embeddings", embeddings)

    def follow_device(self) -> None:
        """Keep the token embeddings on the head's device. A shared table on another device (the target on a GPU,
        this head in an SSD speculator on the CPU) is replaced by a frozen, unregistered copy on the head's device;
        the target keeps its own. Called by ``.to()``/``.cuda()`` (``_apply``) and by the draft backends."""
        shared, device = self._shared_embeddings, self.lm_head.weight.device
        if shared is not None and shared.weight.device != device:
            copy = nn.Embedding.from_pretrained(shared.weight.detach().to(device), freeze=True)
            object.__setattr__(self, "_shared_embeddings", copy)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.follow_device()
        return self

    @torch.no_grad()
    def project_target_embeddings(self, target_weight: torch.Tensor) -> None:
        """Initialise the own table of a head of another width from the target's [vocab, H_target]: ``E @ P``
        with ``P`` [H_target, H] the top-H right singular vectors of ``E`` (the rank-H linear map that keeps the most
        of the table, truncated SVD; a wider head pads with zero columns). Deterministic and data-free: every token,
        rare ones included, keeps the target's geometry in the kept directions.

        Raises:
            ValueError: a head as wide as its target (it shares the target's table), or a table not
                [vocab_size, target_hidden_size].
        """
        cfg = self.config
        if not cfg.owns_embeddings:
            raise ValueError("the head is as wide as its target and shares its embeddings (set_embeddings)")
        if tuple(target_weight.shape) != (cfg.vocab_size, cfg.target_hidden_size):
            raise ValueError(f"target embeddings are {tuple(target_weight.shape)}, expected "
                             f"{(cfg.vocab_size, cfg.target_hidden_size)}")
        e = target_weight.detach().to("cpu", torch.float64)
        _, vectors = torch.linalg.eigh(e.T @ e)  # ascending eigenvalues of the Gram matrix
        k = min(cfg.hidden_size, cfg.target_hidden_size)
        projected = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=torch.float64)
        projected[:, :k] = e @ vectors[:, -k:].flip(-1)
        self.embed_tokens.weight.copy_(projected.to(self.embed_tokens.weight))

    @torch.no_grad()
    def init_output_from_target(self, lm_head_weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
        """Start the output side where the target's is: ``lm_head`` rows = the target's output embeddings of the
        draft vocabulary (``lm_head_weight[draft_target_ids]``, [draft_vocab, H]) and ``norm`` = the target's final
        RMSNorm weight [H]. The head then only has to map its hidden state into the target's final hidden space
        instead of learning a random 8k-row table too; call after :meth:`set_vocab_mapping`.

        Raises:
            ValueError: a head of another width than its target, or tensors of the wrong shape.
        """
        cfg = self.config
        if cfg.owns_embeddings:
            raise ValueError("a head of another width than its target cannot take the target's lm_head rows")
        if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target lm_head is {tuple(lm_head_weight.shape)}, expected "
                             f"{(cfg.vocab_size, cfg.hidden_size)}")
        if tuple(norm_weight.shape) != (cfg.hidden_size,):
            raise ValueError(f"target norm weight is {tuple(norm_weight.shape)}, expected {(cfg.hidden_size,)}")
        rows = lm_head_weight.detach().to(self.lm_head.weight.device)[self.draft_target_ids]
        self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))
        self.norm.weight.copy_(norm_weight.detach().to(self.norm.weight))

    @torch.no_grad()
    def init_output_from_head(self, head: Eagle3DraftModel) -> None:
        """Start the ``lm_head`` of a widened draft vocabulary from ``head``, a trained head of the same width whose
        vocabulary this one contains: every token of ``head``'s vocabulary keeps its trained row, every new token
        starts from a zero row (logit 0). Greedy drafting is then unchanged wherever the best trained logit is above
        0, which held throughout for SmolLM2: its head of run 12 widened from
        8192 to 16384 tokens drafted exactly what it drafted before (tau 1.849 / 2.280 on 40 held-out MT-Bench /
        HumanEval prompts, K = 5, bf16, against 1.849 / 2.280), where starting the new rows from the target's
        output rows (scaled to the trained rows' norm) made them win the argmax: tau 1.101 / 1.151. Call after
        :meth:`set_vocab_mapping`; the other weights come from ``head``'s state dict.

        Raises:
            ValueError: another width, or a token of ``head``'s vocabulary missing from this one's.
        """
        if head.config.hidden_size != self.config.hidden_size:
            raise ValueError(f"hidden_size {head.config.hidden_size} != {self.config.hidden_size}")
        new_ids, old_ids = self.draft_target_ids.cpu(), head.draft_target_ids.cpu()
        old_row = torch.full((self.config.vocab_size,), -1, dtype=torch.long)
        old_row[old_ids] = torch.arange(old_ids.numel())
        source = old_row[new_ids]
        carried = source >= 0
        if int(carried.sum()) != old_ids.numel():
            raise ValueError("the new draft vocabulary does not contain every token of the trained head's")
        rows = torch.zeros_like(self.lm_head.weight, device="cpu")
        rows[carried] = head.lm_head.weight.detach().cpu().to(rows.dtype)[source[carried]]
        self.lm_head.weight.copy_(rows)

    def set_owned_embeddings(self, weight: torch.Tensor) -> None:
        """Own a frozen copy of an embedding table [vocab_size, hidden_size] (a checkpoint's ``embed_tokens``).

        Raises:
            ValueError: wrong shape.
        """
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"embed_tokens.weight is {tuple(weight.shape)}, expected {expected}")
        ref = self.lm_head.weight
        emb = nn.Embedding(*expected, device=ref.device, dtype=ref.dtype)
        emb.weight.data.copy_(weight)
        emb.weight.requires_grad_(False)
        self.embed_tokens = emb
        object.__setattr__(self, "_shared_embeddings", None)

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install ``d2t`` int64 [draft_vocab] and ``t2d`` bool [vocab] (see :func:`build_vocab_mapping`).

        Raises:
            ValueError: wrong shapes/dtypes or an inconsistent pair (:func:`check_vocab_mapping`).
        """
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, the head needs {tuple(self.d2t.shape)}")
        check_vocab_mapping(d2t, t2d, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    build_vocab_mapping = staticmethod(build_vocab_mapping)

    # --- forward ------------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target token embeddings of ``input_ids`` int64 [B, n] -> [B, n, H], detached (frozen).

        Raises:
            RuntimeError: no embeddings attached.
        """
        table = self.embed_tokens if self.embed_tokens is not None else self._shared_embeddings
        if table is None:
            raise RuntimeError("no token embeddings: call set_embeddings(target.get_input_embeddings())")
        return table(input_ids).detach()

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``fc``: aux hidden states [B, n, 3*H_target] (low, mid, high concatenated) -> [B, n, H]."""
        return self.fc(aux_hidden)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One EAGLE-3 step over n positions.

        Args:
            input_ids: int64 [B, n], target-vocabulary ids (position t holds token t+1 paired with the feature of t).
            hidden: [B, n, H] float, the fused target feature (:meth:`fuse`) or the head's previous output.
            position_ids: int64 [B, n], rotary positions.
            attention_mask: [B, 1, n, S] additive float mask in the model dtype (0 visible, dtype-min hidden), or
                None for plain causal attention over these n positions (only without a cache).
            cache: a :class:`ssd_eagle.kv_cache.KVCache` (1 layer) bound to a ``ForwardBatch``; transformers'
                ``LlamaAttention`` calls its ``update`` exactly as in the target. None = no cache.
            inputs_embeds: [B, n, H] to use instead of embedding ``input_ids``.

        Returns:
            [B, n, H] pre-norm hidden states (what EAGLE-3 feeds back as the next step's ``hidden``).

        Raises:
            ValueError: a cache without a mask.
        """
        if cache is not None and attention_mask is None:
            raise ValueError("a cached forward needs the ForwardBatch's attn_mask")
        embeds = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        embeds = embeds.to(hidden.dtype)
        if attention_mask is None and self.llama_config._attn_implementation != "sdpa":
            n = hidden.shape[1]
            future = torch.ones(n, n, dtype=torch.bool, device=hidden.device).triu(1)
            attention_mask = torch.zeros(n, n, dtype=hidden.dtype, device=hidden.device).masked_fill(
                future, torch.finfo(hidden.dtype).min)[None, None].expand(hidden.shape[0], 1, n, n)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.midlayer(embeds, hidden, position_embeddings, attention_mask, cache)

    def compute_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(hidden_out))``: [..., H] -> [..., draft_vocab] (draft-vocabulary logits)."""
        return self.lm_head(self.norm(hidden_out))

    # --- vocabulary ---------------------------------------------------------------------------------------
    @property
    def draft_target_ids(self) -> torch.Tensor:
        """int64 [draft_vocab]: the target id of every draft id (``arange + d2t``)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (int64, any shape) -> target ids: ``ids + d2t[ids]``."""
        return ids + self.d2t[ids]

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft logits [..., draft_vocab] into target-vocabulary logits [..., vocab], -inf elsewhere, in
        float32 (float64 for float64 logits; :func:`~ssd_eagle.sampling.upcast_logits`)."""
        draft_logits = upcast_logits(draft_logits)
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), -math.inf)
        return out.index_copy_(-1, self.draft_target_ids, draft_logits)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Parameters of the head (shared target embeddings never count; an owned frozen copy counts only when
        ``trainable_only`` is False)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
