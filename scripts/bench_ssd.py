"""SSD against its baselines on the real SmolLM2 target, side by side in one run.

Core placement (the CPU stands in for separate hardware): AR and SD run with the target on one core (the paper's
baselines use the target's devices only), SD also on both cores; SSD runs the verifier on core 0 and the
speculator on core 1, one thread each. Same held-out prompts (MT-Bench and HumanEval), same token count, batch 1,
for T = 0, 0.5, 1.0. Per configuration and temperature it prints tokens/s, tau, the cache hit rate, the ratio to
AR and to SD, and for SD the measured verify time V and drafting time D per round, whose ``(V + D) / V`` caps what
SSD can gain over that SD, and for SSD the bound ``tau x T1 / V(K+1)`` (T1: AR's one-token step, V(K+1): the SSD
run's verification of K + 1 tokens) on its speedup over AR, next to the verifier's mean wait per round for its drafts
on cache hits and on misses (``wait_on_hit_ms``, ``wait_on_miss_ms`` of ``spec_stats``), and below the table the
speculator's own ms per backup call (``SpeculatorStats.backup``: the rest of a miss's wait is the link and the build
it interrupted). ``--repeats N`` runs every
configuration N times, in N interleaved passes (each pass runs every configuration once), and reports the median;
every ``*_plan`` row (the planner's choice, :mod:`ssd_eagle.planner`) gets the check "planner's choice vs AR: median
ratio over N runs (goal >= 0.97)", the ratios taken pass by pass, with the rounds per planned draft length. At
T = 0 it applies the near-tie rule of :mod:`ssd_eagle.exactness` to every configuration against AR in the same dtype:
every emitted token is the argmax of its own verification (checked through logprobs), and the first divergence from
AR of each prompt must be a near tie (it prints the divergence rate and the gaps). The header names the CPU, its
bf16 flags and the dtype (``--dtype auto``: bfloat16 where matmuls run bf16 natively, see :mod:`ssd_eagle.platform`).
It writes a CSV and a PNG of the cache hit rate against the fan-out F with the fitted power law
``1 - p_hit(F) = F^-r``. With a Saguaro-aware head (``--eagle3-saguaro``, default
``drafts/smollm2-135m-eagle3-saguaro`` when it holds weights: they are not tracked in git) it adds issue 7's pair: the plain and the Saguaro-aware head
served at the same (C, F) with a uniform fan-out (``ssd_eagle3_sag_plain`` / ``ssd_eagle3_sag_aware``).

    python scripts/bench_ssd.py --prompts 4 --max-tokens 128 --out runs/bench_ssd
    python scripts/bench_ssd.py --configs ar,sd_ngram,sd_eagle3,ssd_eagle3,sd_lm --temperatures 0 --dtype float32
    python scripts/bench_ssd.py --configs ar,sd_lm,ssd_lm_geo,ssd_lm_geo_fast,ssd_lm_geo_auto --temperatures 0
    python scripts/bench_ssd.py --configs ar,ssd_eagle3,ssd_eagle3_fast,ssd_eagle3_auto --temperatures 0 --prompts 1
    python scripts/bench_ssd.py --configs ssd_eagle3_sag_plain,ssd_eagle3_sag_aware --temperatures 0.5,1.0
    python scripts/bench_ssd.py --configs ar,sd_eagle3,sd_eagle3_unscaled,sd_lm,sd_lm_unscaled --temperatures 0.5,1.0
    python scripts/bench_ssd.py --configs ar,sd_ngram_plan,sd_eagle3_plan,sd_lm_plan --prompts 1 --max-tokens 64 \
        --repeats 3
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ssd_eagle.assets import load_model
from ssd_eagle.config import EngineConfig, SpeculativeConfig, add_bench_model_args
from ssd_eagle.engine.factory import make_drafter
from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.planner import planner_for
from ssd_eagle.exactness import TopTwoRecorder, argmax_consistent, first_divergence, judge
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import RunnerOutput
from ssd_eagle.models.draft_lm import load_draft_model
from ssd_eagle.models.eagle3_formats import has_checkpoint
from ssd_eagle.platform import describe_line, resolve_dtype
from ssd_eagle.prompts import heldout_prompts
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.fanout import fit_power_law, hit_rate_by_rank
from ssd_eagle.ssd.transport import SpeculatorUnavailable

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Config:
    name: str
    mode: str  # ar | sd | ssd | hf
    spec: dict = field(default_factory=dict)
    cores: int = 1  # cores of the target (SD on both cores uses 2)
    hf: str | None = None  # "assisted" or "lookup"
    fixed_width: bool = False  # shape-invariant: every target forward padded to K + 1 tokens (FixedWidthEngine)
    plan: bool = False  # the planner's choice (ssd_eagle.planner): K in 0..K from measured costs and acceptance
    tree_only: bool = False  # with plan: an SD tree planned on or off only, no chains competing (ablation)
    whole_tree: bool = False  # with plan: an SD tree's rounds the whole tree or chains, no smaller trees (ablation)
    draws: bool = False  # with plan: sampled rows teach the planner their accept/reject draws, not their chances


class FixedWidthEngine(LLMEngine):
    """The shape-invariant experiment of issue 13: every round's target forward is padded to ``width`` tokens per
    row, so a one-token AR step and a verification of fewer drafts run the same kernels as a full verification.
    Pad tokens continue their row causally and write dead cache positions (as in any ragged batch); only the real
    positions' logits are used. Chains only (trees keep their own shape).

    Measured 2026-12-01 (SmolLM2-135M, bfloat16, AMD EPYC with avx512_bf16, 12 held-out prompts x 64 tokens, K = 5):
    padding alone does not make SD bitwise equal to AR. Against padded AR, 1/12 (n-gram) and 3/12 (EAGLE-3) prompts
    still diverge, against 4/12 and 6/12 unpadded SD vs plain AR, all at near ties: the token's row within the
    verification and the attended length still change the kernels' summation. A 6-token forward costs ~1.2x a
    one-token forward in bf16 there (scripts/bench_forward.py), ~1.9x in float32."""

    def __init__(self, *args, width: int, **kwargs):
        super().__init__(*args, **{**kwargs, "max_draft_tokens": max(kwargs.get("max_draft_tokens") or 0, width - 1)})
        self.width = width

    def _verify_forward(self, batch: ForwardBatch) -> RunnerOutput:
        n = batch.input_ids.shape[1]
        if n >= self.width or not batch.plain_causal:
            return super()._verify_forward(batch)
        ids = batch.input_ids.tolist()
        tokens = [ids[b][: batch.num_tokens[b]] + [0] * (self.width - batch.num_tokens[b]) for b in range(len(ids))]
        padded = ForwardBatch.causal(tokens, batch.slots.tolist(), batch.position_ids[:, 0].tolist(),
                                     self.target.dtype, self.target.device)
        out = super()._verify_forward(padded)
        return RunnerOutput(out.logits[:, :n], None if out.aux_hidden is None else out.aux_hidden[:, :n],
                            out.hidden[:, :n])


def configs(args) -> dict[str, Config]:
    lm, head = args.draft_lm, args.eagle3
    head_saguaro = args.eagle3_saguaro if args.eagle3_saguaro and has_checkpoint(args.eagle3_saguaro) else None
    K, B = args.k, args.budget
    lm_spec = {"method": "draft_model", "model": lm, "num_speculative_tokens": K}
    e3 = {"method": "eagle3", "model": head, "num_speculative_tokens": K}
    tree = {"tree_budget": args.tree_budget, "tree_depth": K,
            **({"tree_topk": args.tree_topk} if args.tree_topk else {})}
    uniform = {"fanout_strategy": "uniform", "fanout_budget": B}
    unscaled = {"draft_temperature_scale": 1.0}
    geometric = {"fanout_strategy": "geometric", "fanout_budget": B, "fanout_acceptance": args.acceptance,
                 "fanout_power": args.power}
    out = [
        Config("ar", "ar"),
        Config("sd_ngram", "sd", {"method": "ngram", "num_speculative_tokens": K}),
        Config("sd_lm", "sd", lm_spec),
        Config("sd_lm_2core", "sd", lm_spec, cores=2),
        Config("ssd_lm_uniform", "ssd", {**lm_spec, **uniform}),
        Config("ssd_lm_geo", "ssd", {**lm_spec, **geometric, "backup": "neural"}),
        Config("ssd_lm_geo_saguaro", "ssd", {**lm_spec, **geometric, "saguaro_c": args.saguaro_c or 0.7}),
        Config("ssd_lm_geo_fast", "ssd", {**lm_spec, **geometric, "backup": "fast"}),  # a miss waits for no draft
        Config("ssd_lm_geo_auto", "ssd", {**lm_spec, **geometric, "backup": "auto"}),  # the measured choice per miss
        Config("sd_eagle3", "sd", e3),
        Config("sd_eagle3_tree", "sd", {**e3, **tree}),
        Config("ssd_eagle3", "ssd", {**e3, **geometric, "backup": "neural"}),
        Config("ssd_eagle3_fast", "ssd", {**e3, **geometric, "backup": "fast"}),  # a miss drafts by n-gram lookup
        Config("ssd_eagle3_auto", "ssd", {**e3, **geometric, "backup": "auto"}),  # the measured choice per miss
        Config("ssd_eagle3_tree", "ssd", {**e3, **tree, "fanout_budget": B}),
        Config("ssd_eagle3_tree_auto", "ssd", {**e3, "tree_budget": "auto", "fanout_budget": B}),  # AUTO_TREE
        # the planner's choice of K (up to K, or no speculation) for the same drafters
        Config("sd_ngram_plan", "sd", {"method": "ngram"}, plan=True),
        Config("sd_eagle3_plan", "sd", {"method": "eagle3", "model": head}, plan=True),
        Config("sd_lm_plan", "sd", {"method": "draft_model", "model": lm}, plan=True),
        Config("ssd_eagle3_plan", "ssd", {"method": "eagle3", "model": head, **geometric}, plan=True),
        # the tree or its best half, quarter..., a chain of 1..K, or neither (configs/default_serving.yaml's bfloat16
        # entry); ablations: the tree or a chain (session 47), the tree on or off (session 46)
        Config("sd_eagle3_tree_plan", "sd", {"method": "eagle3", "model": head, **tree}, plan=True),
        Config("sd_eagle3_tree_only_plan", "sd", {"method": "eagle3", "model": head, **tree}, plan=True,
               tree_only=True),
        Config("sd_eagle3_tree_whole_plan", "sd", {"method": "eagle3", "model": head, **tree}, plan=True,
               whole_tree=True),
        # the planner before it learnt sampled rows' chances of acceptance (ablation)
        Config("sd_eagle3_draws_plan", "sd", {"method": "eagle3", "model": head}, plan=True, draws=True),
        Config("sd_eagle3_tree_draws_plan", "sd", {"method": "eagle3", "model": head, **tree}, plan=True,
               draws=True),
        Config("ssd_eagle3_tree_plan", "ssd", {**e3, "tree_budget": "auto", "fanout_budget": B}, plan=True),
        # SD with the drafts' own temperature scale s off (1: q at the row's temperature; ablation of
        # train.calibrate's s; SSD drafts at s = 1 unless told otherwise)
        Config("sd_eagle3_unscaled", "sd", {**e3, **unscaled}),
        Config("sd_eagle3_plan_unscaled", "sd", {"method": "eagle3", "model": head, **unscaled}, plan=True),
        Config("sd_eagle3_tree_plan_unscaled", "sd", {"method": "eagle3", "model": head, **tree, **unscaled},
               plan=True),
        Config("sd_lm_unscaled", "sd", {**lm_spec, **unscaled}),
        Config("hf_assisted", "hf", hf="assisted"),
        Config("hf_lookup", "hf", hf="lookup"),
        # the shape-invariant experiment: judged bitwise against ar_fixed
        Config("ar_fixed", "ar", fixed_width=True),
        Config("sd_ngram_fixed", "sd", {"method": "ngram", "num_speculative_tokens": K}, fixed_width=True),
        Config("sd_eagle3_fixed", "sd", e3, fixed_width=True),
    ]
    if head_saguaro:  # issue 7: the plain and the Saguaro-aware head served at the same (C, F), uniform fan-out
        c, f = saguaro_setting(args)
        sag = {**e3, "fanout_strategy": "uniform", "fanout_budget": f * (K + 1), "saguaro_c": c}
        out.append(Config("ssd_eagle3_sag_plain", "ssd", sag))
        out.append(Config("ssd_eagle3_sag_aware", "ssd", {**sag, "model": head_saguaro}))
    return {c.name: c for c in out}


def saguaro_setting(args) -> tuple[float, int]:
    """(C, F) for the issue-7 comparison: the command line's, else what the Saguaro-aware head was trained for."""
    trained = {}
    config = Path(args.eagle3_saguaro) / "config.json"
    if config.exists():
        trained = json.loads(config.read_text()).get("ssd_eagle") or {}
    def pick(given, key, default):
        if given is not None:
            return given
        return trained[key] if trained.get(key) is not None else default

    return float(pick(args.saguaro_c, "saguaro_c", 0.7)), int(pick(args.saguaro_fanout, "saguaro_fanout", 3))


def pin(cores: int, allowed: list[int], first: int = 0) -> None:
    """Run on ``cores`` of the ``allowed`` cores (the affinity the script was started with, e.g. by ``taskset``)
    from the ``first`` on (wrapping around), with as many torch threads; fewer when fewer are allowed."""
    chosen = [allowed[(first + i) % len(allowed)] for i in range(min(cores, len(allowed)))]
    os.sched_setaffinity(0, chosen)
    torch.set_num_threads(len(chosen))


def run_engine(engine: LLMEngine, prompts, params, record_top2: bool = False) -> dict:
    """Decode ``prompts`` one by one; with ``record_top2`` also AR's top-2 logits per output token (near-tie rule)."""
    from contextlib import nullcontext

    from ssd_eagle.stats import SpecStats

    tokens, seconds, total = 0, 0.0, SpecStats()
    outputs, top2, consistent = [], [], True
    for i, p in enumerate(prompts):
        recorder = TopTwoRecorder(engine.target.model) if record_top2 else None
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
        start = time.perf_counter()
        with recorder or nullcontext():
            while engine.has_unfinished():
                outs = engine.step()
        seconds += time.perf_counter() - start
        out = outs[-1].outputs[0]
        tokens += len(out.token_ids)
        outputs.append(list(out.token_ids))
        top2.append(recorder.rows if recorder else None)
        consistent &= out.logprobs is None or argmax_consistent(out.logprobs)
        total.merge(outs[-1].stats)
    rounds, summary = max(total.num_rounds, 1), total.summary()
    return {"tokens": tokens, "seconds": seconds, "tps": tokens / seconds, "tau": total.tau,
            "acc": total.acceptance_rate if total.num_drafted else None, "hit": total.cache_hit_rate,
            "V": total.verify_time / rounds, "D": total.draft_time / rounds, "rounds": total.num_rounds,
            "wait_on_hit_ms": summary.get("wait_on_hit_ms"), "wait_on_miss_ms": summary.get("wait_on_miss_ms"),
            "fast_backup": f"{total.rounds_on_fast_backup}/{total.rounds_on_miss}" if total.cache_lookups else None,
            "planned_k": summary.get("planned_rounds_per_k"), "probes": summary.get("probes"),
            "tree_rounds": summary.get("planned_tree_rounds"), "tree_nodes": summary.get("planned_tree_nodes"),
            "argmax_ok": consistent if params.logprobs is not None else None, "outputs": outputs, "top2": top2}


def run_hf(model, assistant, prompts, params, kind: str, k: int) -> dict:
    tokens, seconds, outputs = 0, 0.0, []
    for p in prompts:
        ids = torch.tensor([p])
        kwargs = {"prompt_lookup_num_tokens": k} if kind == "lookup" else {"assistant_model": assistant}
        sample = {"do_sample": False} if params.temperature == 0 else {"do_sample": True,
                                                                       "temperature": params.temperature}
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                 **sample, **kwargs)
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - len(p)
        outputs.append(out[0, len(p):].tolist())
    return {"tokens": tokens, "seconds": seconds, "tps": tokens / seconds, "tau": None, "acc": None, "hit": None,
            "V": None, "D": None, "rounds": None, "wait_on_hit_ms": None, "wait_on_miss_ms": None, "fast_backup": None,
            "planned_k": None, "probes": None, "tree_rounds": None, "tree_nodes": None, "argmax_ok": None,
            "outputs": outputs, "top2": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_model_args(ap)
    ap.add_argument("--eagle3-saguaro", default=str(ROOT / "drafts/smollm2-135m-eagle3-saguaro"),
                    help="a Saguaro-aware head, compared with the plain head at the same (C, F) (issue 7); '' skips")
    ap.add_argument("--configs", default=None, help="comma-separated subset of configuration names")
    ap.add_argument("--temperatures", default="0,0.5,1.0")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per split")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--budget", type=int, default=24, help="SSD fan-out budget B (branches per sequence)")
    ap.add_argument("--acceptance", type=float, default=0.7, help="a of the geometric fan-out")
    ap.add_argument("--power", type=float, default=1.0, help="r of the geometric fan-out")
    ap.add_argument("--saguaro-c", type=float, default=None,
                    help="Saguaro C (default: the Saguaro-aware head's, else 0.7); ssd_lm_geo_saguaro uses it too")
    ap.add_argument("--saguaro-fanout", type=int, default=None,
                    help="F of the issue-7 comparison (default: the Saguaro-aware head's, else 3)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="interleaved passes over the configurations (median tok/s; the planner's median ratio to AR)")
    ap.add_argument("--tree-budget", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="tree nodes of the *_tree rows, or auto (the serving default, AUTO_TREE)")
    ap.add_argument("--tree-topk", type=int, default=None, help="expansions per level (default: auto's, else 4)")
    ap.add_argument("--out", default=str(ROOT / "runs/bench_ssd"))
    ap.add_argument("--first-core", type=int, default=0,
                    help="pin from this one of the allowed cores on (one-core configurations use only it; a shared "
                         "machine can run two)")
    args = ap.parse_args()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_configs = configs(args)
    names = args.configs.split(",") if args.configs else list(all_configs)
    unknown = [n for n in names if n not in all_configs]
    if unknown:
        why = (f" (the ssd_eagle3_sag_* rows need a Saguaro-aware head with weights; --eagle3-saguaro "
               f"{args.eagle3_saguaro!r} has none)" if any(n.startswith("ssd_eagle3_sag_") for n in unknown) else "")
        ap.error(f"--configs: unknown {', '.join(unknown)}{why}; known: {', '.join(all_configs)}")
    temps = [float(t) for t in args.temperatures.split(",")]
    args.allowed_cores = sorted(os.sched_getaffinity(0))  # pins stay inside what the caller gave (taskset)
    if len(args.allowed_cores) < 2:
        print(f"note: only core(s) {args.allowed_cores} allowed: SSD rows share one core between the verifier and "
              "the speculator", flush=True)
    pin(1, args.allowed_cores, args.first_core)
    dtype = resolve_dtype(args.dtype, "cpu")
    print(describe_line("cpu", dtype), flush=True)
    model, tokenizer = load_model(args.model, dtype=dtype)
    prompts = [render_chat(tokenizer, p["messages"])
               for split in ("mtbench", "humaneval") for p in heldout_prompts(split)[: args.prompts]]
    # one untimed AR decode first: the process's first decode pays one-time costs (page faults, kernel selection)
    # that landed on the first row of the first pass (its AR ran ~25% slower than in later passes)
    run_config(all_configs["ar"], argparse.Namespace(**{**vars(args), "max_tokens": 16}), model, tokenizer,
               prompts[:1], [0.0], {}, {})
    # repeats interleaved (every configuration once per pass): the ratios of one pass share the machine's state
    results: dict[tuple[str, float], list[dict]] = {}
    ranks: dict[str, list[int]] = {}
    backups: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name in names:
            for temp, run in run_config(all_configs[name], args, model, tokenizer, prompts, temps, ranks,
                                         backups).items():
                results.setdefault((name, temp), []).append(run)
                print(json.dumps({"config": name, "temperature": temp,
                                  **{k: v for k, v in run.items() if k not in ("outputs", "top2")}}), flush=True)
    rows = []
    for (name, temp), runs in results.items():
        ordered = sorted(runs, key=lambda r: r["tps"])
        rows.append({"config": name, "temperature": temp, **ordered[len(ordered) // 2], "tps_min": ordered[0]["tps"],
                     "tps_max": ordered[-1]["tps"], "tps_runs": [r["tps"] for r in runs]})
    near_ties(rows)
    report(rows, ranks, backups, out_dir, args, describe_line("cpu", dtype))


def drop_chances(observe_round):
    """A planner's ``observe_round`` that learns sampled rows' draws, not their chances of acceptance."""
    return lambda *args, chances=None, **kwargs: observe_round(*args, **kwargs)


def run_config(cfg: Config, args, model, tokenizer, prompts, temps: list[float], ranks: dict,
               backups: dict) -> dict[float, dict]:
    """One run of configuration ``cfg`` at every temperature (its drafter built for it and closed after); an SSD
    configuration's bonus-token ranks are added to ``ranks[cfg.name]`` and its speculator's backup measurements
    (``SpeculatorStats.backup``) set ``backups[cfg.name]``."""
    pin(2 if cfg.mode == "ssd" or cfg.cores == 2 else 1, args.allowed_cores, args.first_core)
    spec = SpeculativeConfig.from_dict(cfg.spec) if cfg.spec else None
    drafter = assistant = None
    if cfg.mode in ("sd", "ssd"):
        ecfg = EngineConfig(model=args.model, mode=cfg.mode, speculative_config=spec, max_num_seqs=1,
                            max_model_len=4096)
        drafter = make_drafter(ecfg, model, 4096)
    elif cfg.mode == "hf" and cfg.hf == "assisted":
        assistant = load_draft_model(args.draft_lm, model)  # a compact export is completed from the target
    K = spec.num_speculative_tokens if spec else 0
    out = {}
    for temp in temps:
        # at T = 0 every token's logprobs show it is its verification's argmax (near-tie rule); AR asks for them too,
        # so every row pays the same log-softmax per emitted token (~0.25 ms a round in float32)
        params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=1234,
                                logprobs=1 if temp == 0 else None)
        if cfg.mode == "hf":
            out[temp] = run_hf(model, assistant, prompts, params, cfg.hf, args.k)
            continue
        kind, width = (FixedWidthEngine, {"width": args.k + 1}) if cfg.fixed_width else (LLMEngine, {})
        engine = kind(model, tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=1, max_model_len=4096,
                      max_draft_tokens=spec.max_draft_tokens if spec else 0, **width)
        if cfg.plan:
            engine.planner = planner_for(engine, spec)
            if cfg.tree_only or cfg.whole_tree:  # (ablations: the planner of sessions 46 / 47)
                engine.planner.config.tree_sizes = ()
            if cfg.tree_only:
                engine.planner.config.chains = False
                engine.planner.tree_round = engine.planner.config.tree_nodes
            if cfg.draws:
                engine.planner.observe_round = drop_chances(engine.planner.observe_round)
        out[temp] = run_engine(engine, prompts, params, record_top2=cfg.mode == "ar" and temp == 0)
    if cfg.mode == "ssd":
        try:  # (a speculator that failed mid-run was replaced by ordinary decoding: its rows show that)
            stats = drafter.speculator.stats()[0]
            ranks.setdefault(cfg.name, []).extend(stats.bonus_ranks)
            backups[cfg.name] = stats.backup
        except SpeculatorUnavailable as err:
            print(f"{cfg.name}: the speculator failed ({err}); the engine went on decoding without it")
        drafter.close()
    return out


def near_ties(rows) -> None:
    """At T = 0: judge every configuration's output against AR's in the same run (ssd_eagle.exactness); a
    shape-invariant (``_fixed``) configuration against ``ar_fixed``, and it should match bitwise."""
    for r in rows:
        ar_name = "ar_fixed" if r["config"].endswith("_fixed") and r["config"] != "ar_fixed" else "ar"
        ar = next((a for a in rows if a["config"] == ar_name and a["temperature"] == 0), None)
        if ar is None or r is ar or r["temperature"] != 0:
            continue
        if r["config"] == "ar_fixed":  # the padded AR against plain AR: does padding change the text?
            r["diverged"] = f"{sum(first_divergence(a, b) is not None for a, b in zip(ar['outputs'], r['outputs']))}" \
                            f"/{len(r['outputs'])}"
            continue
        divs = [judge(ref, top2, out) for ref, top2, out in zip(ar["outputs"], ar["top2"], r["outputs"])]
        found = [d for d in divs if d is not None]
        r["diverged"] = f"{len(found)}/{len(divs)}"
        r["near_ties_ok"] = all(d.allowed for d in found)
        r["gaps"] = ";".join(f"{d.gap:.4g}<={d.bound:.4g}" if d.allowed else f"{d.gap:.4g}>{d.bound:.4g}"
                             for d in found)


def bounds(r, by) -> tuple[float | None, float | None]:
    """(bound, reached): an SD row's (V + D) / V next to what its SSD counterpart reached over it; an SSD row's
    tau x T1 / V(K+1) next to its speedup over AR (T1: AR's step time, V(K+1): this run's verification)."""
    temp, drafter = r["temperature"], _drafter(r["config"])
    if r["config"].startswith("sd_") and r["V"]:
        ssd = next((o for (name, t), o in by.items() if t == temp and name.startswith("ssd_")
                    and _drafter(name) == drafter), None)
        return (r["V"] + r["D"]) / r["V"], ssd["tps"] / r["tps"] if ssd else None
    ar = by.get(("ar", temp))
    if r["config"].startswith("ssd_") and ar and ar["V"] and r["V"] and r["tau"]:
        return r["tau"] * ar["V"] / r["V"], r["tps"] / ar["tps"]
    return None, None


def _drafter(name: str) -> str:
    return "eagle3" if "eagle3" in name else "lm" if "_lm" in name else name.split("_", 1)[-1]


def report(rows, ranks, backups, out_dir: Path, args, platform_line: str) -> None:
    with open(out_dir / "results.csv", "w", newline="") as f:
        fields = list(dict.fromkeys(k for r in rows for k in r if k not in ("outputs", "top2")))
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    by = {(r["config"], r["temperature"]): r for r in rows}
    print(f"\n{platform_line}\nmodel={args.model} prompts/split={args.prompts} max_tokens={args.max_tokens} "
          f"K={args.k} B={args.budget} repeats={args.repeats} (tok/s: median, spread min-max)")
    header = f"{'config':24s} {'T':>4s} {'tok/s':>7s} {'spread':>13s} {'tau':>5s} {'acc':>5s} {'hit':>5s} " \
             f"{'xAR':>5s} {'xSD':>5s} {'V ms':>6s} {'D ms':>6s} {'bound':>5s} {'reach':>5s} {'wHit':>6s} " \
             f"{'wMiss':>6s} {'fastB':>7s} {'div':>5s}"
    print(header)
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    for r in rows:
        ar = by.get(("ar", r["temperature"]))
        sd = by.get(("sd_eagle3" if "eagle3" in r["config"] else "sd_lm", r["temperature"])) \
            if r["config"].startswith(("ssd_", "hf_")) else None  # xSD: SSD (or transformers) over the same draft's SD
        bound, reached = bounds(r, by)
        spread = f"{r['tps_min']:.2f}-{r['tps_max']:.2f}"
        div = r.get("diverged", "-") + ("" if r.get("near_ties_ok", True) and r.get("argmax_ok") is not False
                                        else "!")
        print(f"{r['config']:24s} {r['temperature']:4.1f} {r['tps']:7.2f} {spread:>13s} {fmt(r['tau'], '5.2f'):>5s} "
              f"{fmt(r['acc'], '5.2f'):>5s} {fmt(r['hit'], '5.2f'):>5s} "
              f"{fmt(r['tps'] / ar['tps'] if ar else None, '5.2f'):>5s} "
              f"{fmt(r['tps'] / sd['tps'] if sd else None, '5.2f'):>5s} {fmt(r['V'] and r['V'] * 1e3, '6.1f'):>6s} "
              f"{fmt(r['D'] and r['D'] * 1e3, '6.1f'):>6s} {fmt(bound, '5.2f'):>5s} {fmt(reached, '5.2f'):>5s} "
              f"{fmt(r['wait_on_hit_ms'], '6.2f'):>6s} {fmt(r['wait_on_miss_ms'], '6.2f'):>6s} "
              f"{r['fast_backup'] or '-':>7s} {div:>5s}")
    print("bound/reach: SD rows (V + D) / V and the SSD config's tok/s over it; SSD rows tau x T1 / V(K+1) and "
          "tok/s over AR.\nwHit/wMiss: the verifier's mean wait per round for its drafts (ms) on speculation cache "
          "hits / misses (SSD).\nfastB: misses answered by the fast (n-gram) backup / all misses (backup fast, or auto's "
          "choice).\ndiv (T = 0): prompts whose output differs from AR's; '!' marks a divergence that is "
          "not a near tie (AR top-2 gap > 2^-6 max(|top1|, 1)) or a token that is not its verification's argmax.")
    for r in rows:
        if r.get("gaps"):
            print(f"  {r['config']}: first-divergence AR top-2 gaps (gap vs bound): {r['gaps']}")
    for name, b in backups.items():  # what wMiss is made of: the backup's own time, the rest is link and build
        if b is not None:
            print(f"  {name}: the speculator's own measure (last pass, all T): ms per backup call {b['ms']}, miss "
                  f"rounds per backup under auto {b['chosen']}, verify ms after each source {b['verify_ms']}")
    planner_check(rows, by)
    plot_hit_rate(ranks, out_dir)


def planner_check(rows, by) -> None:
    """For every ``*_plan`` row: the median over the runs of its tok/s over AR's in the same pass (issue 13's goal:
    the planner's choice never below 0.97x AR), and the rounds per planned draft length of its median run."""
    for r in rows:
        ar = by.get(("ar", r["temperature"]))
        if not r["config"].endswith("_plan") or ar is None:
            continue
        ratios = [p / a for p, a in zip(r["tps_runs"], ar["tps_runs"])]
        median = statistics.median(ratios)
        print(f"planner's choice vs AR: {r['config']} T={r['temperature']:g}: median ratio over {len(ratios)} runs "
              f"{median:.3f} (goal >= 0.97{'' if median >= 0.97 else ', MISSED'}); runs "
              f"{', '.join(f'{x:.3f}' for x in ratios)}; rounds per planned K {r['planned_k']} "
              f"({r['tree_rounds']} trees, by nodes {r['tree_nodes']}), probes {r['probes']}")


def plot_hit_rate(ranks: dict[str, list[int]], out_dir: Path) -> None:
    """Bonus-token hit rate against the fan-out F from the observed ranks, with the fitted power law (no PNG when no
    SSD row recorded 10 ranks)."""
    ranks = {name: r for name, r in ranks.items() if len(r) >= 10}
    if not ranks:
        print(f"wrote {out_dir / 'results.csv'}; no hit-rate plot: no SSD row recorded 10 bonus-token ranks")
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    fits = {}
    for name, r in ranks.items():
        fs, hits = hit_rate_by_rank(r, 16)
        ax.plot(fs, hits, "o", label=f"{name} (measured)")
        try:
            fit = fit_power_law(fs, hits)
        except ValueError:
            continue
        fits[name] = fit
        grid = [f / 4 for f in range(4, 65)]
        ax.plot(grid, [1 - fit.scale * f ** -fit.power for f in grid], "-",
                label=f"{name}: 1-{fit.scale:.2f}F^-{fit.power:.2f}")
    ax.set_xlabel("fan-out F (bonus candidates cached)")
    ax.set_ylabel("bonus-token hit rate")
    ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "hit_rate_vs_fanout.png", dpi=120)
    with open(out_dir / "power_law_fits.json", "w") as f:
        json.dump({n: {"r": fit.power, "c": fit.scale, "points": fit.points} for n, fit in fits.items()}, f,
                  indent=2)
    print(f"wrote {out_dir / 'results.csv'}, {out_dir / 'hit_rate_vs_fanout.png'}; power-law fits: "
          + ", ".join(f"{n}: r={fit.power:.2f}" for n, fit in fits.items()))


if __name__ == "__main__":
    main()
