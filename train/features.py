"""Target features for draft training: captured online through :class:`~ssd_eagle.model_runner.ModelRunner` (the
code path serving uses) or precomputed once into safetensors shards (offline mode).

Per token the trainer needs the target's aux hidden states (EAGLE-3 only; input-of-layer ids, ``docs/design.md``
section 2), its final-normed last hidden state (``p`` is recomputed from it through the frozen output layer: full
logits would be ~200 KB a token) and its greedy next token (computed exactly, in float32, when the features are
made, so storing the hidden states in 16 bits cannot move it).

Shard layout (``features_dir``), one ``<run>`` per invocation of the precompute (runs add to the directory):

    index-<run>-rank<r>.json        {"format", "meta": {...}, "samples": [{"shard", "key", "length", "conv"}, ...]}
    <run>-rank<r>-<k>.safetensors   per sample "<key>.input_ids" int32 [n], "<key>.loss_mask" uint8 [n],
                                    "<key>.last_hidden" [n, H], "<key>.argmax" int32 [n],
                                    "<key>.aux_hidden" [n, 3H] (when aux ids were given)

``conv`` is :func:`conversation_key` of the sample's conversation, so a later run computes only the conversations
the directory lacks (e.g. after the data file grew) and training can select exactly the rows of its data file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from ssd_eagle.io import atomic_write
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.sampling import upcast_logits

FEATURES_FORMAT = "ssd_eagle.features/v1"
# index metadata that must agree between the runs of one directory
SHARED_META = ("target", "target_dtype", "aux_layer_ids", "dtype", "hidden_size", "max_length")


def conversation_key(messages: list[dict]) -> str:
    """A content key of a conversation (SHA-1 of its roles and contents): stable across files and row orders."""
    text = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


@dataclass
class TargetBatch:
    """A padded batch with the target's features.

    Attributes:
        input_ids: int64 [B, n] (right-padded with 0); loss_mask: int64 [B, n] (0 on padding);
        lengths: int64 [B] real lengths.
        last_hidden: float [B, n, H], the target's final-normed hidden states.
        argmax: int64 [B, n], the target's greedy next token at each position.
        aux_hidden: float [B, n, 3 * H] or None.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor
    last_hidden: torch.Tensor
    argmax: torch.Tensor
    aux_hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device=None, dtype: torch.dtype | None = None) -> TargetBatch:
        """Move to ``device``; cast the float features to ``dtype`` when given."""
        def f(x):
            return None if x is None else x.to(device=device, dtype=dtype or x.dtype)
        return TargetBatch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device),
                           f(self.last_hidden), self.argmax.to(device), f(self.aux_hidden))


def pad_batch(samples: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ``[{"input_ids", "loss_mask"}, ...]`` -> ``(input_ids [B, n], loss_mask [B, n], lengths [B])``,
    int64, padding 0 (never attended by real tokens under a causal mask, never in the loss)."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.long)
    n = int(lengths.max())
    ids = torch.zeros(len(samples), n, dtype=torch.long)
    mask = torch.zeros(len(samples), n, dtype=torch.long)
    for row, s in enumerate(samples):
        k = len(s["input_ids"])
        ids[row, :k] = torch.as_tensor(s["input_ids"], dtype=torch.long)
        mask[row, :k] = torch.as_tensor(s["loss_mask"], dtype=torch.long)
    return ids, mask, lengths


@torch.no_grad()
def lm_head_argmax(hidden: torch.Tensor, lm_head: nn.Module, chunk: int = 1024) -> torch.Tensor:
    """Greedy token of ``hidden`` [..., H] under the output layer ``lm_head`` (H -> V), ``chunk`` rows at a time.

    Computed as the serving engine computes its logits (:meth:`ModelRunner.forward`: its output layer module, packed
    where the server's is, in the model's dtype, then :func:`~ssd_eagle.sampling.upcast_logits`), so a bf16 target's
    label is the token it would serve.
    Returns int64 ``hidden.shape[:-1]``. A float32 product used to be taken here: it disagreed with the bf16 serving
    argmax at near ties and cost 2.2x (417 vs 193 ms for 600 rows of SmolLM2's 49152 x 576 layer, one thread, Xeon
    with AMX).
    """
    flat = hidden.reshape(-1, hidden.shape[-1]).to(lm_head.weight.dtype)
    out = torch.cat([upcast_logits(lm_head(flat[i:i + chunk])).argmax(-1)
                     for i in range(0, flat.shape[0], chunk)])
    return out.view(hidden.shape[:-1])


class TargetFeatureExtractor:
    """Runs the frozen target through :class:`ModelRunner` -- the serving code path, aux hidden states captured by
    its forward pre-hooks -- over whole training sequences.

    Args:
        target: the target ``*ForCausalLM`` (frozen; put in eval mode).
        aux_layer_ids: input-of-layer ids to capture (None for a draft LM, which needs none).
        max_batch: most sequences per call; max_len: longest sequence.
    """

    def __init__(self, target, aux_layer_ids: Sequence[int] | None, max_batch: int, max_len: int):
        target.requires_grad_(False)
        self.runner = ModelRunner(target, num_slots=max_batch, max_len=max_len,
                                  aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else None,
                                  initial_capacity=min(max_len, 512))
        self.lm_head_weight = self.runner.lm_head.weight
        self.max_batch = max_batch

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        return self.runner.aux_layer_ids

    def __call__(self, samples: Sequence[dict]) -> TargetBatch:
        """Features of ``[{"input_ids", "loss_mask"}, ...]`` (at most ``max_batch``).

        Raises:
            ValueError: more samples than ``max_batch``, or a sequence longer than ``max_len``.
        """
        if len(samples) > self.max_batch:
            raise ValueError(f"{len(samples)} samples but the extractor holds {self.max_batch}")
        ids, mask, lengths = pad_batch(samples)
        runner = self.runner
        batch = ForwardBatch.causal([s["input_ids"] for s in samples], list(range(len(samples))),
                                    [0] * len(samples), runner.dtype, runner.device)
        out = runner.forward(batch, capture_aux=runner.aux_layer_ids is not None, compute_logits=False)
        # inference-mode tensors cannot be saved for backward: clone into ordinary tensors
        last = out.hidden.clone()
        aux = out.aux_hidden.clone() if out.aux_hidden is not None else None
        argmax = lm_head_argmax(last, self.runner.lm_head)
        return TargetBatch(ids.to(runner.device), mask.to(runner.device), lengths.to(runner.device),
                           last, argmax, aux)


# ----------------------------------------------------------------------------------------------------------------
# offline shards

def write_feature_shards(samples: Iterable[dict], extractor: TargetFeatureExtractor, out_dir: str | os.PathLike,
                         *, run: str, rank: int = 0, dtype: torch.dtype = torch.bfloat16, batch_size: int = 1,
                         samples_per_shard: int = 256, meta: dict | None = None, total: int | None = None,
                         progress: bool = True) -> Path:
    """Run the target over ``samples`` once and write this rank's shards and index. Files are renamed into place
    and the index is rewritten after every shard, listing only shards already on disk: a killed run keeps what it
    finished (up to the last shard), and a later run computes only the conversations it lacks.

    Args:
        samples: dicts with ``input_ids``, ``loss_mask`` and ``conv`` (:func:`conversation_key`).
        run: name of this invocation (prefix of its files).
        extractor: the target (its ``aux_layer_ids`` decide whether aux states are stored).
        dtype: storage dtype of the hidden states.
        meta: recorded in the index (target name, data source, max_length, ...); ``aux_layer_ids`` and ``dtype``
            are added.

    Returns:
        the index path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {"format": FEATURES_FORMAT,
             "meta": dict(meta or {}, aux_layer_ids=list(extractor.aux_layer_ids or []) or None,
                          dtype=str(dtype).removeprefix("torch."), hidden_size=int(extractor.lm_head_weight.shape[1])),
             "samples": []}
    shard: dict[str, torch.Tensor] = {}
    shard_id = 0

    path = out / f"index-{run}-rank{rank}.json"

    def write_index():
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps(index))

    def flush():
        nonlocal shard, shard_id
        if not shard:
            return
        name = f"{run}-rank{rank}-{shard_id:05d}.safetensors"
        with atomic_write(out / name) as tmp:
            save_file(shard, str(tmp))
        shard, shard_id = {}, shard_id + 1
        write_index()

    pending: list[dict] = []
    count = 0

    def process(batch_samples):
        nonlocal count
        feats = extractor(batch_samples)
        for row, s in enumerate(batch_samples):
            n = len(s["input_ids"])
            key = f"s{count}"
            shard[f"{key}.input_ids"] = torch.as_tensor(s["input_ids"], dtype=torch.int32)
            shard[f"{key}.loss_mask"] = torch.as_tensor(s["loss_mask"], dtype=torch.uint8)
            shard[f"{key}.last_hidden"] = feats.last_hidden[row, :n].to(dtype).contiguous()
            shard[f"{key}.argmax"] = feats.argmax[row, :n].to(torch.int32).contiguous()
            if feats.aux_hidden is not None:
                shard[f"{key}.aux_hidden"] = feats.aux_hidden[row, :n].to(dtype).contiguous()
            index["samples"].append({"shard": f"{run}-rank{rank}-{shard_id:05d}.safetensors", "key": key, "length": n,
                                     "conv": s["conv"]})
            count += 1
            if count % samples_per_shard == 0:
                flush()

    for s in tqdm(samples, total=total, desc=f"target features (rank {rank})", disable=not progress):
        pending.append(s)
        if len(pending) == batch_size:
            process(pending)
            pending = []
    if pending:
        process(pending)
    flush()
    write_index()  # also when every sample was dropped: the index records them
    return path


class FeatureStore:
    """Read-only view of the shards of a features directory (every run's indexes, oldest first).

    Samples are dicts with ``input_ids`` (int64 [n]), ``loss_mask`` (int64 [n]), ``last_hidden`` [n, H],
    ``argmax`` (int64 [n]) and, when stored, ``aux_hidden`` [n, 3H]; tensors are read lazily from memory-mapped
    files. A conversation stored twice is listed once.

    Args:
        path: the features directory.
        only: keep just the samples whose conversation key is in this collection (in its order).
        matching: read only the runs whose index metadata has these :data:`SHARED_META` values (a directory may
            then hold features of several targets, dtypes or lengths side by side; see :mod:`train.prepare`).

    Raises:
        FileNotFoundError: no (matching) index in ``path``.
        ValueError: an index of another format, or runs that disagree on the target, aux ids, dtype, hidden size
            or max length.
    """

    def __init__(self, path: str | os.PathLike, only: Sequence[str] | None = None, matching: dict | None = None):
        self.path = Path(path)
        indexes = sorted(self.path.glob("index-*.json"))
        docs = [(idx, json.loads(idx.read_text())) for idx in indexes]
        for _, doc in docs:  # indexes written before the target's dtype was recorded came from a float32 target
            doc.setdefault("meta", {}).setdefault("target_dtype", "float32")
        if matching is not None:
            docs = [(idx, doc) for idx, doc in docs
                    if all(doc.get("meta", {}).get(k) == v for k, v in matching.items())]
        if not docs:
            raise FileNotFoundError(f"no feature index (index-*.json) in {self.path}"
                                    + (f" for {matching}" if matching is not None else "")
                                    + "; run train/precompute_features.py first (the trainer builds it itself)")
        self.meta: dict | None = None
        self.samples: list[dict] = []
        self.dropped: set[str] = set()  # conversations without a loss token (nothing to store)
        seen: set[str] = set()
        for idx, doc in docs:
            if doc.get("format") != FEATURES_FORMAT:
                raise ValueError(f"{idx}: not a feature index ({FEATURES_FORMAT})")
            shared = {k: doc["meta"].get(k) for k in SHARED_META}
            if self.meta is None:
                self.meta = dict(doc["meta"])
            elif shared != {k: self.meta.get(k) for k in SHARED_META}:
                raise ValueError(f"{idx}: {shared} differs from the directory's other runs; use a new features_dir")
            self.dropped.update(doc["meta"].get("dropped", []))
            for entry in doc["samples"]:
                if entry["conv"] not in seen:
                    seen.add(entry["conv"])
                    self.samples.append(entry)
        if only is not None:
            by_key = {e["conv"]: e for e in self.samples}
            self.samples = [by_key[k] for k in dict.fromkeys(only) if k in by_key]
        self._handles: dict[str, object] = {}

    @property
    def keys(self) -> set[str]:
        """Conversation keys of the samples."""
        return {e["conv"] for e in self.samples}

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> list[int]:
        return [s["length"] for s in self.samples]

    def _open(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
        return handle

    def get(self, i: int, with_hidden: bool = True) -> dict:
        """Sample ``i``; ``with_hidden=False`` reads only ``input_ids``/``loss_mask`` (for vocabulary counts)."""
        entry = self.samples[i]
        f = self._open(entry["shard"])
        key = entry["key"]
        out = {"input_ids": f.get_tensor(f"{key}.input_ids").long(),
               "loss_mask": f.get_tensor(f"{key}.loss_mask").long()}
        if with_hidden:
            out["last_hidden"] = f.get_tensor(f"{key}.last_hidden")
            out["argmax"] = f.get_tensor(f"{key}.argmax").long()
            if f"{key}.aux_hidden" in f.keys():
                out["aux_hidden"] = f.get_tensor(f"{key}.aux_hidden")
        return out

    def __getitem__(self, i: int) -> dict:
        return self.get(i)

    def token_rows(self) -> Iterable[dict]:
        """``input_ids``/``loss_mask`` of every sample (what :func:`train.vocab.count_token_frequencies` reads)."""
        for i in range(len(self)):
            yield self.get(i, with_hidden=False)


def collate_features(samples: Sequence[dict]) -> TargetBatch:
    """Pad offline samples (:meth:`FeatureStore.get`) into a :class:`TargetBatch` (hidden states in float32)."""
    ids, mask, lengths = pad_batch(samples)
    b, n = ids.shape
    h = samples[0]["last_hidden"].shape[-1]
    last = torch.zeros(b, n, h)
    argmax = torch.zeros(b, n, dtype=torch.long)
    has_aux = all("aux_hidden" in s for s in samples)
    aux = torch.zeros(b, n, samples[0]["aux_hidden"].shape[-1]) if has_aux else None
    for row, s in enumerate(samples):
        k = s["input_ids"].shape[0]
        last[row, :k] = s["last_hidden"].float()
        argmax[row, :k] = s["argmax"]
        if aux is not None:
            aux[row, :k] = s["aux_hidden"].float()
    return TargetBatch(ids, mask, lengths, last, argmax, aux)
