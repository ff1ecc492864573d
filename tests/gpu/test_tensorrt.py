"""compile_prx on Torch-TensorRT, checked against eager on a small non-degenerate PRX (bf16)."""

import pytest
import torch

from prx_compile import ShapeOutOfRangeError, compile_prx
from prx_compile.bench import rel_err
from prx_compile.export import example_inputs
from prx_compile.testing import make_prx

from .conftest import RANGE, SMALL_PRX

pytestmark = pytest.mark.gpu
TOL = 2e-2  # bf16 end to end


def inputs(model, batch=2, h=64, w=64, text=64, masked=40, seed=0):
    return example_inputs(
        model.config, batch, h, w, text, dtype=torch.bfloat16, device="cuda", masked_tokens=masked, seed=seed
    )


def eager(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


@pytest.fixture(scope="module")
def flash():
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    return model, compile_prx(model, **RANGE).build(inputs(model))


@pytest.mark.parametrize("masked", [0, 40, 64])  # none, some, all text tokens of a row hidden
def test_flash_form_matches_eager(flash, masked):
    model, ct = flash
    kw = inputs(model, masked=masked, seed=masked)
    out = ct(**kw, return_dict=False)[0]
    assert not out.isnan().any()
    assert rel_err(out, eager(model, kw)) < TOL
    rep = ct.report()
    assert rep["engines"] == SMALL_PRX["depth"] + 1 and rep["torch_segments"] == SMALL_PRX["depth"]
    assert set(rep["torch_ops"]) <= {"prx_compile.prx_attention.default"}, rep["torch_ops"]


def test_other_shapes_same_build(flash):
    model, ct = flash
    for kw in (inputs(model, batch=1, seed=3), inputs(model, text=30, masked=5, seed=4)):
        assert rel_err(ct(**kw, return_dict=False)[0], eager(model, kw)) < TOL
    assert ct.builds == 1


def test_out_of_range_is_an_error(flash):
    model, ct = flash
    with pytest.raises(ShapeOutOfRangeError, match="batch 3 not in"):
        ct(**inputs(model, batch=3), return_dict=False)


def test_cuda_graphs_capture_the_dynamic_build(flash):
    model, ct = flash
    ct(**inputs(model), return_dict=False)
    assert ct._graphs is not None and ct._graphs.captures >= 1 and not ct._graphs.failures, (
        ct._graphs.failures
    )


@pytest.mark.parametrize("patchify", ["reshape", "fold"])
def test_tensorrt_form_is_one_engine(patchify):
    model = make_prx(SMALL_PRX, patchify=patchify, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, attention="tensorrt", **RANGE)
    kw = inputs(model)
    out = ct(**kw, return_dict=False)[0]
    assert rel_err(out, eager(model, kw)) < TOL and not out.isnan().any()
    rep = ct.report()
    assert (rep["engines"], rep["torch_segments"]) == (1, 0)


def test_fold_patchify_stays_in_the_engines():
    model = make_prx(SMALL_PRX, patchify="fold", dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, **RANGE)
    kw = inputs(model)
    assert rel_err(ct(**kw, return_dict=False)[0], eager(model, kw)) < TOL
    assert ct.report()["engines"] == SMALL_PRX["depth"] + 1
