"""FLUX through TensorRT on the GPU: a small FLUX (two blocks of each kind, head dim 64) against eager
bf16, static and over a token range, with the attention on the plan's kernel, LoRA switched in place,
and FP8."""

import pytest
import torch

from prx_compile import compile_transformer, load_lora, set_lora, unload_lora
from prx_compile.export import example_inputs
from prx_compile.lora import make_random_lora
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_flux

pytestmark = pytest.mark.gpu

SMALL_FLUX = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=64,
    num_attention_heads=4,
    joint_attention_dim=128,
    pooled_projection_dim=64,
    guidance_embeds=True,
    axes_dims_rope=[8, 28, 28],
)
#: 256² pixels: 256 packed image tokens; 64 text tokens
CONFIG = dict(
    batch=[1, 2], text_len=[64, 64], resolution=256, aspect_bins=[], specialize=[[256, 256, 1]], static=True
)
TOL = 2e-2


def eager(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


@pytest.fixture(scope="module")
def flux():
    model = make_flux(SMALL_FLUX, dtype=torch.bfloat16, device="cuda")
    return model, compile_transformer(model, **CONFIG)


def test_the_engines_run_flux_as_eager_does(flux):
    model, ct = flux
    kw = example_inputs(model, 1, 256, 1, 64, dtype=torch.bfloat16, device="cuda")
    out = ct(**kw, return_dict=False)[0]
    assert rel_err(out, eager(model, kw)) < TOL
    rep = ct.report()
    assert rep["engines"] >= 1 and rep["torch_ops"].get("prx_compile.flux_attention.default") == 4, rep[
        "torch_ops"
    ]
    kernels = rep["kernels"]  # measured: every candidate timed, the fastest (or a near-tie's most exact) runs
    timed = {k.split("/", 1)[1]: v for k, v in kernels["ms"].items() if k.startswith("attention/")}
    assert kernels["how"] == "measured" and set(timed) == set(ct.plan.attention_candidates), kernels
    assert timed[kernels["attention"]] <= 1.02 * min(timed.values()), kernels
    kw2 = example_inputs(model, 2, 256, 1, 64, dtype=torch.bfloat16, device="cuda", seed=1)  # batch 2: split
    assert rel_err(ct(**kw2, return_dict=False)[0], eager(model, kw2)) < TOL


def test_a_lora_switches_in_place_and_comes_back_exactly(flux):
    model, ct = flux
    kw = example_inputs(model, 1, 256, 1, 64, dtype=torch.bfloat16, device="cuda", seed=2)
    base = ct(**kw, return_dict=False)[0].clone()
    load_lora(ct, make_random_lora(model, rank=8, seed=1, std=0.2), "a")
    with_a = ct(**kw, return_dict=False)[0].clone()
    assert rel_err(with_a, base) > 5e-2 and rel_err(with_a, eager(model, kw)) < TOL
    load_lora(ct, make_random_lora(model, rank=8, seed=2, std=0.2), "b")
    set_lora(ct, "a")
    assert torch.equal(ct(**kw, return_dict=False)[0], with_a)
    unload_lora(ct)
    assert torch.equal(ct(**kw, return_dict=False)[0], base)


def test_a_token_range_and_fp8():
    model = make_flux(SMALL_FLUX, dtype=torch.bfloat16, device="cuda")
    ct = compile_transformer(model, **{**CONFIG, "static": False, "aspect_bins": [], "batch": [1, 1]})
    from torch.export import Dim

    ct.set_expected_dynamic_shape_range(
        kwargs_dynamic_shape={"hidden_states": {1: Dim("l", min=64, max=512)}}
    )
    for tokens in (128, 400):
        kw = example_inputs(model, 1, tokens, 1, 64, dtype=torch.bfloat16, device="cuda", seed=tokens)
        assert rel_err(ct(**kw, return_dict=False)[0], eager(model, kw)) < TOL
    fp8 = compile_transformer(
        make_flux(SMALL_FLUX, dtype=torch.bfloat16, device="cuda"), precision="fp8", **CONFIG
    )
    kw = example_inputs(fp8.transformer, 1, 256, 1, 64, dtype=torch.bfloat16, device="cuda")
    ref = eager(make_flux(SMALL_FLUX, dtype=torch.bfloat16, device="cuda"), kw)
    assert rel_err(fp8(**kw, return_dict=False)[0], ref) < 6e-2


def test_fp8_inputs_quantised_once_between_the_engines():
    """Rules ``fp8_inputs`` and ``fp8_norm`` under TensorRT: each ``fp8_linears`` and the getitems
    that take its list apart run in PyTorch, the engines that wrote the GELUs and the concatenations
    are gone, the modulated norms run in the quantisation, and the step is the unfused one's but for
    a GELU or a norm rounded across an FP8 code now and then."""
    kw = example_inputs(make_flux(SMALL_FLUX), 1, 256, 1, 64, dtype=torch.bfloat16, device="cuda")
    outs, reports = [], []
    for inputs, norm in ((True, True), (True, False), (False, False)):
        model = make_flux(SMALL_FLUX, dtype=torch.bfloat16, device="cuda")
        ct = compile_transformer(model, precision="fp8", fp8_inputs=inputs, fp8_norm=norm, **CONFIG)
        outs.append(ct(**kw, return_dict=False)[0])
        reports.append(ct.report())
    both, inputs, off = reports
    assert both["torch_ops"]["prx_compile.fp8_linears.default"] == 6 * 2 + 2 * 2, both["torch_ops"]
    assert inputs["torch_ops"]["prx_compile.fp8_linears.default"] == 4 * 2 + 2 * 2, inputs["torch_ops"]
    assert "prx_compile.fp8_linears.default" not in off["torch_ops"], off["torch_ops"]
    assert inputs["engine_calls"] < off["engine_calls"], (inputs["engine_calls"], off["engine_calls"])
    assert both["engine_calls"] <= inputs["engine_calls"], (both["engine_calls"], inputs["engine_calls"])
    assert rel_err(outs[0], outs[2]) < 1e-2 and rel_err(outs[1], outs[2]) < 5e-3


def test_linear_glue_takes_the_gelus_and_concatenations_into_the_gemms():
    """Rule ``linear_glue`` (bf16, linears in cuBLAS): the feed-forwards' and single blocks' GELUs in
    their GEMMs' epilogues, the single blocks' concatenation split over two GEMMs, fewer engine
    calls, and the step the unfused one's within bf16 rounding; the ops against their compositions."""
    kw = example_inputs(make_flux(SMALL_FLUX), 1, 256, 1, 64, dtype=torch.bfloat16, device="cuda")
    outs, reports = [], []
    for on in (True, False):
        model = make_flux(SMALL_FLUX, dtype=torch.bfloat16, device="cuda")
        ct = compile_transformer(model, linear_glue=on, **CONFIG)
        outs.append(ct(**kw, return_dict=False)[0])
        reports.append(ct.report())
    on, off = reports
    assert on["torch_ops"]["prx_compile.linear_gelu.default"] == 2 * 2 + 2, on["torch_ops"]
    assert on["torch_ops"]["prx_compile.linear_cat.default"] == 2, on["torch_ops"]
    assert "prx_compile.linear_cat.default" not in off["torch_ops"], off["torch_ops"]
    assert on["engine_calls"] < off["engine_calls"], (on["engine_calls"], off["engine_calls"])
    assert rel_err(outs[0], outs[1]) < 5e-3
    x, a = (torch.randn(2, 300, k, device="cuda", dtype=torch.bfloat16) for k in (256, 128))
    w = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16) * 0.05
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    gelu = torch.ops.prx_compile.linear_gelu(x, w[:, :256], bias)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x, w[:, :256], bias), approximate="tanh")
    assert rel_err(gelu, ref) < 5e-3
    split = torch.ops.prx_compile.linear_cat(x, a, w, bias)
    assert rel_err(split, torch.nn.functional.linear(torch.cat([x, a], -1), w, bias)) < 5e-3


def test_the_fused_attention_kernels_match_diffusers_processor():
    """``flux_attention`` on the GPU (the Triton norm/RoPE pass writing the attention's buffers, then
    each dense kernel) against diffusers' own processor, eager, bf16: a wrong offset, rounding or
    rotation would be far over the bound."""
    from prx_compile.models.flux import fused_attention_processors
    from prx_compile.ops import ATTENTION_KERNELS

    model = make_flux(SMALL_FLUX, dtype=torch.bfloat16, device="cuda")
    kw = example_inputs(model, 2, 256, 1, 64, dtype=torch.bfloat16, device="cuda", seed=3)
    ref = eager(model, kw)
    for kernel in ATTENTION_KERNELS:
        with fused_attention_processors(model):
            model.transformer_blocks[0].attn.processor.kernel = kernel  # one processor, shared
            out = eager(model, kw)
        assert rel_err(out, ref) < 5e-3, kernel
