"""The full 1.17 B PRX on the GPU (weights as engine inputs, the static preset at 1024² batch 2, the
pipeline's text mask): against eager, a rank-64 LoRA over the 96 block linears in place, and an
artifact that comes back bit-identical. About two minutes on an H200, so it runs only when asked:

    PRX_COMPILE_GPU_FULL=1 pytest -m gpu tests/gpu/test_full_model.py
"""

import os

import pytest
import torch

from prx_compile import compile_prx, load_compiled, load_lora, save_compiled, set_lora, unload_lora
from prx_compile.lora import make_random_lora
from prx_compile.tools.bench import Case, rel_err
from prx_compile.tools.testing import FULL_PRX, make_prx

from .test_tensorrt import eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("PRX_COMPILE_GPU_FULL") != "1", reason="set PRX_COMPILE_GPU_FULL=1"),
]


def test_full_model_static_preset_lora_and_artifact(tmp_path):
    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    kw = Case((1024, 1024), 2).inputs(model, torch.bfloat16, "cuda")
    ref = eager(model, kw)
    ct = compile_prx(model, config="prx-1024-bf16-static")
    base = ct(**kw, return_dict=False)[0].clone()
    assert not base.isnan().any() and rel_err(base, ref) < 1e-2
    rep = ct.report()  # linears in cuBLAS (static_linears: torch): the blocks' pieces between them shared
    assert rep["engines"] <= 9 < rep["engine_calls"] and ct.builds == 1, rep
    assert rep["torch_ops"]["prx_compile.linear.default"] >= 6 * len(model.blocks), rep["torch_ops"]

    a, b = make_random_lora(model, 64, seed=1, std=0.02), make_random_lora(model, 64, seed=2, std=0.02)
    assert sum(k.endswith("lora_A.weight") for k in a) == 96
    load_lora(ct, a, "a")
    out_a = ct(**kw, return_dict=False)[0].clone()
    assert rel_err(out_a, eager(model, kw)) < 1e-2 and rel_err(out_a, base) > 2e-2
    load_lora(ct, b, "b")
    set_lora(ct, "b")
    set_lora(ct, "a")
    assert torch.equal(ct(**kw, return_dict=False)[0], out_a)

    save_compiled(ct, tmp_path / "art")
    loaded = load_compiled(tmp_path / "art")
    assert torch.equal(loaded(**kw, return_dict=False)[0], out_a) and loaded.builds == 0
    unload_lora(ct)
    assert torch.equal(ct(**kw, return_dict=False)[0], base) and ct.builds == 1
