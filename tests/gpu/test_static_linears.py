"""The default ``static_linears: torch`` on the GPU: a static set's linears run in cuBLAS between
its engines (``prx_compile::linear``), the output matches eager and the ``tensorrt`` build, the
pieces between the linears are shared across blocks, and LoRA in place and the artifact still work."""

import pytest
import torch

from prx_compile import compile_prx, load_compiled, load_lora, save_compiled
from prx_compile.lora import make_random_lora
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import SMALL_PRX
from .test_tensorrt import TOL, eager, inputs

pytestmark = pytest.mark.gpu
DEEP = {**SMALL_PRX, "depth": 4}
STATIC = dict(batch=[1, 2], resolution=512, aspect_bins=[], text_len=[8, 64], static=True,
              specialize=[[512, 512, 2]])  # fmt: skip


def test_static_set_runs_its_linears_in_cublas_and_matches(tmp_path):
    model = make_prx(DEEP, dtype=torch.bfloat16, device="cuda")
    kw = inputs(model)
    ref = eager(model, kw)
    ct = compile_prx(model, **STATIC)  # static_linears: the default
    assert ct.compile_config.static_linears == "torch"
    out = ct(**kw, return_dict=False)[0].clone()
    rep = ct.report()
    assert rep["torch_ops"]["prx_compile.linear.default"] >= 6 * DEEP["depth"], rep["torch_ops"]
    assert rep["engines"] < rep["engine_calls"], rep  # repeated pieces share an engine
    in_trt = compile_prx(model, static_linears="tensorrt", **STATIC)
    assert "prx_compile.linear.default" not in in_trt.report()["torch_ops"]
    assert rel_err(out, ref) < TOL and rel_err(out, in_trt(**kw, return_dict=False)[0]) < TOL
    assert not out.isnan().any()
    load_lora(ct, make_random_lora(model, 8, seed=1, std=0.05), "a")
    with_lora = ct(**kw, return_dict=False)[0].clone()
    assert rel_err(with_lora, eager(model, kw)) < TOL and rel_err(with_lora, out) > 1e-2
    save_compiled(ct, tmp_path / "a")
    loaded = load_compiled(tmp_path / "a")
    assert torch.equal(loaded(**kw, return_dict=False)[0], with_lora) and loaded.builds == 0
