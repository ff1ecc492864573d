"""compile_prx on Torch-TensorRT, checked against eager on a small non-degenerate PRX (bf16), for both
``weights`` modes: engine sets, shapes, CUDA graphs, attention forms."""

import pytest
import torch

from prx_compile import ShapeOutOfRangeError, compile_prx
from prx_compile.export import example_inputs
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX, fused_op

pytestmark = pytest.mark.gpu
TOL = 2e-2  # bf16 end to end


def inputs(model, batch=2, h=64, w=64, text=64, masked=40, seed=0):
    return example_inputs(
        model, batch, h, w, text, dtype=torch.bfloat16, device="cuda", masked_tokens=masked, seed=seed
    )


def eager(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


@pytest.fixture(scope="module", params=["inputs", "engine"])
def compiled(request):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    return model, compile_prx(model, weights=request.param, **RANGE)


@pytest.mark.parametrize("masked", [0, 40, 64])  # none, some, all text tokens of a row hidden
def test_matches_eager_under_the_text_mask(compiled, masked):
    model, ct = compiled
    kw = inputs(model, masked=masked, seed=masked)
    out = ct(**kw, return_dict=False)[0]
    assert not out.isnan().any()
    assert rel_err(out, eager(model, kw)) < TOL
    rep = ct.report()
    assert rep["engines"] == SMALL_PRX["depth"] + 1 and rep["torch_segments"] == SMALL_PRX["depth"]
    assert rep["torch_ops"] == {fused_op(rep): SMALL_PRX["depth"]}, rep["torch_ops"]


def test_specialised_set_then_range_set(compiled):
    model, ct = compiled
    ct(**inputs(model), return_dict=False)  # 512² batch 2, 64 tokens: the specialised static set
    static = [b for b in ct.backends if b.shapes.is_static() and b.shapes.batch == (2, 2)][0]
    assert static.is_built
    for kw in (
        inputs(model, batch=1, seed=3),
        inputs(model, text=30, masked=5, seed=4),
        inputs(model, h=48, w=80),
    ):
        assert rel_err(ct(**kw, return_dict=False)[0], eager(model, kw)) < TOL
    rng = max(ct.backends, key=lambda b: b.shapes.volume())
    assert rng.is_built and not rng.shapes.is_static()
    # range_linears: torch: with weights as inputs, the range set's GEMMs run in cuBLAS, the MLP
    # gates' in cuDNN's fused GEMM where its frontend is installed (``fuse_mlp_gate``: one each)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    ops = rng.report()["torch_ops"]
    in_torch = ops.get("prx_compile.linear.default", 0) + ops.get("prx_compile.gelu_gate.default", 0)
    assert in_torch == (linears if ct.compile_config.weights == "inputs" else 0), ops
    gates = rng.kernels.gelu_gate  # what the set's measurement chose, among what the plan allows
    assert not gates or ct.plan.gelu_gate(rng.shapes)
    assert ops.get("prx_compile.gelu_gate.default", 0) == (SMALL_PRX["depth"] if gates else 0), ops


def test_weights_modes_differ_where_expected(compiled):
    model, ct = compiled
    ct(**inputs(model), return_dict=False)
    rep = ct.report()
    if ct.compile_config.weights == "inputs":  # engines hold no weights
        assert rep["engine_mb"] < 5, rep["engine_mb"]
    else:
        assert rep["engine_mb"] > sum(p.numel() for p in model.parameters()) * 2 / 2**20 * 0.5


def test_cuda_graphs_capture(compiled):
    model, ct = compiled
    ct(**inputs(model), return_dict=False)
    runners = list(ct.sets.graphs.values())
    assert runners and all(r.captures >= 1 and not r.failures for r in runners), [r.failures for r in runners]


def test_out_of_range_error_or_build():
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, on_shape_miss="error", static=True, **RANGE)
    with pytest.raises(ShapeOutOfRangeError, match="outside every engine set"):
        ct(**inputs(model, batch=3), return_dict=False)
    ct = compile_prx(model, static=True, specialize=[[512, 512, 2]], **RANGE)
    kw = inputs(model, batch=3)
    assert rel_err(ct(**kw, return_dict=False)[0], eager(model, kw)) < TOL
    assert ct.builds == 1 and ct.backends[-1].shapes.batch == (3, 3)


@pytest.mark.parametrize("patchify", ["reshape", "fold"])
def test_tensorrt_attention_is_one_engine(patchify):
    model = make_prx(SMALL_PRX, patchify=patchify, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, attention="tensorrt", static=True, specialize=[[512, 512, 2]], **RANGE)
    kw = inputs(model)
    out = ct(**kw, return_dict=False)[0]
    assert rel_err(out, eager(model, kw)) < TOL and not out.isnan().any()
    rep = ct.report()
    assert (rep["engines"], rep["torch_segments"]) == (1, 0)


def test_fold_patchify_stays_in_the_engines():
    model = make_prx(SMALL_PRX, patchify="fold", dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, static=True, specialize=[[512, 512, 2]], **RANGE)
    kw = inputs(model)
    assert rel_err(ct(**kw, return_dict=False)[0], eager(model, kw)) < TOL
    assert ct.report()["engines"] == SMALL_PRX["depth"] + 1
    slowest = ct.report()["engine_sets"][0]["slowest_engines"]  # what a first call waits on
    assert 1 <= len(slowest) <= 4 and all(s > 0 and ops > 0 for s, ops, _ in slowest.values()), slowest


def test_on_shape_miss_split_runs_a_larger_batch_through_the_sets_it_has(caplog):
    """on_shape_miss: split on TensorRT: batch 3 at a covered size runs as 2 + 1 through the static
    and range sets, matches eager, and adds no set."""
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, on_shape_miss="split", **RANGE)
    kw = inputs(model, batch=3, masked=20, seed=5)
    sets = [b.shapes.describe() for b in ct.backends]
    with caplog.at_level("WARNING", logger="prx_compile.runtime"):
        out = ct(**kw, return_dict=False)[0]
    assert out.shape[0] == 3 and not out.isnan().any()
    assert rel_err(out, eager(model, kw)) < TOL
    assert [b.shapes.describe() for b in ct.backends] == sets
    assert any("runs as batches of 2 + 1" in r.message for r in caplog.records)


def test_a_new_shape_in_the_range_gets_a_static_set_of_its_own():
    """auto_specialize (the default, 2) on TensorRT: text length 30, which only the range takes, gets
    a static set built for it (not the range set), and its output matches eager."""
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, **{**RANGE, "auto_specialize": 2})
    kw = inputs(model, text=30, masked=5, seed=6)
    out = ct(**kw, return_dict=False)[0]
    assert rel_err(out, eager(model, kw)) < TOL and not out.isnan().any()
    made = ct.backends[-1]
    assert made.is_built and made.shapes.is_static() and made.shapes.text == (30, 30)
    assert not any(b.is_built for b in ct.backends if not b.shapes.is_static())
