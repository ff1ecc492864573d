"""Both tiny PRX fixtures, exported with the pipeline's kwargs and lowered, match eager in fp32."""

import pytest
import torch

from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import JOINT_ATTENTION

from ..conftest import eager, prx_inputs

aten = torch.ops.aten


@pytest.mark.parametrize("form", ["flash", "tensorrt"])
@pytest.mark.parametrize("masked", [0, 5, 12])  # a row hides none, some, all of its 12 text tokens
def test_lowered_prx_matches_eager(exported, form, masked):
    model, ep = exported
    gm = lower(ep.module(), LoweringSettings(attention=form))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not {aten.im2col.default, aten.col2im.default} & targets
    assert aten.scaled_dot_product_attention.default not in targets
    assert (JOINT_ATTENTION in targets) == (form == "flash")
    for kw in (
        prx_inputs(model, masked=masked),
        prx_inputs(model, batch=3, h=24, w=12, text=7, masked=min(masked, 7), seed=1),
    ):
        with torch.no_grad():
            out = gm(**kw)
        ref = eager(model, kw)
        assert (out - ref).abs().max() <= 1e-5
        assert (out - ref).norm() / ref.norm() <= 1e-6


def test_fixtures_are_not_degenerate(exported):
    """The mask and the text must change the output: Modulation is re-initialised."""
    model, _ = exported
    kw = prx_inputs(model, masked=0)
    kw_masked = prx_inputs(model, masked=12)
    diff = (eager(model, kw) - eager(model, kw_masked)).abs().max()
    assert diff > 1e-3


def test_fold_fixture_exports_im2col_and_col2im():
    from prx_compile.export import export_step
    from prx_compile.tools.testing import make_prx

    model = make_prx(patchify="fold")
    ep, _ = export_step(model, prx_inputs(model))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert {aten.im2col.default, aten.col2im.default} <= targets
