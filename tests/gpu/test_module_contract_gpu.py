"""The module contract of tests/test_module_contract.py with the TensorRT backend, for weights: inputs
(engines read the parameters) and weights: engine (refit): load_state_dict on either object, weight
edits, a swapped submodule, a dtype change and save_pretrained, each compared with eager PyTorch."""

import logging

import pytest
import torch

from prx_compile import compile_prx
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX
from .test_tensorrt import eager, inputs

pytestmark = pytest.mark.gpu


def compiled(weights):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    return model, compile_prx(model, weights=weights, static=True, specialize=[[512, 512, 2]], **RANGE)


def check(ct, model, tol=2e-2):
    kw = inputs(model)
    out = ct(**kw, return_dict=False)[0]
    assert rel_err(out, eager(model, kw)) < tol
    return out


@pytest.mark.parametrize("weights", ["inputs", "engine"])
def test_load_state_dict_and_weight_edits_are_followed(weights):
    model, ct = compiled(weights)
    before = check(ct, model).clone()
    other = make_prx(SMALL_PRX, seed=1, dtype=torch.bfloat16, device="cuda")
    ct.load_state_dict(other.state_dict())
    after = check(ct, model)
    assert rel_err(after, before) > 1e-2
    model.load_state_dict(make_prx(SMALL_PRX, seed=2, dtype=torch.bfloat16, device="cuda").state_dict())
    check(ct, model)
    with torch.no_grad():
        model.blocks[0].attention.to_out[0].weight.mul_(1.5)
    check(ct, model)
    assert ct.builds == 1
    if weights == "engine":
        assert ct.backends[0].refits >= 3


@pytest.mark.parametrize("weights", ["inputs", "engine"])
def test_a_swapped_submodule_is_read_or_rebuilt(weights, caplog):
    model, ct = compiled(weights)
    check(ct, model)
    old = model.blocks[1].down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    with torch.no_grad():
        new.weight.normal_(std=0.05)
    model.blocks[1].down_proj = new.to("cuda", torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="prx_compile.runtime"):
        check(ct, model)
    # weights: inputs re-binds the engines' inputs; weights: engine holds the old weights: rebuilt
    assert ct.builds == (1 if weights == "inputs" else 2)


def test_a_dtype_change_rebuilds_and_save_pretrained_saves_the_transformer(tmp_path):
    from diffusers import PRXTransformer2DModel

    model, ct = compiled("inputs")
    check(ct, model)
    ct.half()
    assert ct.dtype == torch.float16
    kw = {k: v.half() if v.is_floating_point() else v for k, v in inputs(model).items()}
    out = ct(**kw, return_dict=False)[0]
    assert out.dtype == torch.float16 and rel_err(out, eager(model, kw)) < 2e-2 and ct.builds == 2
    ct.save_pretrained(tmp_path / "transformer")
    loaded = PRXTransformer2DModel.from_pretrained(tmp_path / "transformer").to("cuda", torch.float16)
    assert rel_err(eager(loaded.eval(), kw), out) < 2e-2


def test_steps_replay_ahead_and_a_change_voids_the_replay():
    """Repeated calls replay their CUDA graph before the change check (``_follow`` is not reached);
    an in-place edit is read live (nothing voided); a swapped layer voids the replay, which ran on
    the old layer, and is followed; a moved storage is never replayed ahead: every output matches
    eager."""
    model, ct = compiled("inputs")
    check(ct, model)
    follows = []
    real = ct.follower.follow
    ct.follower.follow = lambda: follows.append(1) or real()
    check(ct, model)
    check(ct, model)
    assert (follows, ct.replays_dropped) == ([], 0)
    layer = model.blocks[0].attention.to_out[0]
    with torch.no_grad():
        layer.weight.mul_(1.5)
    check(ct, model)
    assert (follows, ct.replays_dropped) == ([], 0)
    old = model.blocks[1].down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    with torch.no_grad():
        new.weight.normal_(std=0.05)
    model.blocks[1].down_proj = new.to("cuda", torch.bfloat16)
    check(ct, model)
    assert (len(follows), ct.replays_dropped) == (1, 1)
    check(ct, model)  # captured again on the new layer: ahead again
    assert (len(follows), ct.replays_dropped) == (1, 1)
    layer.weight.data = layer.weight.data * 0.5
    check(ct, model)
    assert (len(follows), ct.replays_dropped) == (2, 1)
    assert ct.builds == 1


def test_fp8_in_place_edits_void_the_replay_and_are_requantised():
    """FP8 copies read by the graph go stale with an in-place edit: the replay ahead is voided, the
    copies requantised and the step run again."""
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, precision="fp8", static=True, specialize=[[512, 512, 2]], **RANGE)
    kw = inputs(model)
    first = ct(**kw, return_dict=False)[0].clone()
    assert torch.equal(ct(**kw, return_dict=False)[0], first) and ct.replays_dropped == 0
    with torch.no_grad():
        for block in model.blocks:
            block.down_proj.weight.mul_(-1.0)
    out = ct(**kw, return_dict=False)[0]
    assert ct.replays_dropped == 1 and rel_err(out, first) > 1e-2
    assert rel_err(out, eager(model, kw)) < 2e-2  # the same (requantised) fp8 model, eager
