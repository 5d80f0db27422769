"""Pre-packed bf16 linear weights for CPU inference.

oneDNN runs a bf16 matmul on AMX / AVX512-BF16 from weights in a blocked layout. ``torch.nn.functional.linear``
reorders the plain ``[out, in]`` weight into that layout on **every call**, so a decode step that multiplies one row
by every weight of the model pays the reorder each time: on a 2-core Xeon with AMX a one-row bf16 matmul ran at ~10
GB/s of weights (float32: ~20) and SmolLM2-135M's bf16 step cost what its float32 step costs. :func:`pack_linears`
reorders each weight once (``torch.ops.mkldnn._reorder_linear_weight``) and runs the layer through
``torch.ops.mkldnn._linear_pointwise``, the kernels ``torch.compile`` uses after freezing:

- one-row 576 x 1536 bf16 matmul 148 -> 73 us, 6 rows 161 -> 72 us; SmolLM2-135M step through
  :class:`~ssd_eagle.model_runner.ModelRunner` (300-token context) 1 token 63.9 -> 48.6 ms, 6 tokens 71.7 -> 57.6 ms
  (bf16, one thread, same Xeon, same run).

Only the forward is replaced (an instance attribute over ``nn.Linear.forward``); ``weight`` stays the module's
parameter, so state dicts, tied embeddings and training are untouched. The packed copy is rebuilt when the weight
changes (its version counter or storage), and the plain ``F.linear`` runs whenever autograd needs a graph, the
weight is no longer bf16 (``model.float()``) or the input's dtype or device differs, under ``torch.compile``, or
for a sharded weight (tensor parallel). Results equal ``F.linear``'s up to the
order of bf16 accumulation (another blocking), so every path of one engine (AR, verification, drafting) goes
through the same packed kernels and greedy SD still equals its AR. The packed copy costs the weights' size again
in memory.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ssd_eagle.platform import cpu_info

PACKED_DTYPES = (torch.bfloat16,)


def packing_available() -> bool:
    """This torch has the oneDNN reorder and packed-linear ops, and the CPU runs bf16 natively
    (:attr:`~ssd_eagle.platform.CpuInfo.native_bf16`; on an AVX2-only CPU bf16 is emulated and packing is not
    what limits it)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        ops._reorder_linear_weight, ops._linear_pointwise  # noqa: B018 (resolving raises when absent)
    except (AttributeError, RuntimeError):
        return False
    return cpu_info().native_bf16


def packs_on(device: str | torch.device) -> bool:
    """Whether models on ``device`` run their bf16 linears packed: a CPU where :func:`packing_available`. The one
    decision :class:`~ssd_eagle.model_runner.ModelRunner` (unless compiled), the EAGLE-3 backend and
    :func:`~ssd_eagle.platform.describe` follow."""
    return torch.device(device).type == "cpu" and packing_available()


class PackedForward:
    """The forward :func:`pack_linears` installs on one ``nn.Linear``: ``[.., in] -> [.., out]`` through the packed
    weight, else ``F.linear``.

    Inference only: a weight written in place behind autograd's back (``weight.data.copy_``, or in place under
    ``torch.inference_mode`` on a weight made there) keeps its version and storage, so its stale packed copy would
    run; :func:`unpack_linears` before training or editing a packed model that way.
    """

    def __init__(self, linear: nn.Linear):
        self._linear = weakref.ref(linear)  # the layer holds this object: a strong reference would be a cycle
        self.packed: torch.Tensor | None = None
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
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            self.key = key
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def pack_linears(module: nn.Module) -> int:
    """Install :class:`PackedForward` on every CPU bf16 ``nn.Linear`` of ``module`` (plain weights only; a DTensor
    shard keeps ``F.linear``). Idempotent.

    Returns:
        the number of layers that now run packed.
    """
    count = 0
    for layer in module.modules():
        if not isinstance(layer, nn.Linear):
            continue
        weight = layer.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or type(weight.data) is not torch.Tensor:
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
