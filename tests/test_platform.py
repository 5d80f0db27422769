"""dtype ``auto``: bfloat16 exactly where the matmuls run bf16 natively (ssd_eagle.platform), and the one place the
engine config asks."""

from __future__ import annotations

import pytest
import torch

from ssd_eagle.config import EngineConfig
from ssd_eagle.platform import CpuInfo, cpu_info, describe, describe_line, resolve_dtype

ZEN4 = CpuInfo("AMD EPYC 9R14", ("avx2", "avx512f", "avx512_bf16"), onednn=True)
SAPPHIRE_RAPIDS = CpuInfo("Intel Xeon Platinum 8488C", ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"),
                          onednn=True)
GRAVITON3 = CpuInfo("Neoverse-V1", ("bf16",), onednn=True)
AVX2_ONLY = CpuInfo("Intel Xeon E5-2686 v4", ("avx2",), onednn=True)
NO_ONEDNN = CpuInfo("AMD EPYC 9R14", ("avx2", "avx512f", "avx512_bf16"), onednn=False)


@pytest.mark.parametrize("cpu, expected", [
    (ZEN4, torch.bfloat16), (SAPPHIRE_RAPIDS, torch.bfloat16), (GRAVITON3, torch.bfloat16),
    (AVX2_ONLY, torch.float32), (NO_ONEDNN, torch.float32),
], ids=["avx512_bf16", "amx", "arm_bf16", "avx2_only", "no_onednn"])
def test_auto_on_cpu_follows_native_bf16(cpu, expected):
    assert resolve_dtype("auto", "cpu", cpu) == expected
    assert cpu.native_bf16 == (expected == torch.bfloat16)


def test_auto_on_cuda_is_bfloat16():
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 (auto is float32 on it)")
    assert resolve_dtype("auto", "cuda:0", AVX2_ONLY) == torch.bfloat16
    assert EngineConfig(mode="ar", device="cuda:0").torch_dtype == torch.bfloat16


def test_explicit_dtypes_are_kept_whatever_the_cpu():
    for name in ("float32", "float64", "bfloat16", "float16"):
        assert resolve_dtype(name, "cpu", AVX2_ONLY) == getattr(torch, name)
        assert resolve_dtype(name, "cpu", ZEN4) == getattr(torch, name)


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("half", "cpu")


def test_engine_config_asks_the_platform():
    assert EngineConfig(mode="ar", dtype="auto").torch_dtype == resolve_dtype("auto", "cpu", cpu_info())
    assert EngineConfig(mode="ar", dtype="float64").torch_dtype == torch.float64


def test_this_machine_is_described():
    info = cpu_info()
    assert info.model and set(info.flags) <= {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "bf16"}
    d = describe("cpu", torch.bfloat16)
    assert d["device"] == "cpu" and d["dtype"] == "bfloat16" and d["native_bf16"] == info.native_bf16
    assert d["cpu_flags"] == list(info.flags)
    from ssd_eagle.packed_linear import packing_available

    assert d["packed_weights"] == packing_available()  # bf16 weights run packed where oneDNN packs them
    from ssd_eagle.packed_linear import fp32_packing_available

    line = describe_line("cpu", torch.float32)  # float32 runs few-row matmuls packed on AVX2-only CPUs
    assert "dtype=float32" in line and f"native_bf16={info.native_bf16}" in line \
        and f"packed_weights={fp32_packing_available()}" in line
