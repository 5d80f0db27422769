"""The draft loop in fixed shapes vs dynamic shapes on CPU, side by side in one run (issue 16).

Fixed shapes (:meth:`~ssd_eagle.drafters.backends.DraftBackend.use_fixed_shapes`, what CUDA graphs replay) pad
rows and the attended cache length to fixed sets; on CPU that padding is real work with nothing to gain, so this
measures what the path costs there with the CPU's sets (``fixed``: every row count, cache lengths in steps of 16)
and, for comparison, with the sets CUDA captures (``captured``: rows and cache lengths in powers of two), both
against the dynamic path, on the shipped SmolLM2 drafts (EAGLE-3 head and draft LM) over a cached context of
``--context`` tokens. The draft work of one round each:

- ``sd chain``: an SD chain (one ``extend`` over 3 committed tokens, then K - 1 one-token feeds), batch 1 and 3;
- ``sd tree``: an SD dynamic tree (budget 16, top-4, depth K), batch 1;
- ``ssd branches``: the speculator's branch drafting, K tree-masked forwards over 24 branches of one sequence.

Times are thread CPU time (``time.thread_time``, far steadier than wall time on a shared machine), median over
``--repeats`` rounds in rotating order; ratios are to the dynamic path. Pinned to one core, one thread.

    python scripts/bench_draft_shapes.py --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ssd_eagle.assets import DEFAULT_MODEL, load_model
from ssd_eagle.cuda_graphs import shape_sets
from ssd_eagle.drafters.backends import DRAFT_MAX_ROWS, DraftLMBackend, Eagle3Backend
from ssd_eagle.drafters.neural import draft_from_committed
from ssd_eagle.drafters.tree import TreeSettings
from ssd_eagle.models.draft_lm import load_draft_model
from ssd_eagle.models.eagle3_formats import load_eagle3
from ssd_eagle.platform import describe_line
from ssd_eagle.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
K, BRANCHES, MAX_LEN = 5, 24, 4096


def backends(kind: str, model, slots: int) -> dict:
    """The same draft three times: dynamic, fixed shapes with the CPU's sets, and with the sets CUDA captures."""
    cls = Eagle3Backend if kind == "eagle3" else DraftLMBackend
    out = {"dynamic": cls(model, slots, MAX_LEN, fixed_shapes=False), "fixed": cls(model, slots, MAX_LEN),
           "captured": cls(model, slots, MAX_LEN)}
    out["captured"].use_fixed_shapes(True, *shape_sets(True, DRAFT_MAX_ROWS, out["captured"].kv.max_len))
    return out


def round_fns(b, context: int, dtype: torch.dtype):
    """name -> a callable running one round of draft work on backend ``b`` (its slots prefilled here)."""
    gen = torch.Generator().manual_seed(0)
    H = b.hidden_size
    seqs = []
    for slot in range(3):
        tokens = torch.randint(100, 20000, (context + slot,), generator=gen).tolist()
        aux = torch.randn(len(tokens) - 1, 3 * 576, generator=gen).to(dtype) if H else None
        b.prefill(slot, tokens, aux)
        seqs.append(SimpleNamespace(slot=slot, token_ids=tokens, params=SamplingParams(temperature=0.0),
                                    draft_generator=None))
    pending = [torch.randn(3, H, generator=gen).to(dtype) if H else None for _ in seqs]
    tree = TreeSettings(16, K, 4)

    def sd(rows: int, tree_settings=None):
        return lambda: draft_from_committed(b, seqs[:rows], [len(s.token_ids) - 3 for s in seqs[:rows]],
                                            pending[:rows], [K] * rows, tree=tree_settings)

    def branches():
        start = context + 8 - b.offset
        for index in range(K):
            write = start + index * BRANCHES + torch.arange(BRANCHES)[None, :]
            visible = torch.zeros(1, BRANCHES, int(write.max()) + 1, dtype=torch.bool)
            visible[..., : context - b.offset] = True
            visible.scatter_(2, write[..., None], True)
            b.step([0], torch.randint(100, 20000, (1, BRANCHES), generator=gen), torch.full((1, BRANCHES),
                   context + 4 + index), write, visible, torch.randn(1, BRANCHES, H, generator=gen).to(dtype)
                   if H else None)

    return {"sd chain b1": sd(1), "sd chain b3": sd(3), "sd tree b1": sd(1, tree), "ssd branches": branches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--kinds", default="eagle3,draft_lm")
    ap.add_argument("--context", type=int, default=300, help="cached tokens per sequence")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--core", type=int, default=0)
    args = ap.parse_args()
    os.sched_setaffinity(0, [args.core])
    torch.set_num_threads(1)
    print(f"{'dtype':9s} {'draft':8s} {'round':13s} {'dynamic ms':>10s} {'fixed':>7s} {'captured':>8s}"
          "   (thread CPU ms per round; fixed, captured: ratio to dynamic)")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        print(describe_line("cpu", dtype), flush=True)
        target, _ = load_model(args.model, dtype=dtype)
        for kind in args.kinds.split(","):
            if kind == "eagle3":
                model = load_eagle3(str(ROOT / "drafts/smollm2-135m-eagle3"), target_config=target.config,
                                    dtype=dtype, device=torch.device("cpu"))
                model.set_embeddings(target.get_input_embeddings())
            else:
                model = load_draft_model(str(ROOT / "drafts/smollm2-135m-draftlm"), target).to(dtype)
            fns = {name: round_fns(b, args.context, dtype) for name, b in backends(kind, model, 3).items()}
            paths, ratios = list(fns), {"fixed": [], "captured": []}
            for op in fns["dynamic"]:
                times: dict[str, list[float]] = {p: [] for p in paths}
                with torch.inference_mode():
                    for rep in range(args.repeats + 1):
                        for path in paths[rep % 3:] + paths[: rep % 3]:
                            start = time.thread_time()
                            fns[path][op]()
                            if rep:  # the first round of each is a warm-up
                                times[path].append(time.thread_time() - start)
                med = {p: statistics.median(t) for p, t in times.items()}
                for p in ratios:
                    ratios[p].append(med[p] / med["dynamic"])
                print(f"{dtype_name:9s} {kind:8s} {op:13s} {1e3 * med['dynamic']:10.2f} "
                      f"{ratios['fixed'][-1]:7.3f} {ratios['captured'][-1]:8.3f}", flush=True)
            means = {p: statistics.geometric_mean(r) for p, r in ratios.items()}
            print(f"{dtype_name:9s} {kind:8s} {'geomean':13s} {'':10s} {means['fixed']:7.3f} {means['captured']:8.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
