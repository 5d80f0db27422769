"""The machine the engine runs on, and the dtype ``auto`` picks there.

``auto`` means **bfloat16 where the matmuls run bf16 natively, float32 elsewhere**:

- CUDA: bfloat16 (float32 on a GPU that ``torch.cuda.is_bf16_supported()`` says lacks it, e.g. before Ampere).
- CPU: bfloat16 when torch's oneDNN backend is built in (``torch.backends.mkldnn.is_available()``) and the CPU has
  bf16 dot-product instructions: ``avx512_bf16`` or ``amx_bf16`` on x86-64 (AVX512-BF16, AMX), ``bf16`` on
  aarch64 (Armv8.6 BF16). The flags come from ``torch.cpu.get_capabilities()`` (cpuinfo, torch >= 2.6) or else
  the ``flags`` / ``Features`` lines of ``/proc/cpuinfo``. On an AVX2-only CPU bf16 is emulated (converted to
  float32 around each kernel) and slower than float32, so ``auto`` stays float32 there.
- any other device: float32.

This differs from vLLM, whose ``auto`` means "the checkpoint's dtype": here the machine decides, because on a CPU
with native bf16 a verification of K + 1 tokens costs about what one token costs (the regime speculative decoding
needs), while without it bf16 only loses time.

``float16`` on a CPU means float16 *weights* with float32 activations (:func:`~ssd_eagle.assets.load_model`), run by
FBGEMM's fp16 kernels (:mod:`ssd_eagle.packed_linear`): on an AVX2-only CPU the fastest choice (an AMD EPYC Zen 3
decode step 56.7 -> 42.5 ms, a 6-token verification 114.6 -> 58.3 ms), and closer to float32 than bf16 (weights rounded to
11 significant bits instead of 8). ``auto`` does not pick it: rounding the weights changes the target, so float32
stays the exact default there. Every consumer of the target (EAGLE-3 heads, draft LMs, the SSD
speculator process, draft trees, the server) follows the target's dtype, so this is decided once, here.
"""

from __future__ import annotations

import functools
import platform as _platform
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
DTYPE_HELP = ("auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls (AVX512-BF16, AMX, Arm BF16), float32 "
              "elsewhere; unlike vLLM, auto is not the checkpoint's dtype. float16 on a CPU: float16 weights, float32 "
              "activations (FBGEMM; the fastest on AVX2-only CPUs)")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86-64 AVX512-BF16, AMX-BF16; aarch64 FEAT_BF16
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "bf16")
_TORCH_FLAG_NAMES = {"avx512_f": "avx512f"}  # torch.cpu.get_capabilities() spelling -> /proc/cpuinfo spelling


@dataclass(frozen=True)
class CpuInfo:
    """What matters about the CPU for choosing a dtype.

    Attributes:
        model: the CPU's model name (``/proc/cpuinfo``, else torch's cpuinfo, else ``platform.processor()``).
        flags: the :data:`REPORTED_FLAGS` this CPU has, in that order.
        onednn: torch was built with oneDNN (``torch.backends.mkldnn.is_available()``), which runs bf16 matmuls
            on the bf16 instructions.
    """

    model: str
    flags: tuple[str, ...]
    onednn: bool

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run on bf16 instructions (oneDNN and one of :data:`BF16_FLAGS`)."""
        return self.onednn and any(flag in self.flags for flag in BF16_FLAGS)


def _proc_cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


@functools.cache
def cpu_info() -> CpuInfo:
    """The CPU this process runs on (read once; the hardware does not change under a process)."""
    model, flags = _proc_cpuinfo()
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        caps = get_capabilities()
        flags |= {_TORCH_FLAG_NAMES.get(name, name) for name, value in caps.items() if value is True}
        model = model or str(caps.get("cpu_name") or "")
    return CpuInfo(model or _platform.processor() or "unknown", tuple(f for f in REPORTED_FLAGS if f in flags),
                   torch.backends.mkldnn.is_available())


def resolve_dtype(name: str, device: str | torch.device = "cpu", cpu: CpuInfo | None = None) -> torch.dtype:
    """The torch dtype for a ``--dtype`` value on ``device`` (see the module docstring for ``auto``).

    Args:
        name: one of :data:`DTYPES`.
        device: where the target runs (``cpu``, ``cuda[:i]``, ...).
        cpu: the CPU to decide for (default: this machine's, :func:`cpu_info`).

    Raises:
        ValueError: ``name`` is not one of :data:`DTYPES`.
    """
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name != "auto":
        return getattr(torch, name)
    kind = torch.device(device).type
    if kind == "cuda":  # (resolved without a GPU too, e.g. a deployment config read on a CPU-only machine)
        supported = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
        return torch.bfloat16 if supported else torch.float32
    if kind == "cpu":
        return torch.bfloat16 if (cpu or cpu_info()).native_bf16 else torch.float32
    return torch.float32


def describe(device: str | torch.device, dtype: torch.dtype) -> dict:
    """Device, CPU capability and dtype as a JSON-ready dict (for ``/health``, the server log and benchmarks).
    ``packed_weights``: the target's weights in ``dtype`` run packed on this device unless compiled (bf16: oneDNN;
    float16 on a CPU: FBGEMM; float32 on an AVX2-only CPU: oneDNN for few rows, :mod:`ssd_eagle.packed_linear`);
    ``activations``: the dtype the model computes in."""
    cpu = cpu_info()
    from ssd_eagle.packed_linear import fp16_packing_available, fp32_packing_available, packing_available

    on_cpu = torch.device(device).type == "cpu"
    packed = on_cpu and ((dtype == torch.bfloat16 and packing_available())
                         or (dtype == torch.float16 and fp16_packing_available())
                         or (dtype == torch.float32 and fp32_packing_available()))
    activations = torch.float32 if on_cpu and dtype == torch.float16 else dtype
    info = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "activations": str(activations).removeprefix("torch."), "cpu": cpu.model,
            "cpu_flags": list(cpu.flags), "native_bf16": cpu.native_bf16, "packed_weights": packed,
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def describe_line(device: str | torch.device, dtype: torch.dtype) -> str:
    """:func:`describe` on one line, the header every benchmark prints."""
    d = describe(device, dtype)
    gpu = f" gpu={d['gpu']!r}" if "gpu" in d else ""
    acts = f" activations={d['activations']}" if d["activations"] != d["dtype"] else ""
    return (f"device={d['device']}{gpu} dtype={d['dtype']}{acts} cpu={d['cpu']!r} "
            f"flags={','.join(d['cpu_flags']) or '-'} native_bf16={d['native_bf16']} "
            f"packed_weights={d['packed_weights']} torch={d['torch']} threads={d['threads']}")
