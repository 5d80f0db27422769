"""Pre-packed bf16 linear layers (:mod:`ssd_eagle.packed_linear`): the same results as ``F.linear`` up to bf16
accumulation order, the plain path wherever autograd needs it, a repack when the weight changes, state dicts
untouched, and the engine's greedy SD/SSD still equal to its AR up to near ties (tests/test_bf16.py runs with
packing on and off)."""

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
from ssd_eagle.packed_linear import PackedForward, pack_linears, unpack_linears


def _ops_present() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise  # noqa: B018
        return torch.backends.mkldnn.is_available()
    except (AttributeError, RuntimeError):
        return False


pytestmark = pytest.mark.skipif(not _ops_present(), reason="torch built without oneDNN's packed-linear ops")


def close_in_bf16(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


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
    float_layer = nn.Linear(8, 8)
    assert pack_linears(float_layer) == 0 and "forward" not in float_layer.__dict__


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
