"""Engine and speculative-decoding configuration, and the command-line surface shared by ``inference.generate``
and ``inference.serve`` (defined here once; later features add flags, never rename them).

Speculative settings follow vLLM: ``--speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'``
with vLLM's keys (``method``, ``model``, ``num_speculative_tokens``, ``prompt_lookup_min``, ``prompt_lookup_max``).
``--mode`` picks autoregressive decoding (``ar``), speculative decoding (``sd``) or speculative speculative
decoding (``ssd``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from ssd_eagle.assets import DEFAULT_MODEL
from ssd_eagle.platform import DTYPE_HELP, DTYPES, resolve_dtype

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_SERVING_CONFIG = CONFIG_DIR / "default_serving.yaml"

METHODS = ("ngram", "draft_model", "eagle3")
MODES = ("ar", "sd", "ssd")


@dataclass
class SpeculativeConfig:
    """What drafts and how much (vLLM's ``speculative_config`` keys, plus Saguaro's).

    Attributes:
        method: ``ngram`` (prompt lookup), ``draft_model`` (a small causal LM with the target's tokenizer) or
            ``eagle3`` (an EAGLE-3 head fed the target's aux hidden states).
        model: path or id of the draft (``draft_model``, ``eagle3``).
        num_speculative_tokens: K, draft tokens per round (>= 1).
        prompt_lookup_min / prompt_lookup_max: n-gram suffix lengths (``ngram``).
        saguaro_c: Saguaro scale C in (0, 1] applied to the drafter's top-(F_k + 1) probabilities (1 = off).
        fanout: F_0..F_K for the speculation cache (SSD) and Saguaro scaling; a single value means uniform, a list
            shorter than K + 1 repeats its last entry. Ignored when ``fanout_strategy`` computes it.
        fanout_strategy: ``manual`` (use ``fanout``), ``uniform`` or ``geometric`` (from ``fanout_budget``,
            ``fanout_acceptance`` a and ``fanout_power`` r; see :mod:`ssd_eagle.ssd.fanout`).
        fanout_miss: a separate F_0..F_K after a cache miss (None: the same).
        backup: SSD's backup speculator on a cache miss: ``neural``, ``fast`` (n-gram) or ``auto`` (fast from
            ``fast_backup_batch`` rows up, neural below).
        speculator: ``process`` (its own process and device, overlapping verification) or ``local`` (in the
            verifier's process, no overlap; for debugging).
        speculator_timeout: seconds the verifier waits for the speculator before falling back to plain decoding.
        tree_budget: propose EAGLE-2 dynamic trees of this many nodes (0: chains of K tokens).
        tree_depth / tree_topk: tree levels (capped by K) and expansions per level.

    Raises:
        ValueError: unknown key or out-of-range value, naming the key.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2  # a 1-token match is right too rarely to pay for verifying 5 tokens
    prompt_lookup_max: int = 4
    saguaro_c: float = 1.0
    fanout: list[int] = field(default_factory=lambda: [3])
    fanout_strategy: str = "manual"
    fanout_budget: int = 24
    fanout_acceptance: float = 0.7
    fanout_power: float = 1.0
    fanout_miss: list[int] | None = None
    backup: str = "neural"
    fast_backup_batch: int = 8
    speculator: str = "process"
    speculator_timeout: float = 60.0
    tree_budget: int = 0
    tree_depth: int = 5
    tree_topk: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min/prompt_lookup_max must satisfy 1 <= min <= max")
        if not 0.0 < float(self.saguaro_c) <= 1.0:
            raise ValueError(f"speculative_config.saguaro_c must be in (0, 1], got {self.saguaro_c!r}")
        if isinstance(self.fanout, int):
            self.fanout = [self.fanout]
        if not self.fanout or any(not isinstance(f, int) or f < 0 for f in self.fanout):
            raise ValueError(f"speculative_config.fanout must be a non-empty list of integers >= 0, "
                             f"got {self.fanout!r}")
        if self.fanout_strategy not in ("manual", "uniform", "geometric"):
            raise ValueError(f"speculative_config.fanout_strategy must be manual, uniform or geometric, "
                             f"got {self.fanout_strategy!r}")
        if self.backup not in ("neural", "fast", "auto"):
            raise ValueError(f"speculative_config.backup must be neural, fast or auto, got {self.backup!r}")
        if self.tree_budget < 0 or self.tree_depth < 1 or self.tree_topk < 1:
            raise ValueError("speculative_config.tree_budget must be >= 0 and tree_depth, tree_topk >= 1")
        if self.tree_budget and self.method == "ngram":
            raise ValueError("speculative_config.tree_budget needs a neural draft (draft_model or eagle3)")
        if self.speculator not in ("process", "local"):
            raise ValueError(f"speculative_config.speculator must be process or local, got {self.speculator!r}")

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

    def resolved_fanout(self) -> list[int]:
        """F_0..F_K (K + 1 entries) after applying ``fanout_strategy``."""
        from ssd_eagle.ssd.fanout import geometric_fanout, uniform_fanout

        K = self.num_speculative_tokens
        if self.fanout_strategy == "uniform":
            return uniform_fanout(self.fanout_budget, K)
        if self.fanout_strategy == "geometric":
            return geometric_fanout(self.fanout_budget, K, self.fanout_acceptance, self.fanout_power)
        return _expand(self.fanout, K + 1)

    def resolved_fanout_miss(self) -> list[int] | None:
        return _expand(self.fanout_miss, self.num_speculative_tokens + 1) if self.fanout_miss else None

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**data)

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
        return asdict(self)


def _expand(values: list[int], n: int) -> list[int]:
    return (list(values) + [values[-1]] * n)[:n]


@dataclass
class EngineConfig:
    """Everything needed to build an engine.

    Attributes:
        model: target model (local folder, packaged alias or hub id).
        dtype: ``auto`` (bfloat16 where matmuls run bf16 natively, else float32; see :mod:`ssd_eagle.platform`),
            ``float32``, ``float64``, ``bfloat16``, ``float16``.
        device: ``cpu`` or ``cuda[:i]`` for the target (the verifier).
        mode: ``ar``, ``sd`` or ``ssd``.
        speculative_config: the drafter (required for ``sd``/``ssd``; ignored for ``ar``).
        max_model_len: longest prompt + output in tokens (default: the target's max positions).
        max_num_seqs: requests decoded together in one batch.
        seed: engine seed (requests without their own seed draw from it).
        num_threads: torch intra-op threads of the target (None: torch's default).
        draft_device: the speculator's device in SSD mode (``cpu`` or ``cuda:i``).
        draft_threads: torch threads of the speculator process.
        pin_cpus: in SSD mode with both on CPU, pin the verifier and the speculator to disjoint halves of the
            cores (how the CPU benchmark stands in for separate hardware).
        eager: never capture CUDA graphs (they are used on CUDA devices otherwise; CPU always runs eagerly).
        compile: ``torch.compile`` the target's decoder body (faster steps, a minute of compilation per shape).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "cpu"
    mode: str = "sd"
    speculative_config: SpeculativeConfig | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 8
    seed: int = 0
    num_threads: int | None = None
    draft_device: str = "cpu"
    draft_threads: int = 1
    pin_cpus: bool = True
    eager: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in ("auto", "float32", "float64", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, float64, bfloat16 or float16, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.mode != "ar" and self.speculative_config is None:
            self.speculative_config = default_speculative_config()

    @property
    def torch_dtype(self):
        return resolve_dtype(self.dtype, self.device)


def default_speculative_config() -> SpeculativeConfig:
    """The drafter of ``configs/default_serving.yaml`` (the fastest lossless configuration of the latest benchmark
    run), or the n-gram drafter when that file is absent."""
    if DEFAULT_SERVING_CONFIG.is_file():
        data = yaml.safe_load(DEFAULT_SERVING_CONFIG.read_text()) or {}
        spec = data.get("speculative_config")
        if spec:
            spec = dict(spec)
            if spec.get("model") and not Path(spec["model"]).is_absolute() and \
                    (CONFIG_DIR.parent / spec["model"]).exists():
                spec["model"] = str(CONFIG_DIR.parent / spec["model"])
            return SpeculativeConfig.from_dict(spec)
    return SpeculativeConfig()


def default_draft_model(method: str) -> str | None:
    """The committed default draft for a method (``drafts/`` in the repository), or None."""
    if DEFAULT_SERVING_CONFIG.is_file():
        data = yaml.safe_load(DEFAULT_SERVING_CONFIG.read_text()) or {}
        path = (data.get("default_drafts") or {}).get(method)
        if path:
            return str(CONFIG_DIR.parent / path) if not Path(path).is_absolute() else path
    return None


def default_mode() -> str:
    """The mode of ``configs/default_serving.yaml`` (``sd`` when absent)."""
    if DEFAULT_SERVING_CONFIG.is_file():
        data = yaml.safe_load(DEFAULT_SERVING_CONFIG.read_text()) or {}
        return data.get("mode", "sd")
    return "sd"


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine flags shared by every entry point."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="target model: local folder, packaged alias or hub id (default: %(default)s, packaged)")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    g.add_argument("--device", "--target-device", dest="device", default="cpu",
                   help="target (verifier) device, e.g. cpu or cuda:0")
    g.add_argument("--draft-device", default="cpu", help="speculator device in SSD mode, e.g. cpu or cuda:1")
    g.add_argument("--draft-threads", type=int, default=1, help="torch threads of the SSD speculator process")
    g.add_argument("--no-pin-cpus", dest="pin_cpus", action="store_false",
                   help="SSD on CPU: do not pin verifier and speculator to disjoint cores")
    g.add_argument("--eager", action="store_true", help="on GPU: do not capture CUDA graphs")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the target (faster steps; about a minute of compilation per input shape)")
    g.add_argument("--mode", default=None, choices=MODES,
                   help="ar: autoregressive; sd: speculative decoding; ssd: speculative speculative decoding "
                        "(default: configs/default_serving.yaml, else sd)")
    g.add_argument("--speculative-config", default=None,
                   help='JSON, vLLM keys: {"method": "ngram"|"draft_model"|"eagle3", "model": ..., '
                        '"num_speculative_tokens": K, ...} (default: configs/default_serving.yaml)')
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="override speculative_config.num_speculative_tokens (K)")
    g.add_argument("--drafter", default=None, choices=METHODS,
                   help="override speculative_config.method (with the default config's model for it, if any)")
    g.add_argument("--tree-budget", type=int, default=None, help="dynamic draft trees of this many nodes (0: chain)")
    g.add_argument("--tree-depth", type=int, default=None, help="dynamic tree levels (<= K)")
    g.add_argument("--tree-topk", type=int, default=None, help="dynamic tree expansions per level")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the target's max positions)")
    g.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together in one batch")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=None, help="torch threads for the target")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an :class:`EngineConfig` from parsed :func:`add_engine_args` flags.

    Raises:
        ValueError: invalid flag values (naming the flag or key).
    """
    spec = SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None
    mode = args.mode or default_mode()
    if spec is None and mode != "ar":
        spec = default_speculative_config()
    if spec is not None:
        overrides = {key: value for key, value in (
            ("num_speculative_tokens", args.num_speculative_tokens), ("method", args.drafter),
            ("tree_budget", args.tree_budget), ("tree_depth", args.tree_depth), ("tree_topk", args.tree_topk))
            if value is not None}
        if args.drafter and args.drafter != spec.method:
            overrides["model"] = default_draft_model(args.drafter)
        if overrides:
            spec = SpeculativeConfig.from_dict({**spec.to_dict(), **overrides})
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, mode=mode, speculative_config=spec,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=args.seed,
                        num_threads=args.num_threads, draft_device=args.draft_device,
                        draft_threads=args.draft_threads, pin_cpus=args.pin_cpus,
                        eager=getattr(args, "eager", False), compile=getattr(args, "compile", False))
