"""Tokens/s of one EAGLE-3 training step (TTT forward + backward + AdamW) of a head for the default target, in
float32, under bf16 ``torch.autocast`` (float32 master weights) and with bf16 weights (what DeepSpeed's ``bf16``
section runs; its float32 master copy is emulated here: bf16 gradients copied into float32 parameters for AdamW,
then the weights copied back). The modes alternate step by step in one process, so their ratio holds on a loaded
machine; random target features (the cost does not depend on their values).

    python scripts/bench_train_precision.py [--tokens 256] [--steps 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from ssd_eagle.assets import DEFAULT_MODEL, load_model
from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel, build_vocab_mapping
from ssd_eagle.platform import describe_line
from train.ttt import draft_targets, ttt_loss

MODES = ("float32", "autocast_bf16", "bf16_weights")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=256, help="sequence length of the micro batch (batch 1)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode (after one warm-up)")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, _ = load_model(args.model, dtype=torch.float32)
    tc = target.config.get_text_config()
    lm_w = target.get_output_embeddings().weight.detach()
    n, h = args.tokens, tc.hidden_size
    ids = torch.randint(0, tc.vocab_size, (1, n))
    mask = torch.ones(1, n, dtype=torch.long)
    aux = torch.randn(1, n, 3 * h)
    last = torch.randn(1, n, h)
    heads, opts, masters = {}, {}, {}
    for mode in MODES:
        head = Eagle3DraftModel(Eagle3Config.from_target(tc, args.draft_vocab))
        head.set_vocab_mapping(*build_vocab_mapping(torch.randperm(tc.vocab_size)[:args.draft_vocab],
                                                    tc.vocab_size, args.draft_vocab))
        params = [p for p in head.parameters() if p.requires_grad]
        if mode == "bf16_weights":
            masters[mode] = [p.detach().clone() for p in params]
            head.to(torch.bfloat16)
            params = [p for p in head.parameters() if p.requires_grad]
        head.set_embeddings(target.get_input_embeddings())  # the target's frozen float32 table, as in training
        opts[mode] = torch.optim.AdamW(masters.get(mode, params), lr=1e-4)
        heads[mode] = head
    targets = draft_targets(last, lm_w, heads["float32"].draft_target_ids, heads["float32"].t2d)

    def step(mode: str) -> float:
        head = heads[mode]
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast_bf16"):
            dtype = torch.bfloat16 if mode == "bf16_weights" else torch.float32
            out = ttt_loss(head, ids, mask, aux.to(dtype), targets, args.ttt_steps, 0.8)
        out.loss.backward()
        params = [p for p in head.parameters() if p.requires_grad]
        if mode == "bf16_weights":
            for master, p in zip(masters[mode], params):
                master.grad = p.grad.float()
        opts[mode].step()
        opts[mode].zero_grad(set_to_none=True)
        if mode == "bf16_weights":
            with torch.no_grad():
                for master, p in zip(masters[mode], params):
                    p.copy_(master)
                    p.grad = None
        return time.perf_counter() - t0

    for mode in MODES:  # warm-up
        step(mode)
    times = {mode: [] for mode in MODES}
    for _ in range(args.steps):
        for mode in MODES:
            times[mode].append(step(mode))
    print(describe_line("cpu", torch.float32))
    print(f"EAGLE-3 head of {args.model}: {n} tokens, TTT {args.ttt_steps}, draft vocab {args.draft_vocab}, "
          f"{args.threads} thread(s), median of {args.steps} alternating steps")
    base = sorted(times["float32"])[len(times["float32"]) // 2]
    for mode in MODES:
        med = sorted(times[mode])[len(times[mode]) // 2]
        print(f"{mode:14s} {med * 1e3:8.1f} ms/step {n / med:8.0f} tokens/s  x{base / med:.2f} vs float32")


if __name__ == "__main__":
    main()
