"""Pre-packed linear weights for CPU inference: bf16 through oneDNN, float16 through FBGEMM.

``torch.nn.functional.linear`` runs a decode step's few-row matmuls badly on a CPU, for two reasons this module
removes by packing each weight once:

- **bf16** (CPUs with AVX512-BF16 / AMX): oneDNN reorders the plain ``[out, in]`` weight into its blocked layout
  on **every call**, so a one-row matmul ran at ~10 GB/s of weights on a 2-core Xeon with AMX and SmolLM2-135M's
  bf16 step cost what its float32 step costs. The layer runs ``torch.ops.mkldnn._linear_pointwise`` on a weight
  reordered once (``torch.ops.mkldnn._reorder_linear_weight``), the kernels ``torch.compile`` uses after freezing:
  one-row 576 x 1536 matmul 148 -> 73 us, 6 rows 161 -> 72 us; SmolLM2-135M step through
  :class:`~ssd_eagle.model_runner.ModelRunner` (300-token context) 1 token 63.9 -> 48.6 ms, 6 tokens 71.7 -> 57.6 ms
  (bf16, one thread, same Xeon, same run).
- **float32 weights whose values are exactly float16** (any CPU with AVX2): MKL's sgemm is slow for 2..8 rows on
  an AVX2-only AMD EPYC (Zen 3): a 6-row 576 -> 1536 matmul cost 3.6x a one-row one, so verifying K + 1 = 6
  tokens cost 2.2x a decode step. FBGEMM's fp16 GEMM (``torch.ops.quantized.linear_prepack_fp16`` /
  ``linear_dynamic_fp16``, what ``torch.ao`` dynamic fp16 quantization runs) keeps the weight in fp16 (half the
  bytes) and computes in float32 with kernels made for few rows: SmolLM2-135M step (200-token context, one
  thread, same Zen 3, same run, ``scripts/bench_forward.py``) 1 token 56.7 -> 42.5 ms, 6 tokens 114.6 -> 58.3 ms. The weight's values are used
  exactly and sums run in float32, so a packed layer computes what ``F.linear`` computes up to float32 summation
  order: this path needs no opt-in. ``--dtype float16`` on a CPU (:func:`~ssd_eagle.assets.load_model`) rounds a
  float32 model's linear weights to float16 values (:func:`round_linears_to_fp16`) so that all of them take it.
- **float32 weights, few rows** (AVX2-only CPUs, where ``dtype: auto`` means float32): the same MKL sgemm makes
  every verification pay ~1.8-2x a decode step. oneDNN's float32 matmul on a weight reordered once
  (``_reorder_linear_weight`` for a 6-row batch) runs 2..16 rows at far less, and one row no faster than MKL's
  gemv, so a one-row call (a decode step, a chain's draft step) keeps ``F.linear`` and so do 17 rows and more
  (prefill, large batches: no faster packed). SmolLM2-135M through :class:`~ssd_eagle.model_runner.ModelRunner`
  (200-token context, one thread, AMD EPYC Zen 3, median of 12 interleaved forwards, same run), n new tokens
  1 / 2 / 3 / 4 / 6: ``F.linear`` 61.5 / 112.8 / 120.9 / 108.3 / 121.7 ms, this path 63.2 / 76.2 / 80.3 / 87.7 /
  95.0 ms; n = 16: 144.6 vs 141.9. Not used on CPUs with native bf16 (there float32 is not auto, and this path is
  not measured).

Only the forward is replaced (an instance attribute over ``nn.Linear.forward``); ``weight`` stays the module's
parameter, so state dicts, tied embeddings and training are untouched. The packed copy is rebuilt when the weight
changes (its version counter or storage), and the plain ``F.linear`` runs whenever autograd needs a graph, the
weight's dtype is not packed here (``model.double()``; a float32 weight not exactly float16 where the float32 path is
off), a float32 oneDNN weight gets one row or more than 16, or the input's dtype
or device differs, under ``torch.compile``, or for a sharded weight (tensor parallel). Results equal ``F.linear``'s
up to summation order (another blocking), so every path of one engine (AR, verification, drafting) goes through
the same packed kernels and greedy SD still equals its AR up to near ties (:mod:`ssd_eagle.exactness`). The packed
copy costs the weights' size again in bf16 and float32, half of it in float16.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ssd_eagle.platform import cpu_info

PACKED_DTYPES = (torch.bfloat16, torch.float32)
FP32_ROWS = range(2, 17)  # the row counts a float32 weight runs through oneDNN (others: F.linear, as fast or faster)
FP32_BATCH_HINT = 6  # the rows oneDNN's float32 weight layout is chosen for (a K = 5 chain's verification)


def _ops_resolve(namespace: str, *names: str) -> bool:
    ops = getattr(torch.ops, namespace, None)
    try:
        for name in names:
            getattr(ops, name)  # (resolving raises when absent)
    except (AttributeError, RuntimeError):
        return False
    return True


def packing_available() -> bool:
    """bf16 packing: this torch has the oneDNN reorder and packed-linear ops, and the CPU runs bf16 natively
    (:attr:`~ssd_eagle.platform.CpuInfo.native_bf16`; on an AVX2-only CPU bf16 is emulated, and oneDNN's bf16
    reorder refuses to run without AVX512BW/VL/DQ or AVX-NE-CONVERT)."""
    return _ops_resolve("mkldnn", "_reorder_linear_weight", "_linear_pointwise") and cpu_info().native_bf16


def fp16_packing_available() -> bool:
    """float16 packing: this torch has FBGEMM (``torch.backends.quantized.supported_engines``) with its fp16-weight
    ops, and the CPU has AVX2, FBGEMM's minimum."""
    return "fbgemm" in torch.backends.quantized.supported_engines and "avx2" in cpu_info().flags \
        and _ops_resolve("quantized", "linear_prepack_fp16", "linear_dynamic_fp16")


def fp32_packing_available() -> bool:
    """float32 packing for few-row matmuls (:data:`FP32_ROWS`): this torch has oneDNN with its reorder and
    packed-linear ops, and the CPU has AVX2 but no native bf16 (the CPUs where ``dtype: auto`` means float32 and
    where MKL's few-row sgemm was measured slow; elsewhere float32 keeps ``F.linear``)."""
    cpu = cpu_info()
    return torch.backends.mkldnn.is_available() and "avx2" in cpu.flags and not cpu.native_bf16 \
        and _ops_resolve("mkldnn", "_reorder_linear_weight", "_linear_pointwise")


def packs_on(device: str | torch.device) -> bool:
    """Whether models on ``device`` run linears packed where their weights allow: a CPU where
    :func:`packing_available` (bf16 weights), :func:`fp16_packing_available` (float32 weights exactly float16) or
    :func:`fp32_packing_available` (other float32 weights, few rows). The one decision
    :class:`~ssd_eagle.model_runner.ModelRunner` (unless compiled) and the EAGLE-3 backend follow."""
    return torch.device(device).type == "cpu" \
        and (packing_available() or fp16_packing_available() or fp32_packing_available())


def exactly_fp16(weight: torch.Tensor) -> bool:
    """A plain float32 tensor whose every value is a float16 value (finite, no precision lost in a float16 copy); a
    sharded (DTensor) weight is not checked and counts as not."""
    return weight.dtype == torch.float32 and type(weight) is torch.Tensor \
        and torch.equal(weight, weight.to(torch.float16).float())


def packable(weight: torch.Tensor) -> bool:
    """This plain CPU weight can run packed: bf16 where :func:`packing_available`, float32 with float16 values
    where :func:`fp16_packing_available`, other float32 weights where :func:`fp32_packing_available`."""
    if weight.device.type != "cpu" or type(weight.data) is not torch.Tensor or weight.numel() == 0:
        return False
    if weight.dtype == torch.bfloat16:
        return packing_available()
    return weight.dtype == torch.float32 and _float32_kind(weight.detach()) is not None


def _float32_kind(weight: torch.Tensor) -> str | None:
    """How a float32 weight runs packed: ``"fp16"`` (FBGEMM; its values are float16 values), ``"fp32"`` (oneDNN,
    few rows), or None (``F.linear`` only)."""
    if fp16_packing_available() and exactly_fp16(weight):
        return "fp16"
    return "fp32" if fp32_packing_available() else None


def round_linears_to_fp16(module: nn.Module) -> int:
    """Round every float32 ``nn.Linear`` weight of ``module`` to its nearest float16 value (the storage stays float32:
    activations and sums stay float32, and :func:`pack_linears` runs these layers through FBGEMM's fp16 kernels).
    What ``--dtype float16`` means on a CPU. A weight shared with another kind of module (an output layer tied to
    the input embeddings) gets a rounded copy of its own and the embeddings keep their values, so a draft LM's check
    of the target's embeddings (:func:`~ssd_eagle.models.draft_lm.embedding_digest`) still passes; other weights
    are rounded in place.

    Returns:
        the number of layers rounded.

    Raises:
        ValueError: a weight with a value outside float16's range (``|w| > 65504``), which would become inf.
    """
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)
               and m.weight.dtype == torch.float32]
    shared = {id(p) for m in module.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for name, layer in linears:
            half = layer.weight.to(torch.float16)
            if not torch.isfinite(half).all():
                raise ValueError(f"{name or 'the layer'}.weight has values outside float16's range (|w| > 65504)")
            if id(layer.weight) in shared:
                layer.weight = nn.Parameter(half.float(), requires_grad=layer.weight.requires_grad)
            else:
                layer.weight.copy_(half)
    return len(linears)


def has_fp16_weights(module: nn.Module) -> bool:
    """Every ``nn.Linear`` weight of ``module`` is float32 with float16 values (:func:`round_linears_to_fp16` ran,
    or the checkpoint was float16): its drafts follow it (:func:`~ssd_eagle.engine.factory.load_draft`)."""
    weights = [m.weight for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(weights) and all(exactly_fp16(w.detach()) for w in weights)


class PackedForward:
    """The forward :func:`pack_linears` installs on one ``nn.Linear``: ``[.., in] -> [.., out]`` through the packed
    weight (bf16: oneDNN; float32 with float16 values: FBGEMM; other float32: oneDNN for :data:`FP32_ROWS` rows),
    else ``F.linear``.

    Inference only: a weight written in place behind autograd's back (``weight.data.copy_``, or in place under
    ``torch.inference_mode`` on a weight made there) keeps its version and storage, so its stale packed copy would
    run; :func:`unpack_linears` before training or editing a packed model that way.
    """

    def __init__(self, linear: nn.Linear):
        self._linear = weakref.ref(linear)  # the layer holds this object: a strong reference would be a cycle
        self.packed: torch.Tensor | None = None
        self.kind: str | None = None  # "bf16", "fp16" or "fp32": which kernel runs self.packed
        self.key: tuple[int, int] | None = None

    @property
    def linear(self) -> nn.Linear:
        return self._linear()

    def __getstate__(self) -> dict:
        """Copies and pickles (``copy.deepcopy``, a process boundary) carry the layer but no packed tensor: oneDNN's
        opaque layout has no storage to copy; the copy packs on its first call."""
        return {"linear": self.linear}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["linear"])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.linear
        weight, bias = layer.weight, layer.bias
        if weight.dtype not in PACKED_DTYPES or x.dtype != weight.dtype or x.device.type != "cpu" or x.numel() == 0 \
                or torch.compiler.is_compiling() \
                or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
            return F.linear(x, weight, bias)
        key = (0 if weight.is_inference() else weight._version, weight.data_ptr())  # (no counter on those)
        if key != self.key:
            self.kind, self.packed = _pack(weight.detach())
            self.key = key
        if self.packed is None or (self.kind == "fp32" and x.numel() // x.shape[-1] not in FP32_ROWS):
            return F.linear(x, weight, bias)
        if self.kind == "fp16":
            out = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)
            return out if bias is None else out.add_(bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> tuple[str | None, object]:
    """``(kind, packed copy)`` of a plain weight: oneDNN's blocked bf16 (``"bf16"``), FBGEMM's fp16 (``"fp16"``),
    oneDNN's blocked float32 (``"fp32"``), or ``(None, None)`` where the weight cannot run packed any more (a float32
    weight written to values float16 cannot hold, where the float32 path is off)."""
    if weight.dtype == torch.bfloat16:
        return "bf16", torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    kind = _float32_kind(weight)
    if kind == "fp16":
        return kind, torch.ops.quantized.linear_prepack_fp16(weight, None)
    if kind == "fp32":
        return kind, torch.ops.mkldnn._reorder_linear_weight(weight, FP32_BATCH_HINT)
    return None, None


def pack_linears(module: nn.Module) -> int:
    """Install :class:`PackedForward` on every ``nn.Linear`` of ``module`` whose weight is :func:`packable` (plain
    weights only; a DTensor shard keeps ``F.linear``). Idempotent.

    Returns:
        the number of layers that now run packed.
    """
    count = 0
    for layer in module.modules():
        if not isinstance(layer, nn.Linear):
            continue
        if not packable(layer.weight):
            continue
        if not isinstance(layer.__dict__.get("forward"), PackedForward):
            layer.forward = PackedForward(layer)
        count += 1
    return count


def unpack_linears(module: nn.Module) -> None:
    """Remove what :func:`pack_linears` installed (the class's ``forward`` runs again)."""
    for layer in module.modules():
        if isinstance(layer.__dict__.get("forward"), PackedForward):
            del layer.forward
