"""The linear rule: range engine sets leave their GEMMs to PyTorch (``range_linears: torch``)."""

import pytest
import torch

from prx_compile.config import CompileConfig
from prx_compile.export import example_inputs, export_step, weight_tensors
from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import LINEAR
from prx_compile.shapes import ShapeRange
from prx_compile.tools.testing import make_prx

from ..conftest import plan_of

RANGE = ShapeRange((1, 2), (8, 16), (8, 16), (1, 12))


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.fixture(scope="module")
def exported():
    model = make_prx()  # non-degenerate weights (modulation re-initialised)
    kw = example_inputs(model, 2, 16, 16, 12, masked_tokens=5)
    ep, names = export_step(model, kw, RANGE, weights="inputs", fuse_attention=True)
    return model, ep, names


def test_every_linear_becomes_the_torch_op_and_the_step_is_exact(exported):
    model, ep, names = exported
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert targets(ep.module()).count(torch.ops.aten.linear.default) == linears > 0
    gm = lower(ep.module(), LoweringSettings(linears_in_torch=True))
    ops = targets(gm)
    assert ops.count(LINEAR) == linears and torch.ops.aten.linear.default not in ops
    params = weight_tensors(model)
    for batch, h, w, text in ((2, 16, 16, 12), (1, 8, 12, 3)):  # two shapes of the range
        kw = example_inputs(model, batch, h, w, text, masked_tokens=1)
        with torch.no_grad():
            ref = model(**kw, return_dict=False)[0]
            got = gm(**kw, weights=[params[n] for n in names])
        assert ref.abs().mean() > 1e-2  # not the identity's zeros
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_off_by_default_for_pytorch_backends_and_where_the_switches_say(exported):
    _, ep, _ = exported
    assert LINEAR not in targets(lower(ep.module()))
    cfg = CompileConfig(device="cpu")
    static = ShapeRange.static(2, 16, 16, 12)
    assert plan_of(cfg).lowering(RANGE).linears_in_torch
    assert not plan_of(cfg).lowering().linears_in_torch  # a PyTorch backend: inductor keeps aten.linear
    assert plan_of(cfg).lowering(static).linears_in_torch  # static_linears: torch, the default
    assert not plan_of(cfg, static_linears="tensorrt").lowering(static).linears_in_torch
    assert plan_of(cfg, static_linears="tensorrt").lowering(RANGE).linears_in_torch
    assert not plan_of(cfg, range_linears="tensorrt").lowering(RANGE).linears_in_torch
    assert not plan_of(cfg, weights="engine").lowering(RANGE).linears_in_torch  # engines own weights


def test_the_linear_op_is_f_linear():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
    assert torch.equal(LINEAR(x, w, b), torch.nn.functional.linear(x, w, b))
    assert torch.equal(LINEAR(x, w, None), torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="x has 8 features, weight 7"):  # a Program read from disk
        LINEAR(x, w[:, :7], b)
    with pytest.raises(ValueError, match=r"bias must have shape \(5,\)"):
        LINEAR(x, w, b[:4])
