"""Short GPU throughput comparison on random models of SmolLM2-135M's shape (no model files needed).

Side by side in one run: AR eager vs AR with CUDA graphs, and SD with a 4-layer draft of the same shape (eager vs
graphs), batch 1, greedy, in ``--dtype`` (auto: bfloat16 on CUDA, see :mod:`ssd_eagle.platform`). Random weights
make acceptance meaningless, so the draft is a copy of the target's first layers only to exercise the path; the
figures are per-step costs. ``--device cpu`` runs the same path without graphs (the CPU engine never captures any;
the CI smoke test uses it with ``--layers 2``).

    python scripts/gpu_throughput.py --tokens 128
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ssd_eagle.drafters import DraftModelDrafter
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.platform import DTYPE_HELP, DTYPES, describe_line, resolve_dtype
from ssd_eagle.sampling_params import SamplingParams


class _Tokenizer:  # the engine only needs ids in, text out
    eos_token_id = None
    pad_token_id = None

    def __call__(self, text):
        raise NotImplementedError

    def decode(self, ids, skip_special_tokens=True):
        return ""


def smollm2_shaped(layers: int, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, rope_theta=100000.0)
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model, drafter, tokens: int, graphs: bool) -> tuple[float, float]:
    engine = LLMEngine(model, _Tokenizer(), drafter, num_speculative_tokens=5, max_num_seqs=1, max_model_len=2048,
                       eos_token_ids=set(), cuda_graphs=graphs)
    prompt = list(range(100, 164))
    device = next(model.parameters()).device
    for rep in range(2):  # the first run captures graphs
        engine.add_request(f"r{rep}", prompt, SamplingParams(temperature=0.0, max_tokens=tokens))
        synchronize(device)
        start = time.perf_counter()
        while engine.has_unfinished():
            out = engine.step()
        synchronize(device)
    return tokens / (time.perf_counter() - start), out[-1].stats.tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    ap.add_argument("--layers", type=int, default=30, help="target layers (SmolLM2-135M: 30); the draft has <= 4")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    print(describe_line(device, dtype), flush=True)
    torch.manual_seed(0)
    target = smollm2_shaped(args.layers, device, dtype)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[: min(4, args.layers)]
    draft.config.num_hidden_layers = len(draft.model.layers)
    rows = {}
    for graphs in (False, True):
        rows[f"AR {'graphs' if graphs else 'eager'}"] = run(target, None, args.tokens, graphs)
        rows[f"SD draft-LM {'graphs' if graphs else 'eager'}"] = run(
            target, DraftModelDrafter(draft, 49152, 1, 2048 + 16), args.tokens, graphs)
    print(f"{'configuration':24s} {'tokens/s':>9s} {'tau':>5s}")
    for name, (rate, tau) in rows.items():
        print(f"{name:24s} {rate:9.1f} {tau:5.2f}")
    print(f"graphs / eager (AR): {rows['AR graphs'][0] / rows['AR eager'][0]:.2f}x")


if __name__ == "__main__":
    main()
