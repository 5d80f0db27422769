"""Export a trained draft from a training checkpoint, optionally pushing it to the Hugging Face hub.

    python -m train.export CKPT OUT [--push-to-hub REPO_ID] [--private] [--speculators] [--dtype bfloat16]
                                    [--compact] [--tau X] [--target NAME]
    python -m train.export --materialize COMPACT_DRAFT_LM OUT [--target NAME]

``CKPT`` is a step directory, a checkpoints root or a run's output directory (its latest checkpoint). The weights
come from the checkpoint's gathered ``draft/model.safetensors`` (full tensors whatever the ZeRO stage), or from
DeepSpeed's ZeRO partitions when that file is absent (:func:`train.checkpoint.read_draft_tensors`).

* EAGLE-3 head -> the ``LlamaForCausalLMEagle3`` folder vLLM and SGLang load (:func:`~ssd_eagle.models.
  eagle3_formats.save_eagle3`: the target's rope settings and max positions, ``tie_word_embeddings: false``, aux
  ids declared input-of-layer), plus the target's tokenizer files and a model card; ``--speculators`` adds the
  vLLM speculators format under ``OUT/speculators/``. A head without ``lm_head.weight`` is refused. A head of
  another width than its target (``hidden_size != target_hidden_size``) is written with its own
  ``embed_tokens.weight`` [vocab, H], which both engines then load instead of sharing the target's.
* Draft LM -> a plain transformers folder (:func:`train.draft_lm.save_draft_lm`), or with ``--compact`` only its
  trained tensors (the embedding is the target's); ``--materialize`` turns a compact folder into a plain one.

No frozen target weight is written for a head (a narrow head's table is its own, not the target's); the draft
LM's plain folder carries the target's embedding table because a plain folder must be complete. ``--push-to-hub``
uses ``huggingface_hub.create_repo`` and ``upload_folder``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from ssd_eagle.io import atomic_write
from train import checkpoint as ckpt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------------------------
# reading checkpoints

def load_eagle3_from_checkpoint(step_dir: str | os.PathLike, target_config=None):
    """The trained :class:`~ssd_eagle.models.eagle3.Eagle3DraftModel` of a checkpoint (float32, eval mode).

    Raises:
        ValueError: not an EAGLE-3 checkpoint; no ``lm_head.weight`` (a head that would borrow the target's output
            layer is refused); missing/unexpected tensors; an inconsistent ``d2t``/``t2d``; a config that does not
            fit ``target_config``.
    """
    from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel, check_vocab_mapping

    step_dir = Path(step_dir)
    doc = ckpt.read_draft_config(step_dir)
    if doc["kind"] != "eagle3":
        raise ValueError(f"{step_dir} holds a {doc['kind']} draft, not an EAGLE-3 head")
    config = Eagle3Config(**doc["config"])
    tensors = ckpt.read_draft_tensors(step_dir)
    if "lm_head.weight" not in tensors:
        raise ValueError(f"{step_dir}: the checkpoint has no lm_head.weight; refusing to export a head whose "
                         "output layer would come from elsewhere")
    if target_config is not None:
        config.validate_against_target(target_config)
    model = Eagle3DraftModel(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{step_dir}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() == 0:
            raise ValueError(f"{step_dir}: tensor {name} is empty (an unconsolidated ZeRO-3 partition?)")
    check_vocab_mapping(tensors["d2t"].long(), tensors["t2d"].bool(), config.vocab_size)
    model.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}, strict=True)
    return model.eval()


def load_draft_lm_parts(step_dir: str | os.PathLike):
    """``(LlamaConfig, trained tensors)`` of a draft-LM checkpoint.

    Raises:
        ValueError: not a draft-LM checkpoint, or empty tensors.
    """
    from transformers import LlamaConfig

    step_dir = Path(step_dir)
    doc = ckpt.read_draft_config(step_dir)
    if doc["kind"] != "draft_lm":
        raise ValueError(f"{step_dir} holds a {doc['kind']} draft, not a draft LM")
    values = dict(doc["config"])
    for key in ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype"):
        values.pop(key, None)
    config = LlamaConfig(**values)
    config.architectures = ["LlamaForCausalLM"]
    tensors = ckpt.read_draft_tensors(step_dir)
    empty = [k for k, v in tensors.items() if v.numel() == 0]
    if empty:
        raise ValueError(f"{step_dir}: empty tensors {empty}")
    return config, tensors


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_yaml(path: Path) -> dict:
    import yaml
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


# ----------------------------------------------------------------------------------------------------------------
# model card

def _fmt(x, digits=3):
    return "n/a" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def _embeddings_line(widths: tuple[int, int] | None) -> str:
    if widths is None or widths[0] == widths[1]:
        return "- token embeddings: shared with the target (not stored)"
    h, ht = widths
    return (f"- token embeddings: the head's own `embed_tokens.weight` [vocab, {h}] (the head is {h} wide, the target "
            f"{ht}; `fc` maps 3 x {ht} -> {h}), the truncated-SVD projection of the target's table, frozen in "
            "training; vLLM and SGLang load it instead of sharing the target's")


def model_card(kind: str, name: str, target: str, state: dict, train_cfg: dict, *, tau: float | None = None,
               compact: bool = False, speculators: bool = False, dtype: str = "bfloat16",
               aux_layer_ids=None, draft_vocab_size=None, num_layers=None,
               widths: tuple[int, int] | None = None) -> str:
    """The ``README.md`` of an export: what it is, how to load it, its data, steps and measured acceptance.

    ``widths``: a head's ``(hidden_size, target_hidden_size)``; when they differ the card says the head carries its
    own embedding table."""
    data = state.get("data") or {}
    metrics = state.get("last_metrics") or {}
    held = state.get("last_heldout") or {}
    tags = ["speculative-decoding", "ssd-eagle"] + (["eagle3"] if kind == "eagle3" else ["draft-model"])
    lines = ["---", f"base_model: {target}", "tags:"] + [f"- {t}" for t in tags]
    if kind == "draft_lm":
        lines += ["library_name: transformers", "pipeline_tag: text-generation"]
    lines += ["---", "", f"# {name}", ""]
    if kind == "eagle3":
        lines += [f"EAGLE-3 draft head for [{target}](https://huggingface.co/{target}), trained with ssd-eagle "
                  f"(training-time test: {train_cfg.get('ttt_steps')} steps, loss weights "
                  f"{train_cfg.get('ttt_decay')}^i, soft cross-entropy against the target's distribution).", "",
                  f"- architecture: `LlamaForCausalLMEagle3` (one decoder layer), weights in {dtype}",
                  f"- draft vocabulary: {draft_vocab_size} tokens (`d2t`/`t2d` included; coverage of the training "
                  f"assistant tokens: {_fmt(state.get('vocab_coverage'), 4)})",
                  f"- aux hidden states: layers {list(aux_layer_ids or [])}, **input-of-layer** convention "
                  "(`hidden_states[i]` of transformers; vLLM's reading of `eagle_aux_hidden_state_layer_ids`)",
                  _embeddings_line(widths), ""]
        if train_cfg.get("saguaro_c") is not None:
            c, f = train_cfg["saguaro_c"], train_cfg.get("saguaro_fanout")
            lines += [f"**Saguaro-aware**: trained for Saguaro sampling with C = {c}, F = {f} (an extra loss term "
                      f"rewards rounds that do not stall, weight {train_cfg.get('saguaro_weight')}, temperature "
                      f"{train_cfg.get('saguaro_temperature')}); `config.json` records them under `ssd_eagle`. "
                      f"Serve it with `\"saguaro_c\": {c}, \"fanout\": [{f}]`; ssd-eagle warns on other values.", ""]
        lines += ["## Use", "", "```python",
                  "# vLLM",
                  f"LLM(model=\"{target}\", speculative_config={{\"method\": \"eagle3\", \"model\": \"<this repo>\", "
                  "\"num_speculative_tokens\": 7})",
                  "# ssd-eagle",
                  "LLM(speculative_config={\"method\": \"eagle3\", \"model\": \"<this folder>\", "
                  "\"num_speculative_tokens\": 7})", "```", ""]
        if speculators:
            lines += ["`speculators/` holds the same head in vLLM's speculators format.", ""]
    else:
        lines += [f"A {num_layers}-layer draft model for [{target}](https://huggingface.co/{target}): the target's "
                  f"first {num_layers} decoder layers, final norm and output layer, distilled with KL to the target's "
                  "next-token distribution. Same tokenizer as the target.", ""]
        if draft_vocab_size:
            lines += [f"- draft vocabulary: ssd-eagle drafts over the {draft_vocab_size} most frequent assistant "
                      f"tokens of the training data (`ssd_eagle.draft_vocab` in `config.json`; coverage "
                      f"{_fmt(state.get('vocab_coverage'), 4)}), scoring only those rows of the output layer; "
                      "transformers, vLLM and SGLang ignore the record and use the whole layer", ""]
        if compact:
            lines += ["**Compact export**: only the trained tensors are stored (`draft_lm.safetensors`); the token "
                      "embedding table (tied output layer) is the target's and is not duplicated. "
                      "`AutoModelForCausalLM.from_pretrained` refuses this folder on purpose; make a plain folder "
                      "with", "", "```bash",
                      f"python -m train.export --materialize <this folder> <plain folder> --target {target}",
                      "```", "", "or load it with `ssd_eagle.models.draft_lm.load_draft_lm(folder, target_model)`; ssd-eagle's engines load it directly.", ""]
        else:
            lines += ["```python", "from transformers import AutoModelForCausalLM",
                      f"target = AutoModelForCausalLM.from_pretrained(\"{target}\")",
                      "draft = AutoModelForCausalLM.from_pretrained(\"<this folder>\")",
                      "target.generate(**inputs, assistant_model=draft)", "```", ""]
    lines += ["## Training", "",
              f"- data: `{train_cfg.get('data') or data.get('source')}` -- responses regenerated by the target; "
              f"{_fmt(data.get('num_conversations'))} conversations, {_fmt(data.get('num_tokens'))} tokens"
              + (f", {data.get('num_loss_tokens')} assistant tokens" if data.get("num_loss_tokens") else ""),
              f"- steps: {state.get('step')} optimizer steps ({_fmt(metrics.get('epoch'), 2)} epochs), "
              f"micro batch {train_cfg.get('micro_batch_size')} x accumulation {train_cfg.get('grad_accum')} x "
              f"{state.get('world_size')} rank(s), ZeRO stage {state.get('zero_stage')}, "
              f"{_fmt(state.get('tokens'))} training tokens"
              + (f", warm-started from `{train_cfg['init_from']}` (its own training not counted here)"
                 if train_cfg.get("init_from") else ""),
              f"- AdamW betas ({train_cfg.get('adam_beta1')}, {train_cfg.get('adam_beta2')}), lr "
              f"{train_cfg.get('lr')} (warmup {train_cfg.get('warmup_steps')}, cosine to "
              f"{train_cfg.get('min_lr_ratio')}x), grad clip {train_cfg.get('grad_clip')}, {train_cfg.get('dtype')}",
              f"- wall time {_fmt(state.get('elapsed_s'), 0)} s; last logged training loss "
              f"{_fmt(metrics.get('loss'))}, top-1 accuracy per step "
              f"{[round(a, 3) for a in metrics.get('step_acc', [])]}", "",
              "## Acceptance", ""]
    if held:
        lines.append(f"- teacher-forced estimate on held-out text the target generated greedily "
                     f"(`{train_cfg.get('heldout_data')}`, {held.get('heldout_rounds')} rounds, "
                     f"K = {held.get('heldout_num_draft')}): **tau = {_fmt(held.get('heldout_tau'), 2)}** "
                     "tokens per target forward (greedy chain drafting simulated, not timed)")
    else:
        lines.append("- no held-out estimate was recorded")
    lines.append(f"- measured by the serving engine: {_fmt(tau, 2) if tau is not None else 'not measured yet'}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# export

def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "bfloat16",
                      speculators: bool = False, compact: bool = False, target: str | None = None,
                      tau: float | None = None, name: str | None = None) -> Path:
    """Export the draft of a checkpoint into ``out_dir`` (replaced atomically). See the module docstring.

    Args:
        checkpoint: step dir, checkpoints root or output dir.
        dtype: storage dtype of floating weights (``d2t`` stays int64, ``t2d`` bool).
        speculators: EAGLE-3 only: also write ``speculators/``.
        compact: draft LM only: write only the trained tensors.
        target: overrides the target recorded in the checkpoint (tokenizer, config checks, embeddings).
        tau: a serving-side acceptance length to record in the model card.
        name: title of the model card (default: the output folder's name).

    Raises:
        ValueError: see :func:`load_eagle3_from_checkpoint` / :func:`load_draft_lm_parts`; ``--compact`` for a head.
        FileNotFoundError: no checkpoint.
    """
    from transformers import AutoConfig, AutoTokenizer

    from ssd_eagle.assets import load_model, resolve_model_path

    step_dir = ckpt.resolve_checkpoint(checkpoint)
    out = Path(out_dir)
    doc = ckpt.read_draft_config(step_dir)
    state = _read_json(step_dir / ckpt.TRAINER_STATE)
    train_cfg = _read_yaml(step_dir / ckpt.TRAIN_CONFIG)
    target_name = target or doc.get("target") or train_cfg.get("target")
    if target_name is None:
        raise ValueError(f"{step_dir} records no target: pass --target")
    torch_dtype = DTYPES[dtype]
    title = name or out.name
    if doc["kind"] == "eagle3":
        from ssd_eagle.models.eagle3_formats import save_eagle3, save_speculators

        if compact:
            raise ValueError("--compact applies to draft LMs; an EAGLE-3 head never stores the target's weights")
        path = resolve_model_path(target_name)
        target_config = AutoConfig.from_pretrained(path)
        head = load_eagle3_from_checkpoint(step_dir, target_config)
        with atomic_write(out, folder=True) as tmp:
            save_eagle3(head, tmp, dtype=torch_dtype)
            AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
            if speculators:
                save_speculators(head, tmp / "speculators", dtype=torch_dtype, verifier_name_or_path=target_name,
                                 verifier_architectures=list(getattr(target_config, "architectures", None) or []))
            (tmp / "README.md").write_text(model_card(
                "eagle3", title, target_name, state, train_cfg, tau=tau, speculators=speculators, dtype=dtype,
                aux_layer_ids=head.config.aux_layer_ids, draft_vocab_size=head.config.draft_vocab_size,
                widths=(head.config.hidden_size, head.config.target_hidden_size)))
        return out
    from ssd_eagle.models.draft_lm import draft_vocab_ids
    from train.draft_lm import save_draft_lm

    config, tensors = load_draft_lm_parts(step_dir)
    target_model, tokenizer = load_model(target_name)
    vocab = draft_vocab_ids(config)
    card = model_card("draft_lm", title, target_name, state, train_cfg, tau=tau, compact=compact, dtype=dtype,
                      num_layers=config.num_hidden_layers, draft_vocab_size=None if vocab is None else vocab.numel())
    return save_draft_lm(config, tensors, out, target=target_model, target_name=target_name, compact=compact,
                         dtype=torch_dtype, tokenizer=tokenizer, extra_files={"README.md": card})


def materialize(compact_dir: str | os.PathLike, out_dir: str | os.PathLike, target: str | None = None,
                dtype: str = "bfloat16") -> Path:
    """Turn a compact draft-LM export into a plain transformers folder (the target supplies the embedding).

    Raises:
        ValueError: not a compact export, no target known, or a target with other embeddings.
    """
    from ssd_eagle.assets import load_model
    from ssd_eagle.models.draft_lm import COMPACT_WEIGHTS, is_compact_draft_lm, load_draft_lm

    compact_dir = Path(compact_dir)
    if not is_compact_draft_lm(compact_dir):
        raise ValueError(f"{compact_dir} is not a compact draft LM export (no {COMPACT_WEIGHTS})")
    doc = json.loads((compact_dir / "config.json").read_text())
    target = target or doc.get("ssd_eagle", {}).get("shared_from_target", {}).get("target")
    if target is None:
        raise ValueError(f"{compact_dir} records no target: pass --target")
    target_model, tokenizer = load_model(target)
    model = load_draft_lm(compact_dir, target_model, dtype=DTYPES[dtype])
    out = Path(out_dir)
    with atomic_write(out, folder=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        card = compact_dir / "README.md"
        if card.is_file():
            (tmp / "README.md").write_text(card.read_text())
    return out


def push_to_hub(folder: str | os.PathLike, repo_id: str, private: bool = False, token: str | None = None,
                commit_message: str = "Upload draft model (ssd-eagle)"):
    """Create ``repo_id`` (model repo, ``exist_ok``) and upload ``folder`` with ``huggingface_hub``.

    Returns:
        what ``upload_folder`` returns (the commit info).
    """
    import huggingface_hub

    huggingface_hub.create_repo(repo_id, private=private, exist_ok=True, repo_type="model", token=token)
    return huggingface_hub.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                                         commit_message=commit_message, token=token)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="step dir, checkpoints root or output dir (or a compact draft LM with "
                                           "--materialize)")
    parser.add_argument("out", help="output folder (replaced)")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the folder to this hub model repo")
    parser.add_argument("--private", action="store_true", help="create the hub repo private")
    parser.add_argument("--speculators", action="store_true", help="EAGLE-3: also write speculators/ (vLLM)")
    parser.add_argument("--compact", action="store_true", help="draft LM: store only the trained tensors")
    parser.add_argument("--materialize", action="store_true", help="turn a compact draft LM into a plain folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="storage dtype")
    parser.add_argument("--target", help="target model (default: the one recorded in the checkpoint)")
    parser.add_argument("--tau", type=float, help="serving-side acceptance length to record in the model card")
    parser.add_argument("--name", help="model card title (default: the output folder name)")
    args = parser.parse_args(argv)
    if args.materialize:
        out = materialize(args.checkpoint, args.out, args.target, args.dtype)
    else:
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, speculators=args.speculators,
                                compact=args.compact, target=args.target, tau=args.tau, name=args.name)
    if args.push_to_hub:
        push_to_hub(out, args.push_to_hub, private=args.private)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"exported {out} ({size / 1e6:.1f} MB)" + (f", pushed to {args.push_to_hub}" if args.push_to_hub else ""))
    return out


if __name__ == "__main__":
    main()
