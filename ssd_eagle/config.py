"""Engine and speculative-decoding configuration (pydantic models, see :mod:`ssd_eagle.schema`), and the
command-line surface shared by ``inference.generate`` and ``inference.serve`` (:data:`ENGINE_FLAGS`, derived from
the models' fields; later features add flags, never rename them).

Speculative settings follow vLLM: ``--speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'``
with vLLM's keys (``method``, ``model``, ``num_speculative_tokens``, ``prompt_lookup_min``, ``prompt_lookup_max``).
``--mode`` picks autoregressive decoding (``ar``), speculative decoding (``sd``) or speculative speculative
decoding (``ssd``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, PrivateAttr, model_validator

from ssd_eagle.assets import DEFAULT_MODEL
from ssd_eagle.platform import DTYPE_HELP, DTYPES, resolve_dtype
from ssd_eagle.schema import ConfigModel, Flag, add_flags, flags_for, load_yaml, validated

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_SERVING_CONFIG = CONFIG_DIR / "default_serving.yaml"

Method = Literal["ngram", "draft_model", "eagle3"]
Mode = Literal["ar", "sd", "ssd"]


def _as_list(value):
    """A single value or a tuple as a list (``fanout: 3`` means ``[3]``)."""
    return [value] if isinstance(value, int) else list(value) if isinstance(value, tuple) else value


Fanout = Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_as_list), Field(min_length=1)]


def _power(value):
    """``fanout_power``: a number r > 0, or "auto"."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError("must be a number > 0 or 'auto'")
    return float(value)


Power = Annotated[float | Literal["auto"], BeforeValidator(_power)]


class SpeculativeConfig(ConfigModel):
    """What drafts and how much (vLLM's ``speculative_config`` keys, plus Saguaro's); each field's description
    says what it means.

    Raises:
        ValueError: unknown key or out-of-range value, naming the key.
    """

    method: Method = Field("ngram", description="ngram (prompt lookup), draft_model (a small causal LM with the "
                           "target's tokenizer) or eagle3 (an EAGLE-3 head fed the target's aux hidden states)")
    model: str | None = Field(None, description="path or id of the draft (draft_model, eagle3)")
    num_speculative_tokens: int = Field(5, ge=1, description="K, draft tokens per round")
    adaptive: bool = Field(True, description="SD and SSD: a planner measures the target's verify cost per width "
                           "and the running requests' acceptance, and drafts the K that maximises tokens/s, or nothing "
                           "when drafts do not pay (SSD: its draft time is the verifier's wait for the speculator; an "
                           "explicit K fixes the length; the planner still decides whether to speculate; an SSD tree "
                           "is planned on or off, an SD tree drafter drafts its tree or a chain, whichever pays more; "
                           "an in-line SSD speculator is not planned). false: always draft K")
    # a 1-token match is right too rarely to pay for verifying 5 tokens
    prompt_lookup_min: int = Field(2, ge=1, description="shortest n-gram suffix matched (ngram)")
    prompt_lookup_max: int = Field(4, ge=1, description="longest n-gram suffix matched (ngram)")
    saguaro_c: float = Field(1.0, gt=0.0, le=1.0, description="Saguaro scale C in (0, 1] applied to the "
                             "drafter's top-(F_k + 1) probabilities (1 = off)")
    draft_temperature_scale: float | None = Field(
        None, ge=0.01, allow_inf_nan=False, description="s >= 0.01: sampled rows draw their drafts from softmax(z / (T s)) "
        "(lossless: the verifier tests with that q); None: in SD the s the draft's config.json records (python -m "
        "train.calibrate: the s that maximises the draft's acceptance chance), else 1; in SSD 1 (a sharper q "
        "lowers the chance that a rejected position's bonus is among the cached candidates)")
    fanout: Fanout = Field(default_factory=lambda: [3], description="F_0..F_K for the speculation cache (SSD) and "
                           "Saguaro scaling; a single value means uniform, a list shorter than K + 1 repeats its "
                           "last entry. Ignored when fanout_strategy computes it")
    fanout_strategy: Literal["manual", "uniform", "geometric"] = Field(
        "manual", description="manual (use fanout), uniform or geometric (from fanout_budget, fanout_acceptance a "
        "and fanout_power r; see ssd_eagle.ssd.fanout)")
    fanout_budget: int = Field(24, description="branches per sequence for the uniform and geometric strategies, "
                               "and for trees under every strategy (manual: the fanout list scaled to it)")
    fanout_acceptance: float = Field(0.7, description="a, the draft's acceptance rate (geometric)")
    fanout_power: Power = Field(
        1.0, description="r > 0, the power of the geometric fan-out (and of the tree fan-out), or auto: the "
        "speculator fits r from its bonus ranks after 50 lookups and re-makes the geometric fan-out (needs "
        "fanout_strategy geometric, or a tree)")
    fanout_miss: list[int] | None = Field(None, description="a separate F_0..F_K after a cache miss (None: the same)")
    backup: Literal["neural", "fast", "auto"] = Field(
        "auto", description="SSD's backup speculator on a cache miss: neural (the draft drafts K tokens while the "
        "verifier waits), fast (n-gram lookup, ~1 ms) or auto (the default): every round the one with the higher "
        "long-run tokens/s, from what the speculator measures at run time (each backup's time, the verification "
        "time and the tokens of the rounds each source answered, the hit rate of the lookup after each source's "
        "proposals), the other one probed now and then; fast from "
        "fast_backup_batch rows up; neural until a verification was measured (see ssd_eagle.ssd.backup)")
    fast_backup_batch: int = Field(8, description="rows from which backup auto picks the fast speculator whatever "
                                   "the measured costs")
    speculator: Literal["process", "local"] = Field(
        "process", description="process (its own process and device, overlapping verification) or local (in the "
        "verifier's process, no overlap; for debugging)")
    speculator_timeout: float = Field(60.0, description="seconds the verifier waits for the speculator before "
                                      "falling back to plain decoding")
    speculator_heartbeat_timeout: float = Field(3.0, gt=0.5, le=60.0, description="seconds without a heartbeat "
                                                "(one every 0.5 s) after which the speculator process is hung: "
                                                "killed, then restarted by the server")
    tree_budget: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        0, description="propose EAGLE-2 dynamic trees of this many nodes (0: chains of K tokens), or auto: the largest tree "
        "measured to keep up with chains in SSD with the committed heads (ssd_eagle.ssd.branch_trees.AUTO_TREE: 6 nodes, "
        "tree_topk 2 unless tree_topk is given; chains for ngram)")
    tree_depth: int = Field(5, ge=1, description="dynamic tree levels (capped by K)")
    tree_topk: int = Field(4, ge=1, description="dynamic tree expansions per level")
    _auto_tree: bool = PrivateAttr(False)  # tree_budget was "auto" (to_dict dumps "auto" again) ...
    _auto_topk: bool = PrivateAttr(False)  # ... and it picked tree_topk (to_dict leaves it out)

    @model_validator(mode="after")
    def _check_combination(self) -> SpeculativeConfig:
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min/prompt_lookup_max must satisfy 1 <= min <= max")
        if self.tree_budget == "auto":
            from ssd_eagle.ssd.branch_trees import AUTO_TREE

            self.tree_budget = AUTO_TREE.budget if self.method != "ngram" else 0  # (n-gram proposals are chains)
            self._auto_tree = True
            if self.tree_budget and "tree_topk" not in self.model_fields_set:  # an explicit tree_topk stays
                self.tree_topk, self._auto_topk = AUTO_TREE.topk, True
        if self.tree_budget and self.method == "ngram":
            raise ValueError("speculative_config.tree_budget needs a neural draft (draft_model or eagle3)")
        if self.fanout_power == "auto" and self.fanout_strategy != "geometric" and not self.tree_budget:
            raise ValueError("speculative_config.fanout_power 'auto' re-fits a geometric fan-out: it needs "
                             "fanout_strategy 'geometric' (or tree_budget > 0)")
        return self

    def tree_settings(self):
        """The dynamic-tree shape, or None for chains."""
        from ssd_eagle.drafters.tree import TreeSettings

        if not self.tree_budget:
            return None
        return TreeSettings(self.tree_budget, min(self.tree_depth, self.num_speculative_tokens), self.tree_topk)

    @property
    def max_draft_tokens(self) -> int:
        """Most draft tokens in one proposal (tree nodes or K)."""
        return max(self.tree_budget, self.num_speculative_tokens)

    def kv_slack(self, holder: str) -> int:
        """Cache positions past the text (``max_model_len``) a draft cache needs for one round.

        Args:
            holder: ``draft`` (an SD drafter next to the target: the proposal, then a tree's deepest expansion) or
                ``speculator`` (the SSD speculator: the proposal and the verified round, then every branch's draft:
                K tokens of a chain, or the root plus (depth - 1) * topk fed nodes of a tree). The target's own
                cache needs one round, ``max_draft_tokens + 1`` (:class:`~ssd_eagle.engine.llm_engine.LLMEngine`).

        Raises:
            ValueError: an unknown ``holder``.
        """
        tree = self.tree_depth * self.tree_topk
        if holder == "draft":
            return self.max_draft_tokens + tree + 2
        if holder == "speculator":
            branches = max(sum(self.resolved_fanout()), sum(self.resolved_fanout_miss() or [0]))
            per_branch = self.num_speculative_tokens if not self.tree_budget else 1 + tree
            return 2 * (self.max_draft_tokens + 1) + branches * per_branch + tree
        raise ValueError(f"kv_slack holder must be 'draft' or 'speculator', got {holder!r}")

    def resolved_fanout(self) -> list[int]:
        """F_0..F_K (K + 1 entries) after applying ``fanout_strategy``; for trees they sum to ``fanout_budget``
        under every strategy (the speculator spreads that sum over tree nodes)."""
        from ssd_eagle.ssd.fanout import geometric_fanout, largest_remainder, uniform_fanout

        K = self.num_speculative_tokens
        if self.fanout_strategy == "uniform":
            return uniform_fanout(self.fanout_budget, K)
        if self.fanout_strategy == "geometric":
            power = 1.0 if self.fanout_power == "auto" else self.fanout_power  # auto starts from r = 1
            return geometric_fanout(self.fanout_budget, K, self.fanout_acceptance, power)
        manual = _expand(self.fanout, K + 1)
        if self.tree_budget:
            return largest_remainder(manual, self.fanout_budget) if sum(manual) else \
                uniform_fanout(self.fanout_budget, K)
        return manual

    def resolved_fanout_miss(self) -> list[int] | None:
        return _expand(self.fanout_miss, self.num_speculative_tokens + 1) if self.fanout_miss else None

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        """Raises ConfigError (a ValueError) naming an unknown key or a bad value."""
        return validated(cls, data, "speculative_config")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--speculative-config is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        """The keys given, not the defaults, ``tree_budget: "auto"`` as given (without the ``tree_topk`` it picked):
        re-read, the config is the same, and a key left to its default stays one (``tree_budget: "auto"`` laid over
        it still picks its own ``tree_topk``, another ``tree_budget`` gets the default one)."""
        data = self.model_dump(exclude_unset=True, exclude={"tree_topk"} if self._auto_topk else None)
        return {**data, "tree_budget": "auto"} if self._auto_tree else data


def _expand(values: list[int], n: int) -> list[int]:
    return (list(values) + [values[-1]] * n)[:n]


class EngineConfig(ConfigModel):
    """Everything needed to build an engine; each field's description says what it means.

    Raises:
        ValueError: unknown key or out-of-range value, naming the key.
    """

    model: str = Field(DEFAULT_MODEL, description="target model: local folder, packaged alias or hub id")
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto", description=DTYPE_HELP)
    device: str = Field("cpu", description="target (verifier) device, e.g. cpu or cuda:0")
    mode: Mode = Field("sd", description="ar: autoregressive; sd: speculative decoding; ssd: speculative "
                       "speculative decoding")
    speculative_config: SpeculativeConfig | None = Field(
        None, description="the drafter (sd/ssd without one: configs/default_serving.yaml's; ignored for ar)")
    max_model_len: int | None = Field(None, ge=2, description="longest prompt + output in tokens (default: the "
                                      "target's max positions)")
    max_num_seqs: int = Field(8, ge=1, description="requests decoded together in one batch")
    seed: int = Field(0, description="engine seed (requests without their own seed draw from it)")
    num_threads: int | None = Field(None, description="torch intra-op threads of the target (None: torch's "
                                    "default)")
    draft_device: str = Field("cpu", description="the speculator's device in SSD mode, e.g. cpu or cuda:1")
    draft_threads: int = Field(1, description="torch threads of the SSD speculator process")
    pin_cpus: bool = Field(True, description="SSD with both on CPU: pin the verifier and the speculator to "
                           "disjoint halves of the cores (how the CPU benchmark stands in for separate hardware)")
    eager: bool = Field(False, description="every decode forward in dynamic shapes: no CUDA graphs on GPU, and "
                        "the draft's steps off the fixed-shape path (padded rows and cache lengths) on every device")
    compile: bool = Field(False, description="torch.compile the target's decoder body (faster steps; about a "
                          "minute of compilation per input shape)")
    max_num_batched_tokens: int = Field(512, ge=1, description="tokens one engine step forwards: the running "
                                        "requests' rounds first, then prompt chunks (vLLM's chunked prefill)")
    enable_prefix_caching: bool = Field(True, description="reuse the cached keys/values of prompt prefixes shared "
                                        "with earlier requests (system prompt, earlier turns)")
    prefix_cache_memory: float = Field(0.0625, gt=0.0, allow_inf_nan=False, description="GiB the prefix cache "
                                       "may hold, within what kv_cache_memory leaves (least recently used blocks "
                                       "are evicted beyond it)")
    kv_cache_memory: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="GiB budget of the "
                                          "target's KV store plus the prefix cache; requests wait for room, one "
                                          "that can never fit is refused (None: unbounded)")

    @model_validator(mode="after")
    def _default_drafter(self) -> EngineConfig:
        if self.mode != "ar" and self.speculative_config is None:
            self.speculative_config = default_speculative_config(self.torch_dtype)
        return self

    @property
    def torch_dtype(self):
        return resolve_dtype(self.dtype, self.device)


def _default_serving(dtype=None) -> dict:
    """``configs/default_serving.yaml``, its ``by_dtype`` entry for ``dtype`` (a torch dtype or its name) laid
    over the top-level keys (the fallback of a dtype without one)."""
    raw = load_yaml(DEFAULT_SERVING_CONFIG) if DEFAULT_SERVING_CONFIG.is_file() else {}
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    return {**raw, **((raw.get("by_dtype") or {}).get(name) or {})}


def default_speculative_config(dtype=None) -> SpeculativeConfig:
    """The drafter of ``configs/default_serving.yaml`` for ``dtype`` (the resolved target dtype; the fastest
    lossless configuration of the latest benchmark run in that dtype), or the n-gram drafter when that file is
    absent."""
    spec = _default_serving(dtype).get("speculative_config")
    if spec:
        spec = dict(spec)
        if spec.get("model") and not Path(spec["model"]).is_absolute() and \
                (CONFIG_DIR.parent / spec["model"]).exists():
            spec["model"] = str(CONFIG_DIR.parent / spec["model"])
        return SpeculativeConfig.from_dict(spec)
    return SpeculativeConfig()


def default_draft_model(method: str) -> str | None:
    """The committed default draft for a method (``drafts/`` in the repository), or None."""
    path = (_default_serving().get("default_drafts") or {}).get(method)
    if path:
        return str(CONFIG_DIR.parent / path) if not Path(path).is_absolute() else path
    return None


def default_mode(dtype=None) -> str:
    """The mode of ``configs/default_serving.yaml`` for ``dtype`` (``sd`` when absent)."""
    return _default_serving(dtype).get("mode", "sd")


_SPEC_OVERRIDES = ("num_speculative_tokens", "tree_budget", "tree_depth", "tree_topk")

ENGINE_FLAGS = (
    *flags_for(EngineConfig, ["model", "dtype"]),
    Flag(EngineConfig, "device", names=("--device", "--target-device")),
    *flags_for(EngineConfig, ["draft_device", "draft_threads", "pin_cpus", "eager", "compile"]),
    Flag(EngineConfig, "mode", default=None, help=EngineConfig.model_fields["mode"].description
         + " (default: configs/default_serving.yaml, else sd)"),
    Flag(EngineConfig, "speculative_config", help='JSON, vLLM keys: {"method": "ngram"|"draft_model"|"eagle3", '
         '"model": ..., "num_speculative_tokens": K, ...} (default: configs/default_serving.yaml)'),
    Flag(SpeculativeConfig, "method", dest="drafter", default=None, help="override speculative_config.method "
         "(with the default config's model for it, if any)"),
    *(Flag(SpeculativeConfig, name, default=None, help=f"override speculative_config.{name}")
      for name in _SPEC_OVERRIDES),
    *flags_for(EngineConfig, ["max_model_len", "max_num_seqs", "seed", "num_threads", "max_num_batched_tokens",
                              "enable_prefix_caching", "prefix_cache_memory", "kv_cache_memory"]),
)
"""The engine flags shared by every entry point (later features add flags, never rename them)."""


def add_engine_args(parser):
    """Add :data:`ENGINE_FLAGS` to an ``argparse`` parser (read them back with :func:`ssd_eagle.schema.parse_flags`
    and :func:`engine_config_from_args`)."""
    add_flags(parser.add_argument_group("engine"), ENGINE_FLAGS)
    return parser


def add_bench_model_args(parser):
    """The target and draft options every benchmark script takes: ``--model``, ``--dtype`` (auto: see
    :mod:`ssd_eagle.platform`), ``--draft-lm`` and ``--eagle3`` (default: the committed drafts of
    ``configs/default_serving.yaml``)."""
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    parser.add_argument("--draft-lm", default=default_draft_model("draft_model"))
    parser.add_argument("--eagle3", default=default_draft_model("eagle3"))
    return parser


def engine_config_from_args(args) -> EngineConfig:
    """Build an :class:`EngineConfig` from parsed :data:`ENGINE_FLAGS` (attributes missing from ``args`` take the
    flag's default).

    Raises:
        ValueError: invalid flag values (naming the flag or key).
    """
    def given(flag):
        return getattr(args, flag.dest, flag.default)

    text = getattr(args, "speculative_config", None)
    spec = SpeculativeConfig.from_json(text) if text else None
    dtype = getattr(args, "dtype", None) or "auto"  # the defaults are per resolved dtype
    dtype = resolve_dtype(dtype, getattr(args, "device", None) or "cpu") if dtype in DTYPES else None
    mode = getattr(args, "mode", None) or default_mode(dtype)
    if spec is None and mode != "ar":
        spec = default_speculative_config(dtype)
    if spec is not None:
        overrides = {f.field: given(f) for f in ENGINE_FLAGS if f.model is SpeculativeConfig and given(f) is not None}
        if overrides.get("method", spec.method) != spec.method:
            overrides["model"] = default_draft_model(overrides["method"])
        if overrides:
            spec = SpeculativeConfig.from_dict({**spec.to_dict(), **overrides})
    values = {f.field: given(f) for f in ENGINE_FLAGS if f.model is EngineConfig}
    return validated(EngineConfig, {**values, "mode": mode, "speculative_config": spec}, "engine flags")
