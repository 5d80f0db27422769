"""SSD-EAGLE-3 end to end on one GPU (two processes, gloo) or two (NCCL): eager vs CUDA-graph tokens/s for AR,
SD-EAGLE-3 and SSD-EAGLE-3, and greedy output equal to AR. Run by ``scripts/gpu_check.sh``.

Random models of SmolLM2-135M's shape (no model files; :func:`gpu_throughput.smollm2_shaped`) with a random
EAGLE-3 head: acceptance is meaningless, the figures are per-round costs. The speed rows run in bfloat16, batch 1;
the equality check runs in float64 (a bf16 random model has near-ties that any change of kernel shape can flip).
"graphs" is the default path (CUDA graphs of the verification and of the draft's fixed-shape steps), "eager" is
``--eager`` (every forward dynamic). Every row runs even when an earlier one fails; the exit status is 1 when any
row failed or any greedy output differs from AR. ``--device cpu`` runs the same rows on CPU without graphs (the
plumbing check of ``DEVICE=cpu bash scripts/gpu_check.sh``).

    PYTHONPATH=.:tests:scripts python tests/gpu/e2e.py --tokens 128
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from gpu_throughput import _Tokenizer, run, smollm2_shaped
from helpers import eagle3_head_for
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.drafters.eagle3 import Eagle3Drafter
from ssd_eagle.engine.factory import make_drafter
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.sampling_params import SamplingParams

K, MAX_LEN = 5, 2048  # gpu_throughput.run's K and max_model_len
MODES = (("ar", "AR"), ("sd", "SD-EAGLE-3"), ("ssd", "SSD-EAGLE-3"))


def drafter_for(mode: str, target, head, graphs: bool, device: str, num_seqs: int = 1):
    """None (AR), the SD-EAGLE-3 drafter, or the SSD-EAGLE-3 drafter with its speculator in its own process (on the
    second GPU when there is one: NCCL; else on the same device: gloo)."""
    if mode == "ar":
        return None
    if mode == "sd":
        return Eagle3Drafter(head, num_seqs, MAX_LEN + 16)
    draft_device = "cuda:1" if device.startswith("cuda") and torch.cuda.device_count() > 1 else device
    spec = SpeculativeConfig(method="eagle3", model="in-memory", num_speculative_tokens=K, fanout=[2],
                             speculator="process", speculator_timeout=60.0)
    cfg = EngineConfig(model="in-memory", mode="ssd", device=device, draft_device=draft_device,
                       max_num_seqs=num_seqs, max_model_len=MAX_LEN, eager=not graphs, speculative_config=spec)
    return make_drafter(cfg, target, MAX_LEN, draft=head)


def models(layers: int, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    target = smollm2_shaped(layers, torch.device(device), dtype)
    head = eagle3_head_for(target, draft_vocab=32000).to(device, dtype)
    return target, head


def checked(drafter, mode: str, fn):
    """``fn()``, raising when the drafter failed (the engine would fall back to AR and hide it); closes it."""
    try:
        out = fn()
        if drafter is not None and not drafter.healthy:
            raise RuntimeError(f"the {mode} drafter failed: {getattr(drafter, 'error', '?')}")
        return out
    finally:
        if hasattr(drafter, "close"):
            drafter.close()


def greedy(target, head, mode: str, graphs: bool, device: str, prompts, tokens: int) -> list[list[int]]:
    drafter = drafter_for(mode, target, head, graphs, device, len(prompts))

    def generate():
        engine = LLMEngine(target, _Tokenizer(), drafter, num_speculative_tokens=K, max_num_seqs=len(prompts),
                           max_model_len=MAX_LEN, eos_token_ids=set(), cuda_graphs=graphs)
        outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens))
        return [o.token_ids for o in outs]
    return checked(drafter, mode, generate)


def attempt(label: str, failures: list[str], fn):
    """``fn()`` or None; a failure is printed with its traceback and recorded, and the next row still runs."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - one broken row must not hide the others
        traceback.print_exc()
        failures.append(f"{label}: {type(err).__name__}: {err}")
        print(f"FAIL {label}: {type(err).__name__}: {err}", flush=True)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per speed run")
    ap.add_argument("--layers", type=int, default=30, help="target layers of the speed rows (SmolLM2-135M: 30)")
    ap.add_argument("--greedy-tokens", type=int, default=24)
    ap.add_argument("--greedy-layers", type=int, default=4)
    args = ap.parse_args()
    device = args.device
    if device.startswith("cuda"):
        n_gpus = torch.cuda.device_count()
        print(f"{torch.cuda.get_device_name()} x{n_gpus}: SSD link {'nccl' if n_gpus > 1 else 'gloo'}", flush=True)
    failures: list[str] = []

    target, head = models(args.layers, torch.bfloat16, device)
    rows = {}
    for mode, _ in MODES:
        for graphs in (False, True):
            label = f"speed {mode} {'graphs' if graphs else 'eager'}"
            drafter = attempt(label, failures, lambda: drafter_for(mode, target, head, graphs, device))
            if drafter is None and mode != "ar":
                continue
            rate = attempt(label, failures, lambda: checked(drafter, mode, lambda: run(target, drafter, args.tokens,
                                                                                        graphs)))
            if rate is not None:
                rows[(mode, graphs)] = rate[0]
                print(f"  {label}: {rate[0]:.1f} tok/s", flush=True)
    print(f"\n{'configuration':16s} {'eager tok/s':>12s} {'graphs tok/s':>13s} {'ratio':>6s}   "
          f"(bfloat16, batch 1, {args.layers} layers, {device})")
    for mode, name in MODES:
        eager, graphed = rows.get((mode, False)), rows.get((mode, True))
        cells = [f"{v:12.1f}" if v else f"{'FAILED':>12s}" for v in (eager, graphed)]
        ratio = f"{graphed / eager:5.2f}x" if eager and graphed else "    -"
        print(f"{name:16s} {cells[0]} {cells[1]:>13s} {ratio}", flush=True)
    print()

    del target, head
    target, head = models(args.greedy_layers, torch.float64, device)
    prompts = [list(range(100, 140)), list(range(500, 517)) * 2, [7, 7, 1, 2, 3, 9] * 5]
    reference = attempt("greedy ar eager (reference)", failures,
                        lambda: greedy(target, head, "ar", False, device, prompts, args.greedy_tokens))
    for mode, _ in MODES:
        for graphs in (False, True):
            label = f"greedy {mode} {'graphs' if graphs else 'eager'}"
            got = attempt(label, failures, lambda: greedy(target, head, mode, graphs, device, prompts,
                                                          args.greedy_tokens))
            if got is not None and reference is not None:
                print(f"{'PASS' if got == reference else 'FAIL'} {label} == AR", flush=True)
                if got != reference:
                    failures.append(f"{label}: greedy output differs from AR")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures), flush=True)
        sys.exit(1)
    print("e2e: all rows ran; greedy output equals AR everywhere", flush=True)


if __name__ == "__main__":
    main()
