"""precision: fp8 on the GPU: the Triton row quantiser against the torch one, the FP8 GEMM op, and
compile_prx (TensorRT) with fp8 against the fp8 and bf16 eager models, under the text mask, with a LoRA."""

import pytest
import torch

from prx_compile import compile_prx, fp8, load_lora, set_lora, unload_lora
from prx_compile._kernels import row_quant_fp8, row_quant_fp8_torch
from prx_compile.bench import rel_err
from prx_compile.lora import make_random_lora
from prx_compile.testing import make_prx

from .conftest import RANGE, SMALL_PRX
from .test_tensorrt import eager, inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("k", [64, 1792, 7168])
def test_triton_row_quant_equals_the_torch_one(k):
    x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16) * 3
    q, s = row_quant_fp8(x)
    q_ref, s_ref = row_quant_fp8_torch(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # the same fp8 codes, but for the rare value a division rounds across a code boundary
    assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean() < 1e-3


def test_fp8_linear_on_cuda_matches_its_definition():
    x = torch.randn(2, 500, 1792, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5376, 1792, device="cuda", dtype=torch.bfloat16) * 0.02
    w8, ws = fp8.quantize_weight(w)
    out = torch.ops.prx_compile.fp8_linear(x, w8, ws, None)
    q, s = row_quant_fp8_torch(x.reshape(-1, 1792))
    definition = ((q.float() * s) @ (w8.float() * ws[:, None]).T).view(2, 500, 5376)
    assert out.dtype == torch.bfloat16 and rel_err(out, definition) < 1e-2
    assert rel_err(out, x @ w.T) < 6e-2


def test_compiled_fp8_matches_eager_under_the_mask_with_a_lora():
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    full = {m: eager(model, inputs(model, masked=m, seed=m)) for m in (0, 40, 64)}
    ct = compile_prx(model, precision="fp8", static=True, specialize=[[512, 512, 2]], **RANGE).build()
    rep = ct.report()
    assert rep["torch_ops"].get("prx_compile.fp8_linear.default") == 6 * SMALL_PRX["depth"], rep["torch_ops"]
    for masked, ref in full.items():
        kw = inputs(model, masked=masked, seed=masked)
        out = ct(**kw, return_dict=False)[0]
        assert not out.isnan().any()
        assert rel_err(out, eager(model, kw)) < 2e-2  # the same fp8 model, eager
        assert rel_err(out, ref) < 5e-2  # against bf16
    kw = inputs(model)
    base = ct(**kw, return_dict=False)[0].clone()
    load_lora(ct, make_random_lora(model, 16, seed=1, std=0.1), "a")
    load_lora(ct, make_random_lora(model, 16, seed=2, std=0.1), "b", scale=0.0)
    out_a = ct(**kw, return_dict=False)[0].clone()
    err = rel_err(out_a, eager(model, kw))
    assert err < 2e-2 and rel_err(out_a, base) > 2 * err  # the LoRA shows through the fp8 noise
    set_lora(ct, "b")
    set_lora(ct, "a")
    assert torch.equal(ct(**kw, return_dict=False)[0], out_a)
    unload_lora(ct)
    assert torch.equal(ct(**kw, return_dict=False)[0], base)
