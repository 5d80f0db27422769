"""SSD-EAGLE-3 end to end on one GPU (two processes, gloo) or two (NCCL): eager vs CUDA-graph tokens/s for AR,
SD-EAGLE-3 and SSD-EAGLE-3, and greedy output equal to AR. Run by ``scripts/gpu_check.sh``.

Random models of SmolLM2-135M's shape (no model files; :func:`gpu_throughput.smollm2_shaped`) with a random
EAGLE-3 head: acceptance is meaningless, the figures are per-round costs. The speed rows run in bfloat16, batch 1;
the equality check runs in float64 (a bf16 random model has near-ties that any change of kernel shape can flip).

    PYTHONPATH=.:tests:scripts python tests/gpu/e2e.py --tokens 128
"""

from __future__ import annotations

import argparse

import torch

from gpu_throughput import _Tokenizer, run, smollm2_shaped
from helpers import eagle3_head_for
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.drafters.eagle3 import Eagle3Drafter
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.engine.factory import make_drafter

K, MAX_LEN = 5, 2048  # gpu_throughput.run's K and max_model_len


def drafter_for(mode: str, target, head, graphs: bool, num_seqs: int = 1):
    """None (AR), the SD-EAGLE-3 drafter, or the SSD-EAGLE-3 drafter with its speculator in its own process (on the
    second GPU when there is one: NCCL; else on the first: gloo)."""
    if mode == "ar":
        return None
    if mode == "sd":
        return Eagle3Drafter(head, num_seqs, MAX_LEN + 16)
    draft_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    spec = SpeculativeConfig(method="eagle3", model="in-memory", num_speculative_tokens=K, fanout=[2],
                             speculator="process")
    cfg = EngineConfig(model="in-memory", mode="ssd", device="cuda:0", draft_device=draft_device,
                       max_num_seqs=num_seqs, max_model_len=MAX_LEN, eager=not graphs, speculative_config=spec)
    return make_drafter(cfg, target, MAX_LEN, draft=head)


def models(layers: int, dtype: torch.dtype):
    torch.manual_seed(0)
    target = smollm2_shaped(layers, torch.device("cuda:0"), dtype)
    head = eagle3_head_for(target, draft_vocab=32000).to("cuda:0", dtype)
    return target, head


def greedy(target, head, mode: str, graphs: bool, prompts, tokens: int) -> list[list[int]]:
    """Greedy outputs; raises when the drafter failed (the engine would fall back to AR and hide it)."""
    drafter = drafter_for(mode, target, head, graphs, len(prompts))
    try:
        engine = LLMEngine(target, _Tokenizer(), drafter, num_speculative_tokens=K, max_num_seqs=len(prompts),
                           max_model_len=MAX_LEN, eos_token_ids=set(), cuda_graphs=graphs)
        outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens))
        if drafter is not None and not drafter.healthy:
            raise SystemExit(f"the {mode} drafter failed: {getattr(drafter, 'error', '?')}")
        return [o.token_ids for o in outs]
    finally:
        if hasattr(drafter, "close"):
            drafter.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per speed run")
    ap.add_argument("--layers", type=int, default=30, help="target layers of the speed rows (SmolLM2-135M: 30)")
    args = ap.parse_args()
    n_gpus = torch.cuda.device_count()
    print(f"{torch.cuda.get_device_name()} x{n_gpus}: SSD transport {'nccl' if n_gpus > 1 else 'gloo'}", flush=True)

    target, head = models(args.layers, torch.bfloat16)
    rows = {}
    for mode in ("ar", "sd", "ssd"):
        for graphs in (False, True):
            drafter = drafter_for(mode, target, head, graphs)
            try:
                rows[(mode, graphs)] = run(target, drafter, args.tokens, graphs)
                if drafter is not None and not drafter.healthy:
                    raise SystemExit(f"the {mode} drafter failed: {getattr(drafter, 'error', '?')}")
            finally:
                if hasattr(drafter, "close"):
                    drafter.close()
            print(f"  {mode} {'graphs' if graphs else 'eager'} done", flush=True)
    print(f"{'configuration':16s} {'eager tok/s':>12s} {'graphs tok/s':>13s} {'ratio':>6s}   (bfloat16, batch 1)")
    for mode, name in (("ar", "AR"), ("sd", "SD-EAGLE-3"), ("ssd", "SSD-EAGLE-3")):
        eager, graphed = rows[(mode, False)][0], rows[(mode, True)][0]
        print(f"{name:16s} {eager:12.1f} {graphed:13.1f} {graphed / eager:5.2f}x")

    del target, head
    target, head = models(4, torch.float64)
    prompts = [list(range(100, 140)), list(range(500, 517)) * 2, [7, 7, 1, 2, 3, 9] * 5]
    reference = greedy(target, head, "ar", False, prompts, 24)
    failures = []
    for mode in ("ar", "sd", "ssd"):
        for graphs in (False, True):
            same = greedy(target, head, mode, graphs, prompts, 24) == reference
            print(f"greedy {mode} {'graphs' if graphs else 'eager'} == AR: {same}", flush=True)
            if not same:
                failures.append((mode, graphs))
    if failures:
        raise SystemExit(f"greedy output differs from AR in {failures}")


if __name__ == "__main__":
    main()
