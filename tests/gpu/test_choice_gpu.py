"""Kernels chosen by measurement on the GPU: every candidate installed here is timed at the set's shape,
the fastest within its bound runs, and an artifact keeps the choice (a load measures nothing)."""

import pytest
import torch

from prx_compile import compile_prx, load_compiled, save_compiled
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX, fused_op
from .test_tensorrt import TOL, eager, inputs

pytestmark = pytest.mark.gpu
STATIC = dict(static=True, specialize=[[512, 512, 2]], **RANGE)


@pytest.mark.parametrize("precision", ["dtype", "fp8"])
def test_each_set_runs_the_fastest_candidate_it_measured_and_an_artifact_keeps_it(tmp_path, precision):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, precision=precision, **STATIC)
    kw = inputs(model, masked=40)
    out = ct(**kw, return_dict=False)[0].clone()
    assert rel_err(out, eager(model, kw)) < (TOL if precision == "dtype" else 4e-2)
    rep = ct.report()
    kernels = rep["kernels"]
    timed = {k.split("/", 1)[1]: v for k, v in kernels["ms"].items() if k.startswith("attention/")}
    assert set(timed) | {k.split("/", 1)[1] for k in kernels["rejected"]} == set(ct.plan.attention_candidates)
    assert kernels["how"] == "measured" and timed[kernels["attention"]] <= 1.02 * min(timed.values()), kernels
    if precision == "fp8":
        assert any(k.startswith("fp8/") for k in timed), kernels
    assert rep["torch_ops"][fused_op(rep)] == SMALL_PRX["depth"], rep["torch_ops"]  # the one it chose
    save_compiled(ct, tmp_path / "a")
    loaded = load_compiled(tmp_path / "a")
    got = loaded(**kw, return_dict=False)[0]
    assert torch.equal(got, out)
    assert loaded.report()["kernels"] == kernels
    assert "kernels_measure_s" not in loaded.backends[0].timings  # read, not measured again
