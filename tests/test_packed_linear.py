"""Pre-packed linear layers (:mod:`ssd_eagle.packed_linear`), bf16 (oneDNN), float32 weights with float16 values
(FBGEMM) and other float32 weights for few rows (oneDNN, AVX2-only CPUs): the same results as ``F.linear`` up to summation order, the plain path wherever autograd needs it, a
repack when the weight changes, state dicts untouched, and the engine's greedy SD/SSD still equal to its AR up to
near ties (tests/test_bf16.py runs with packing on and off, and in float16 weights)."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import make_tiny_llama
import ssd_eagle.packed_linear
from ssd_eagle.packed_linear import (FP32_ROWS, PackedForward, fp16_packing_available, fp32_packing_available,
                                     has_fp16_weights, pack_linears, packing_available, round_linears_to_fp16,
                                     unpack_linears)

BF16_HERE = packing_available()  # (read before any test monkeypatches it)
needs_bf16_packing = pytest.mark.skipif(
    not BF16_HERE, reason="bf16 packing needs oneDNN's packed-linear ops and a CPU with native bf16 (oneDNN's bf16 "
                          "reorder refuses an AVX2-only CPU)")
needs_fp16_packing = pytest.mark.skipif(not fp16_packing_available(),
                                        reason="fp16 packing needs FBGEMM (x86-64 torch builds) and AVX2")
FP32_OPS_HERE = torch.backends.mkldnn.is_available() and ssd_eagle.packed_linear._ops_resolve(
    "mkldnn", "_reorder_linear_weight", "_linear_pointwise")


@pytest.fixture
def fp32_packing(monkeypatch):
    """The float32 few-row path, switched on wherever oneDNN's ops run it: it serves AVX2-only CPUs, but its results
    are checked on any x86 CPU (on one with native bf16 it is off by default, not broken)."""
    if not FP32_OPS_HERE:
        pytest.skip("float32 packing needs oneDNN's _reorder_linear_weight and _linear_pointwise")
    monkeypatch.setattr(ssd_eagle.packed_linear, "fp32_packing_available", lambda: True)


@pytest.fixture
def no_fp32_packing(monkeypatch):
    """The FBGEMM tests' fallback is F.linear, as on CPUs without the float32 path (tested on its own below)."""
    monkeypatch.setattr(ssd_eagle.packed_linear, "fp32_packing_available", lambda: False)


def close_in_bf16(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@needs_bf16_packing
@pytest.mark.parametrize("shape", [(1, 48), (6, 48), (2, 5, 48), (40, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_computes_what_f_linear_computes(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(48, 96, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(*shape).bfloat16()
    want = F.linear(x, layer.weight, layer.bias)
    assert pack_linears(layer) == 1 and isinstance(layer.__dict__["forward"], PackedForward)
    got = layer(x)
    assert got.shape == want.shape and layer.forward.packed is not None
    close_in_bf16(got, want)
    assert list(layer.state_dict()) == (["weight", "bias"] if bias else ["weight"])


@needs_bf16_packing
def test_training_and_other_dtypes_take_the_plain_path_and_a_changed_weight_is_repacked():
    torch.manual_seed(1)
    layer = nn.Linear(32, 16).to(torch.bfloat16)
    pack_linears(layer)
    x = torch.randn(3, 32).bfloat16()
    out = layer(x)  # the weight requires grad: autograd needs F.linear's graph
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias)) and layer.forward.packed is None
    out.float().sum().backward()
    assert layer.weight.grad is not None
    with torch.no_grad():
        first = layer(x)
        assert layer.forward.packed is not None
        layer.weight.mul_(-1)  # an in-place update bumps the version: the next call repacks
        close_in_bf16(layer(x), F.linear(x, layer.weight, layer.bias))
        assert not torch.equal(layer(x), first)
        layer.weight.data = torch.randn(16, 32).bfloat16()  # new storage: repacked too
        close_in_bf16(layer(x), F.linear(x, layer.weight, layer.bias))
        x32 = x.float()  # a float32 input is the plain path's business (it raises there, as unpacked)
        with pytest.raises(RuntimeError):
            layer(x32)
    with torch.inference_mode():  # a layer made under inference mode has no version counter
        made_there = nn.Linear(32, 16).to(torch.bfloat16)
    pack_linears(made_there)
    with torch.no_grad():
        close_in_bf16(made_there(x), F.linear(x, made_there.weight, made_there.bias))
    float_layer = nn.Linear(8, 8)  # float32 values that float16 cannot hold: nothing to pack
    assert pack_linears(float_layer) == 0 and "forward" not in float_layer.__dict__


@needs_bf16_packing
def test_a_packed_model_decodes_like_the_plain_one_and_unpacks():
    model = make_tiny_llama(seed=3, dtype=torch.bfloat16, init_std=0.1)
    ids = torch.randint(3, 257, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        assert pack_linears(model) == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
        assert pack_linears(model) == 29  # idempotent
        close_in_bf16(model(ids).logits, want)
        copied = copy.deepcopy(model)  # no opaque tensor travels; the copy packs its own
        close_in_bf16(copied(ids).logits, want)
        assert pickle.loads(pickle.dumps(model)).model.layers[0].mlp.up_proj.forward.packed is None
        unpack_linears(model)
        assert torch.equal(model(ids).logits, want)


@needs_bf16_packing
def test_review_findings_dtype_change_compile_cycle_and_a_trainable_bias():
    """Found by a reviewer: a packed model moved to another dtype crashed (float64) or ran a float32 packed copy;
    a runner that compiles left an earlier runner's packing in place (inductor cannot trace the packed kernel); the
    layer -> forward -> layer cycle kept dropped models alive until a gc pass; a trainable bias under a frozen weight
    got no gradient."""
    from ssd_eagle.model_runner import ModelRunner

    model = make_tiny_llama(seed=3, dtype=torch.bfloat16, init_std=0.1)
    ids = torch.randint(3, 257, (1, 12), generator=torch.Generator().manual_seed(0))
    assert ModelRunner(model, 1, 64, packed_weights=True).packed_weights
    with torch.no_grad():
        want = model.double()(ids).logits  # plain F.linear for a float64 weight
        unpack_linears(model)
        assert torch.equal(model(ids).logits, want)
    model.bfloat16()
    pack_linears(model)
    runner = ModelRunner(model, 1, 64, packed_weights=False)  # what compile=True decides
    assert not runner.packed_weights
    assert not any(isinstance(m.__dict__.get("forward"), PackedForward) for m in model.modules())

    gc.disable()
    try:
        layer = nn.Linear(16, 16).to(torch.bfloat16)
        pack_linears(layer)
        alive = weakref.ref(layer)
        del layer
        assert alive() is None  # freed by reference counting alone
    finally:
        gc.enable()

    layer = nn.Linear(16, 4).to(torch.bfloat16)
    layer.weight.requires_grad_(False)
    pack_linears(layer)
    layer(torch.randn(2, 16).bfloat16()).float().sum().backward()
    assert layer.bias.grad is not None


# ----------------------------------------------------------------------------------------------------------------
# float32 weights with float16 values (FBGEMM)

def close_in_fp32(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # float32 sums in another order


@needs_fp16_packing
@pytest.mark.parametrize("shape", [(1, 48), (6, 48), (2, 5, 48), (40, 48), (0, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_float16_valued_layer_runs_fbgemm_and_computes_what_f_linear_computes(shape, bias, no_fp32_packing):
    torch.manual_seed(0)
    layer = nn.Linear(48, 96, bias=bias).requires_grad_(False)
    assert pack_linears(layer) == 0  # float32 values: not packed, exact F.linear
    assert round_linears_to_fp16(layer) == 1 and has_fp16_weights(layer)
    assert torch.equal(layer.weight, layer.weight.half().float())
    x = torch.randn(*shape)
    want = F.linear(x, layer.weight, layer.bias)
    assert pack_linears(layer) == 1
    got = layer(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    close_in_fp32(got, want)
    if x.numel():
        assert layer.forward.packed is not None
        wide = torch.randn(shape[0], 96)[..., ::2]  # a strided input
        close_in_fp32(layer(wide), F.linear(wide, layer.weight, layer.bias))
    assert list(layer.state_dict()) == (["weight", "bias"] if bias else ["weight"])


@needs_fp16_packing
def test_a_float16_valued_weight_written_with_float32_values_takes_the_plain_path_again(no_fp32_packing):
    torch.manual_seed(2)
    layer = nn.Linear(32, 16, bias=False)
    round_linears_to_fp16(layer)
    pack_linears(layer)
    x = torch.randn(3, 32)
    out = layer(x)  # the weight requires grad: autograd's F.linear
    assert torch.equal(out, F.linear(x, layer.weight)) and layer.forward.packed is None
    out.sum().backward()
    with torch.no_grad():
        close_in_fp32(layer(x), F.linear(x, layer.weight))
        assert layer.forward.packed is not None
        layer.weight.add_(1e-4)  # float32 values now: the next call finds them and runs F.linear
        assert torch.equal(layer(x), F.linear(x, layer.weight)) and layer.forward.packed is None
        assert not has_fp16_weights(layer)
        layer.weight.copy_(layer.weight.half())  # float16 values again (an in-place write: repacked)
        close_in_fp32(layer(x), F.linear(x, layer.weight))
        assert layer.forward.packed is not None
        assert torch.equal(layer.double()(x.double()), F.linear(x.double(), layer.weight))  # float64: plain path
    unpack_linears(layer)
    assert "forward" not in layer.__dict__


def test_rounding_to_float16_values_covers_tied_layers_and_refuses_what_float16_cannot_hold():
    model = make_tiny_llama(seed=4, dtype=torch.float32, init_std=0.1, tie=True)
    assert not has_fp16_weights(model)
    norm = model.model.norm.weight
    with torch.no_grad():
        norm.fill_(1.0001)  # not a float16 value: a norm weight must keep it
    table = model.model.embed_tokens.weight.detach().clone()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert round_linears_to_fp16(model) == 4 * 7 + 1
    assert has_fp16_weights(model)
    # the tied output layer gets a rounded copy: the embeddings keep their float32 values (a draft LM's check of
    # the target's embeddings hashes them)
    assert torch.equal(model.model.embed_tokens.weight, table)
    assert torch.equal(model.lm_head.weight, table.half().float())
    assert bool((norm == 1.0001).all())  # only linear weights are rounded
    big = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        big[1].weight[0, 0] = 7e4
    with pytest.raises(ValueError, match=r"1\.weight has values outside float16's range"):
        round_linears_to_fp16(big)
    assert not has_fp16_weights(nn.ReLU())


@needs_fp16_packing
def test_a_float16_weight_model_decodes_like_its_plain_self_through_the_runner():
    from ssd_eagle.kv_cache import ForwardBatch
    from ssd_eagle.model_runner import ModelRunner

    model = make_tiny_llama(seed=3, dtype=torch.float32, init_std=0.1)
    round_linears_to_fp16(model)
    ids = torch.randint(3, 257, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    runner = ModelRunner(model, 1, 64)
    assert runner.packed_weights and runner.dtype == torch.float32
    out = runner.forward(ForwardBatch.causal([ids[0].tolist()], [0], [0], runner.dtype, runner.device))
    close_in_fp32(out.logits[0], want[0])
    plain = ModelRunner(make_tiny_llama(seed=3, dtype=torch.float32, init_std=0.1), 1, 64)
    assert plain.packed_weights == fp32_packing_available()  # float32 values: oneDNN's few-row path, or nothing


@needs_fp16_packing
def test_load_model_float16_on_a_cpu_gives_float16_weights_and_float32_activations(tmp_path):
    from helpers import make_byte_tokenizer
    from ssd_eagle.assets import load_model
    from ssd_eagle.platform import describe

    make_tiny_llama(seed=1, dtype=torch.float32).save_pretrained(tmp_path)
    make_byte_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float32} and has_fp16_weights(model)
    plain, _ = load_model(str(tmp_path), dtype=torch.float32)
    assert not has_fp16_weights(plain)
    d = describe("cpu", torch.float16)
    assert d["dtype"] == "float16" and d["activations"] == "float32" and d["packed_weights"]
    assert describe("cpu", torch.float32)["activations"] == "float32"


# ----------------------------------------------------------------------------------------------------------------
# other float32 weights: oneDNN for 2..16 rows, F.linear otherwise

@pytest.mark.parametrize("rows", [1, 2, 6, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_a_float32_layer_runs_onednn_for_few_rows_and_f_linear_otherwise(rows, bias, fp32_packing):
    torch.manual_seed(0)
    layer = nn.Linear(48, 96, bias=bias).requires_grad_(False)
    assert not has_fp16_weights(layer) and pack_linears(layer) == 1
    for shape in [(rows, 48), (1, rows, 48)]:
        x = torch.randn(*shape)
        want = F.linear(x, layer.weight, layer.bias)
        got = layer(x)
        assert layer.forward.kind == "fp32" and got.shape == want.shape and got.dtype == torch.float32
        if rows in FP32_ROWS:
            close_in_fp32(got, want)
        else:  # a decode step's one row and a prefill's many run MKL's kernels, bit for bit
            assert torch.equal(got, want)
    assert list(layer.state_dict()) == (["weight", "bias"] if bias else ["weight"])


def test_a_float32_layer_repacks_when_written_and_switches_kernel_with_its_values(fp32_packing):
    torch.manual_seed(2)
    layer = nn.Linear(32, 16, bias=False)
    pack_linears(layer)
    x = torch.randn(3, 32)
    out = layer(x)  # the weight requires grad: autograd's F.linear
    assert torch.equal(out, F.linear(x, layer.weight)) and layer.forward.packed is None
    with torch.no_grad():
        close_in_fp32(layer(x), F.linear(x, layer.weight))
        assert layer.forward.kind == "fp32"
        layer.weight.mul_(-1)  # an in-place write: repacked
        close_in_fp32(layer(x), F.linear(x, layer.weight))
        layer.weight.copy_(layer.weight.half())  # float16 values: FBGEMM where it runs
        close_in_fp32(layer(x), F.linear(x, layer.weight))
        assert layer.forward.kind == ("fp16" if fp16_packing_available() else "fp32")
        assert torch.equal(layer.double()(x.double()), F.linear(x.double(), layer.weight))  # float64: plain path


def test_a_float32_model_decodes_like_its_plain_self_through_the_runner(fp32_packing):
    from ssd_eagle.kv_cache import ForwardBatch
    from ssd_eagle.model_runner import ModelRunner

    model = make_tiny_llama(seed=3, dtype=torch.float32, init_std=0.1)
    ids = torch.randint(3, 257, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    runner = ModelRunner(model, 1, 64)
    assert runner.packed_weights
    for start, n in [(0, 14), (14, 1), (15, 5)]:  # a prefill, a decode step, a verification of 5 tokens
        out = runner.forward(ForwardBatch.causal([ids[0, start: start + n].tolist()], [0], [start], runner.dtype,
                                                 runner.device))
        close_in_fp32(out.logits[0], want[0, start: start + n])
