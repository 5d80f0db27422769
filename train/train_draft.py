"""Train a draft for the target with DeepSpeed: an EAGLE-3 head (training-time test) or a small draft LM (KL).

    deepspeed --num_gpus 1 train/train_draft.py --config configs/smollm2-135m-eagle3.yaml [--key value ...]

Runs unchanged on CPUs (gloo) and GPUs (nccl); plain ``python train/train_draft.py ...`` trains one process. The
target is frozen and only runs forward, through :class:`~ssd_eagle.model_runner.ModelRunner` (online mode) or once
beforehand (offline mode, ``train/precompute_features.py``); each rank reads its shard of the data
(:mod:`train.feature_source`). Checkpoints (``train/checkpoint.py``) are written every ``save_every`` optimizer
steps and at the end; a run resumes from the latest, with the draft vocabulary read from the checkpoint (never
recounted).

What the config needs and lacks (offline features, the held-out set) is built first (:mod:`train.prepare`).
Precision: ``dtype: float32``; ``dtype: bfloat16`` (or ``auto`` where bf16 is native), DeepSpeed's bf16 section
with float32 master weights and optimizer state (the faster bf16 path on CPUs); or float32 weights with bf16
matmuls under ``torch.autocast`` (``autocast``).

Logged (tqdm bar, ``<output_dir>/metrics.jsonl`` and the ``report_to`` trackers, rank 0; :mod:`train.tracking`):
loss, per-TTT-step soft cross-entropy and top-1 accuracy against the target's argmax, learning rate, gradient norm,
tokens/s, and every ``eval_every`` steps the held-out tau. The held-out tau is a teacher-forced simulation of
greedy chain drafting (K = ``EVAL_NUM_DRAFT`` drafts a round) on held-out text the target generated itself (``heldout_data``): for greedy decoding of that text
it equals what the engine would measure (see :func:`train.ttt.simulate_acceptance`), without running the engine.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

if __package__ in (None, ""):  # launched as a script (deepspeed train/train_draft.py): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from train import checkpoint as ckpt
from train.config import TrainConfig, deepspeed_config, parse_args, save_config, zero_stage
from train.distributed import accelerator_device, all_reduce, init_distributed
from train.feature_source import load_feature_source
from train.prepare import ensure_features, ensure_heldout
from train.schedule import epoch_batches, lr_lambda
from train.tracking import MetricsWindow, Tracker
from train.ttt import (
    AcceptanceStats,
    SaguaroObjective,
    draft_lm_hits,
    draft_targets,
    eagle3_hits,
    simulate_acceptance,
    ttt_loss,
)

EVAL_NUM_DRAFT = 7  # drafts per round in the held-out chain simulation (the engines' usual K)


# ----------------------------------------------------------------------------------------------------------------
# trainable wrappers (what DeepSpeed owns)

class Eagle3Trainable(nn.Module):
    """The EAGLE-3 head plus its TTT loss; ``forward`` returns a :class:`train.ttt.TTTOutput`."""

    def __init__(self, head, num_steps: int, decay: float, saguaro: SaguaroObjective | None = None):
        super().__init__()
        self.head = head
        self.num_steps = num_steps
        self.decay = decay
        self.saguaro = saguaro

    def forward(self, input_ids, loss_mask, aux_hidden, targets, num_steps: int | None = None):
        return ttt_loss(self.head, input_ids, loss_mask, aux_hidden, targets, num_steps or self.num_steps,
                        self.decay, self.saguaro)


class DraftLMTrainable(nn.Module):
    """The draft LM's trained body plus its KL loss; ``forward`` returns ``(loss, argmax [B, n], valid [B, n])``."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, inputs_embeds, target_hidden, loss_mask, lm_head_weight):
        from train.draft_lm import kl_loss
        hidden = self.body(inputs_embeds.to(self.body.model.norm.weight.dtype))
        with torch.autocast(hidden.device.type, enabled=False):  # the fused KL keeps float32 for its backward
            return kl_loss(hidden, target_hidden, lm_head_weight, loss_mask)


# ----------------------------------------------------------------------------------------------------------------
# trainer

class Trainer:
    """One training run (see the module docstring). Construct on every rank after :func:`init_distributed`.

    Raises:
        ValueError: data/config problems (no data, features made for other aux ids or another target, a checkpoint
            of another kind or geometry than the config asks for).
    """

    def __init__(self, cfg: TrainConfig):
        import deepspeed

        from ssd_eagle.assets import load_model

        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = accelerator_device()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / ckpt.CHECKPOINTS
        if self.rank == 0:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
        self.dtype = getattr(torch, cfg.dtype)
        from ssd_eagle.platform import resolve_dtype
        amp = resolve_dtype(cfg.autocast, self.device) if cfg.autocast else torch.float32
        self.autocast_dtype = amp if amp != torch.float32 else None  # "auto" on a CPU without native bf16: off

        shown = cfg.progress and self.rank == 0  # transformers' "Loading weights" bar follows ours
        self.target, self.tokenizer = load_model(cfg.target, dtype=torch.float32, device=self.device, progress=shown)
        self.target.requires_grad_(False)
        self.target_embed = self.target.get_input_embeddings()
        self.lm_head_weight = self.target.get_output_embeddings().weight.detach()
        # the features come from the target in the serving dtype (cfg.target_dtype); the float32 copy above keeps the
        # embeddings, the soft labels' lm_head and the draft LM's initial layers exact
        self._feature_model = self.target if cfg.target_dtype == "float32" else None
        num_layers = self.target.config.get_text_config().num_hidden_layers

        self.resume_dir = ckpt.latest_checkpoint(self.ckpt_root) if cfg.resume else None
        self.snapshot = ckpt.read_draft_config(self.resume_dir) if self.resume_dir else None
        if self.snapshot and self.snapshot["kind"] != cfg.draft:
            raise ValueError(f"{self.resume_dir} holds a {self.snapshot['kind']} draft, the config trains "
                             f"{cfg.draft}; use another output_dir or resume=false")

        from ssd_eagle.model_runner import default_aux_layer_ids
        self.aux_layer_ids = None
        if cfg.draft == "eagle3":
            self.aux_layer_ids = tuple(cfg.aux_layer_ids) if cfg.aux_layer_ids else default_aux_layer_ids(num_layers)
            if self.snapshot:
                saved = tuple(self.snapshot["config"]["aux_layer_ids"])
                if saved != self.aux_layer_ids:
                    raise ValueError(f"checkpoint aux_layer_ids {saved} != config {self.aux_layer_ids}")

        text_config = self.target.config.get_text_config()
        ensure_features(cfg, text_config, self.feature_target, self.tokenizer, self.rank, self.world)
        ensure_heldout(cfg, self.rank)
        self.data = load_feature_source(cfg, text_config, self.feature_target, self.tokenizer, self.aux_layer_ids,
                                        self.rank, self.world, self.device)
        if self.data.extractor is None:  # offline: no target forward from here on (the float32 copy stays)
            self._feature_model = None
        self.module = self._build_draft()
        self._plan()

        params = [p for p in self.module.parameters() if p.requires_grad]
        # fused: one kernel over each parameter instead of ~8 elementwise passes (CPU and CUDA, torch >= 2.4); the
        # 9.8 M-parameter SmolLM2 head's AdamW step 54 -> 6 ms on one Zen 5 core (float32)
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      weight_decay=cfg.weight_decay, fused=self.device.type in ("cpu", "cuda"))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio))
        self.ds_config = deepspeed_config(cfg, self.world)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.module, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config)
        self.state = {"step": 0, "micro_step": 0, "tokens": 0, "elapsed_s": 0.0, "last_metrics": None,
                      "last_heldout": None}
        if self.resume_dir is not None:
            self._resume()
            if self.rank == 0:  # a resume is never silent (a rerun with the same output_dir continues it)
                done = self.state["step"] >= self.total_steps
                print(f"resumed {self.resume_dir} at step {self.state['step']} of {self.total_steps}"
                      + (": nothing left to train (raise max_steps/epochs, or resume=false or another output_dir "
                         "to start over)" if done else ""), file=sys.stderr, flush=True)

    # --- setup --------------------------------------------------------------------------------------------
    def feature_target(self) -> nn.Module:
        """The target in ``cfg.target_dtype`` (features to compute, the held-out set, online training): the float32
        copy when that is the dtype, else loaded on first use. Offline on precomputed features without a held-out
        set it is never loaded, and offline it is dropped once the held-out features are made."""
        if self._feature_model is None:
            from ssd_eagle.assets import load_model

            self._feature_model = load_model(self.cfg.target, dtype=getattr(torch, self.cfg.target_dtype),
                                             device=self.device,
                                             progress=self.cfg.progress and self.rank == 0)[0]
            self._feature_model.requires_grad_(False)
        return self._feature_model

    def _build_draft(self) -> nn.Module:
        cfg = self.cfg
        if cfg.draft == "eagle3":
            from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel
            from train.vocab import build_draft_vocab

            if self.snapshot:  # resume: the vocabulary mapping comes from the checkpoint, never recounted
                config = Eagle3Config(**self.snapshot["config"])
                if config.draft_vocab_size != cfg.draft_vocab_size:
                    raise ValueError(f"checkpoint draft_vocab_size {config.draft_vocab_size} != config "
                                     f"{cfg.draft_vocab_size}")
                if config.hidden_size != (cfg.draft_hidden_size or config.target_hidden_size):
                    raise ValueError(f"checkpoint hidden_size {config.hidden_size} != config draft_hidden_size "
                                     f"{cfg.draft_hidden_size}")
                tensors = ckpt.read_draft_tensors(self.resume_dir)
                d2t, t2d = tensors["d2t"], tensors["t2d"]
            elif cfg.init_from:  # warm start: the exported head's geometry, vocabulary and (below) weights
                from ssd_eagle.models.eagle3_formats import load_eagle3

                start = load_eagle3(cfg.init_from, target_config=self.target.config, dtype=torch.float32)
                config = start.config
                widen = cfg.draft_vocab_size > config.draft_vocab_size
                wanted = {"draft_vocab_size": config.draft_vocab_size if widen else cfg.draft_vocab_size,
                          "aux_layer_ids": tuple(self.aux_layer_ids),
                          "hidden_size": cfg.draft_hidden_size or config.target_hidden_size}
                for name, value in wanted.items():
                    got = getattr(config, name)
                    if (tuple(got) if name == "aux_layer_ids" else got) != value:
                        raise ValueError(f"init_from {cfg.init_from}: {name} {got} != the config's {value}")
                d2t, t2d = start.d2t, start.t2d
                if widen:  # a larger draft vocabulary: the export's tokens plus this data's most frequent others
                    counts = self._token_counts()
                    d2t, t2d = build_draft_vocab(counts, cfg.draft_vocab_size, keep=start.draft_target_ids)
                    config = replace(config, draft_vocab_size=cfg.draft_vocab_size)
                    self.vocab_coverage = float(counts[t2d].sum() / counts.sum().clamp_min(1))
            else:
                counts = self._token_counts()
                d2t, t2d = build_draft_vocab(counts, cfg.draft_vocab_size)
                width = {"hidden_size": cfg.draft_hidden_size} if cfg.draft_hidden_size else {}
                config = Eagle3Config.from_target(self.target.config, cfg.draft_vocab_size, self.aux_layer_ids,
                                                  torch_dtype=cfg.dtype, **width)
                self.vocab_coverage = float(counts[t2d].sum() / counts.sum().clamp_min(1))
            saguaro = None
            if cfg.saguaro_c is not None:  # the exported head records the (C, F) it was trained for
                saguaro = SaguaroObjective(cfg.saguaro_c, cfg.saguaro_fanout, cfg.saguaro_weight,
                                           cfg.saguaro_temperature)
                config.saguaro_c, config.saguaro_fanout = cfg.saguaro_c, cfg.saguaro_fanout
            config.validate_against_target(self.target.config)
            head = Eagle3DraftModel(config, attn_implementation=cfg.attn_implementation).to(self.dtype)
            head.set_vocab_mapping(d2t, t2d)
            head.set_embeddings(self.target_embed)  # a head of another width keeps its own table
            if self.snapshot:
                pass  # a resume's weights (and a narrow head's table) come with its checkpoint
            elif cfg.init_from and widen:  # widened vocabulary: new rows start at zero
                output = ("lm_head.weight", "d2t", "t2d")
                result = head.load_state_dict({k: v for k, v in start.state_dict().items() if k not in output},
                                              strict=False)
                if result.unexpected_keys or set(result.missing_keys) - set(output):
                    raise ValueError(f"init_from {cfg.init_from}: state dict does not match the head: {result}")
                head.init_output_from_head(start)
            elif cfg.init_from:
                head.load_state_dict(start.state_dict())  # the export's table too: no projection to redo
            else:
                if config.owns_embeddings:
                    head.project_target_embeddings(self.target_embed.weight)
                if cfg.head_init == "target":
                    head.init_output_from_target(self.lm_head_weight, self.target.get_decoder().norm.weight)
            head.to(self.device)
            self.head = head
            return Eagle3Trainable(head, cfg.ttt_steps, cfg.ttt_decay, saguaro)
        from train.draft_lm import DraftLMBody

        if self.snapshot and self.snapshot["config"]["num_hidden_layers"] != cfg.draft_lm_layers:
            raise ValueError(f"checkpoint has {self.snapshot['config']['num_hidden_layers']} layers, config "
                             f"draft_lm_layers={cfg.draft_lm_layers}")
        body = DraftLMBody.from_target(self.target, cfg.draft_lm_layers, self.dtype).to(self.device)
        if cfg.init_from and not self.snapshot:  # warm start: the export's layers, norm and draft vocabulary
            from ssd_eagle.models.draft_lm import DRAFT_VOCAB_KEY, draft_vocab_ids, load_draft_lm

            start = load_draft_lm(cfg.init_from, self.target, dtype=self.dtype)
            if start.config.num_hidden_layers != cfg.draft_lm_layers:
                raise ValueError(f"init_from {cfg.init_from}: num_hidden_layers {start.config.num_hidden_layers} != "
                                 f"the config's draft_lm_layers {cfg.draft_lm_layers}")
            trained = {k: v for k, v in start.model.state_dict().items() if k != "embed_tokens.weight"}
            body.model.load_state_dict(trained)
            ids = draft_vocab_ids(start.config)  # the vocabulary its output rows were trained over
            body.config.ssd_eagle = None if ids is None else {DRAFT_VOCAB_KEY: ids.tolist()}
        else:
            body.config.ssd_eagle = self._draft_lm_vocab()
        self.body = body
        return DraftLMTrainable(body)

    def _token_counts(self) -> torch.Tensor:
        """int64 [V]: how often each target token is a loss-masked (assistant) token of the training data, summed over
        the ranks (each counts its shard, so every rank chooses the same vocabulary); rank 0 writes them to
        ``token_counts.json``."""
        from train.vocab import count_token_frequencies, save_token_counts

        cfg, vocab_size = self.cfg, self.target.config.get_text_config().vocab_size
        counts = count_token_frequencies(self.data.token_rows(), vocab_size, progress=False)
        counts = all_reduce(counts.double()).long()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            save_token_counts(self.out / "token_counts.json", counts,
                              {"target": cfg.target, "data": str(self.data.stats.get("source")),
                               "max_length": cfg.max_length})
        return counts

    def _draft_lm_vocab(self) -> dict | None:
        """The draft LM's ``ssd_eagle`` config record: the ``draft_vocab_size`` most frequent loss-masked tokens
        (ascending ids) it will draft over (:class:`~ssd_eagle.drafters.backends.DraftLMBackend`), or None when that
        is the whole vocabulary. A resume keeps its checkpoint's; a new run counts its data (as an EAGLE-3 head's
        vocabulary is chosen) and writes ``token_counts.json``."""
        from train.vocab import most_frequent_ids

        if self.snapshot:
            return self.snapshot["config"].get("ssd_eagle")
        if self.cfg.draft_vocab_size >= self.target.config.get_text_config().vocab_size:
            return None
        counts = self._token_counts()
        ids = most_frequent_ids(counts, self.cfg.draft_vocab_size).sort().values
        self.vocab_coverage = float(counts[ids].sum() / counts.sum().clamp_min(1))
        return {"draft_vocab": ids.tolist()}

    def _plan(self) -> None:
        cfg = self.cfg
        per_epoch = len(epoch_batches(self.data.lengths, cfg.micro_batch_size, cfg.seed, 0))
        per_epoch = int(all_reduce([per_epoch], dist.ReduceOp.MIN)[0])  # every rank runs the same steps
        if per_epoch == 0:
            raise ValueError(f"fewer samples per rank than micro_batch_size={cfg.micro_batch_size}")
        self.batches_per_epoch = per_epoch
        if cfg.max_steps is not None:
            self.total_steps = cfg.max_steps
        else:
            self.total_steps = max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))
        self.total_micro = self.total_steps * cfg.grad_accum
        self._epoch_cache: dict[int, list[list[int]]] = {}

    def _resume(self) -> None:
        d = self.resume_dir
        saved = json.loads((d / ckpt.TRAINER_STATE).read_text()).get("zero_stage")
        if saved is not None and saved != zero_stage(self.ds_config):  # DeepSpeed's partitions differ per stage
            raise ValueError(f"{d} was written with ZeRO stage {saved}, deepspeed_config {self.cfg.deepspeed_config} "
                             f"is stage {zero_stage(self.ds_config)}: resume with a stage-{saved} config (or "
                             "resume=false / another output_dir)")
        _, client = self.engine.load_checkpoint(str(self.ckpt_root), tag=d.name)
        if client is None:
            raise ValueError(f"DeepSpeed could not load {d}")
        self.state.update(json.loads((d / ckpt.TRAINER_STATE).read_text()))
        if self.cfg.draft == "eagle3":
            saved = ckpt.read_draft_tensors(d)
            if not (torch.equal(self.head.d2t.cpu(), saved["d2t"]) and torch.equal(self.head.t2d.cpu(), saved["t2d"])):
                raise ValueError(f"{d}: the resumed head's vocabulary mapping differs from the checkpoint's")

    # --- batches and features -----------------------------------------------------------------------------
    def _micro_batch(self, micro_step: int) -> list[dict]:
        epoch, i = divmod(micro_step, self.batches_per_epoch)
        if epoch not in self._epoch_cache:
            self._epoch_cache = {epoch: epoch_batches(self.data.lengths, self.cfg.micro_batch_size, self.cfg.seed,
                                                      epoch)[: self.batches_per_epoch]}
        return [self.data.get_sample(j) for j in self._epoch_cache[epoch][i]]

    def _forward(self, batch, num_steps: int | None = None):
        """Run the engine on a :class:`~train.features.TargetBatch`. Returns ``(loss, step_loss [K], step_correct
        [K], step_count [K], hits [B, n, K], step_nonstall [K] or None)`` (summed P_ns of the Saguaro-aware
        objective)."""
        autocast = torch.autocast(self.device.type, self.autocast_dtype or torch.float32,
                                  enabled=self.autocast_dtype is not None)
        if self.cfg.draft == "eagle3":
            targets = draft_targets(batch.last_hidden, self.lm_head_weight, self.head.draft_target_ids,
                                    self.head.t2d, argmax=batch.argmax)
            with autocast:
                out = self.engine(batch.input_ids, batch.loss_mask, batch.aux_hidden.to(self.dtype), targets,
                                  num_steps)
            hits = eagle3_hits(out.draft_argmax, self.head.draft_target_ids, batch.input_ids)
            return out.loss, out.step_loss, out.step_correct, out.step_count, hits, out.step_nonstall
        embeds = self.target_embed(batch.input_ids).detach()
        with autocast:
            loss, argmax, valid = self.engine(embeds, batch.last_hidden, batch.loss_mask, self.lm_head_weight)
        correct = ((argmax == batch.argmax) & valid).sum().float()
        hits = draft_lm_hits(argmax, batch.input_ids, num_steps or EVAL_NUM_DRAFT)
        return loss, loss.detach()[None], correct[None], valid.sum().float()[None], hits, None

    # --- evaluation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_heldout(self) -> dict | None:
        """Teacher-forced tau on the held-out set (all ranks take part; samples are split between them)."""
        if not self.data.heldout:
            return None
        self.engine.eval()
        k = EVAL_NUM_DRAFT
        per_rank = math.ceil(len(self.data.heldout) / self.world)
        stats = AcceptanceStats(accepted_hist=[0] * (k + 1))
        correct = torch.zeros(k if self.cfg.draft == "eagle3" else 1, dtype=torch.float64)
        count = torch.zeros_like(correct)
        for j in range(per_rank):  # equal forward counts on every rank (ZeRO-3 gathers inside forwards)
            idx = self.rank * per_rank + j
            real = idx < len(self.data.heldout)
            batch = self.data.heldout[min(idx, len(self.data.heldout) - 1)]["batch"]
            _, _, c, n, hits, _ = self._forward(batch, num_steps=k)
            if real:
                stats.merge(simulate_acceptance(hits[0], batch.loss_mask[0], k))
                correct += c.double().cpu()
                count += n.double().cpu()
        self.engine.train()
        totals = all_reduce([stats.rounds, stats.emitted, *stats.accepted_hist, *correct.tolist(), *count.tolist()])
        rounds, emitted = totals[0].item(), totals[1].item()
        m = correct.numel()
        acc = (totals[3 + k:3 + k + m] / totals[3 + k + m:].clamp_min(1)).tolist()
        return {"heldout_tau": emitted / rounds if rounds else math.nan, "heldout_rounds": int(rounds),
                "heldout_accepted_hist": [int(x) for x in totals[2:3 + k].tolist()], "heldout_acc": acc,
                "heldout_num_draft": k}

    # --- checkpoints --------------------------------------------------------------------------------------
    def gathered_draft_state(self) -> dict[str, torch.Tensor]:
        """The draft's full trained tensors (gathered from ZeRO-3 partitions; every rank must call). Rank 0
        gets the tensors, other ranks an empty dict."""
        import deepspeed

        inner = self.engine.module
        with deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=None):
            if self.rank != 0:
                return {}
            if self.cfg.draft == "eagle3":
                return {k: v.detach().to("cpu").clone() for k, v in self.head.state_dict().items()}
            return {k: v.detach().to("cpu").clone() for k, v in self.body.trained_state_dict().items()}

    def draft_config_dict(self) -> dict:
        if self.cfg.draft == "eagle3":
            d = asdict(self.head.config)
            d["aux_layer_ids"] = list(d["aux_layer_ids"])
            return d
        return self.body.config.to_dict()

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step on every rank and commit it atomically (rank 0)."""
        tag = ckpt.step_tag(self.state["step"])
        tmp_tag = ckpt.TMP_PREFIX + tag
        self.engine.save_checkpoint(str(self.ckpt_root), tag=tmp_tag, client_state={"trainer": self.state},
                                    save_latest=False)
        tensors = self.gathered_draft_state()
        path = None
        if self.rank == 0:
            step_dir = self.ckpt_root / tmp_tag
            extra = {"target": self.cfg.target, "aux_layer_ids_convention": "input_of_layer"}
            ckpt.write_draft_snapshot(step_dir, self.cfg.draft, self.draft_config_dict(), tensors, extra)
            state = dict(self.state, data=self.data.stats, world_size=self.world,
                         zero_stage=zero_stage(self.ds_config), total_steps=self.total_steps,
                         vocab_coverage=getattr(self, "vocab_coverage", self.state.get("vocab_coverage")))
            (step_dir / ckpt.TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
            save_config(self.cfg, step_dir / ckpt.TRAIN_CONFIG)
            path = ckpt.commit_checkpoint(self.ckpt_root, tmp_tag, tag, self.cfg.keep_checkpoints)
        dist.barrier()
        return path

    # --- training loop ------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to ``total_steps``; returns the last logged metrics (with the held-out estimate when enabled)."""
        cfg = self.cfg
        if "vocab_coverage" not in self.state:
            self.state["vocab_coverage"] = getattr(self, "vocab_coverage", None)
        tracker = Tracker(self.out, cfg.report_to, cfg.to_dict(), self.rank, self.state["step"])
        bar = tqdm(total=self.total_steps, initial=self.state["step"], desc=f"train {cfg.draft}",
                   disable=not (cfg.progress and self.rank == 0), dynamic_ncols=True)
        window = MetricsWindow(cfg.ttt_steps if cfg.draft == "eagle3" else 1)
        start_elapsed, t_start = self.state["elapsed_s"], time.perf_counter()
        metrics = self.state.get("last_metrics") or {}
        self.engine.train()
        while self.state["micro_step"] < self.total_micro:
            t0 = time.perf_counter()
            samples = self._micro_batch(self.state["micro_step"])
            batch = self.data.features(samples)
            loss, step_loss, correct, count, _, nonstall = self._forward(batch)
            self.engine.backward(loss)
            self.engine.step()
            self.state["micro_step"] += 1
            window.add(loss, step_loss, correct, count, nonstall, batch.num_tokens, time.perf_counter() - t0)
            if self.state["micro_step"] % cfg.grad_accum:
                continue
            self.state["step"] += 1
            step = self.state["step"]
            bar.update(1)
            last = step == self.total_steps
            if step % cfg.log_every == 0 or last:
                reduced = window.reduce(with_nonstall=cfg.saguaro_c is not None)
                self.state["tokens"] += reduced.pop("num_tokens")
                grad_norm = self.engine.get_global_grad_norm()
                metrics = {
                    "step": step, "epoch": round(self.state["micro_step"] / self.batches_per_epoch, 4), **reduced,
                    "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "tokens": self.state["tokens"],  # tokens_per_s: over compute time (not data or checkpoints)
                    "elapsed_s": start_elapsed + time.perf_counter() - t_start,
                }
                tracker.log(metrics)
                self.state["last_metrics"] = metrics
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['step_acc'][0]:.3f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
            if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                held = self.evaluate_heldout()
                if held is not None:
                    held["step"] = step
                    tracker.log(held)
                    self.state["last_heldout"] = held
                    bar.set_postfix(loss=f"{metrics.get('loss', math.nan):.3f}", tau=f"{held['heldout_tau']:.2f}")
            self.state["elapsed_s"] = start_elapsed + time.perf_counter() - t_start
            if step % cfg.save_every == 0 or last:
                self.save_checkpoint()
        bar.close()
        tracker.close()
        return dict(metrics, **(self.state.get("last_heldout") or {}))


def main(argv: list[str] | None = None) -> dict:
    """Parse ``--config`` and overrides, initialise distributed training, train."""
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    init_distributed()
    trainer = Trainer(cfg)
    result = trainer.train()
    if trainer.rank == 0 and "tokens_per_s" in result:  # the run's figure of merit, on one line
        precision = f"autocast {trainer.autocast_dtype}" if trainer.autocast_dtype else cfg.dtype
        tau = f", held-out tau {result['heldout_tau']:.3f}" if "heldout_tau" in result else ""
        print(f"step {result['step']}: loss {result['loss']:.4f}, {result['tokens_per_s']:.0f} tokens/s "
              f"({precision}, {trainer.world} rank(s), last log window){tau}")
    return result


if __name__ == "__main__":
    main()
