"""``prx_attention_cudnn_fp8`` on a CPU: its named fallback (cuDNN's FP8 SDPA's per-tensor quantisation
in PyTorch ops) against exact attention, the text mask exact under it, the scales' bounds, and how
``precision: fp8`` makes it a measured candidate. The kernels themselves (Triton + cuDNN) are held to
this fallback on the GPU (``tests/gpu/test_cudnn_fp8_attention.py``)."""

import pytest
import torch

from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import (
    FP8_LINEAR,
    PRX_ATTENTION,
    PRX_ATTENTION_CUDNN,
    PRX_ATTENTION_CUDNN_FP8,
    PRX_ATTENTION_CUDNN_FP8_LINEAR,
    cudnn_attention,
    kernels,
    library,
)
from prx_compile.ops.choice import KernelChoice
from prx_compile.quant import fp8

from .conftest import plan_of
from .test_cudnn_attention import op_args


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_fallback_is_attention_through_e4m3():
    """Close to exact attention (FP8's error), but not equal to it: the quantisation really runs."""
    args = op_args(b=2, seq=32, t=12, h=2, d=32)
    got = torch.ops.prx_compile.prx_attention_cudnn_fp8(*args)
    ref = torch.ops.prx_compile.prx_attention(*args)
    assert 1e-3 < rel(got, ref) < 8e-2


def test_the_text_mask_stays_exact():
    """Dropped text tokens contribute nothing, their values' size included (V's scale comes from the
    kept values only); one kept token works; a row with none attends the image keys alone."""
    args = op_args(b=2, seq=16, t=10, h=2, d=16)
    mask = args[2]
    base = torch.ops.prx_compile.prx_attention_cudnn_fp8(*args)
    txt = args[1].clone().view(2, 10, 2, 2, 16)
    txt[~mask] = 1e4 * torch.randn_like(txt[~mask])  # huge keys and values where the mask drops them
    args[1] = txt.view(2, 10, -1)
    assert torch.equal(torch.ops.prx_compile.prx_attention_cudnn_fp8(*args), base)
    one = torch.zeros_like(mask)
    one[:, 3] = True
    args[2] = one
    out = torch.ops.prx_compile.prx_attention_cudnn_fp8(*args)
    assert out.isfinite().all() and not torch.equal(out, base)


def test_q_and_k_never_saturate():
    """The bounds from the norm weights hold: RMS-normalised, weighted, rotated values times their
    multiplier stay within e4m3's 448, however the inputs are scaled."""
    img_qkv, txt_kv, mask, rope, wq, wk, wt, h, eps, _ = op_args(b=2, seq=16, t=8, h=2, d=16)
    b, seq, t, d = 2, 16, 8, 16
    qkv, kv = (1e3 * img_qkv).view(b, seq, 3, h, d), (1e-3 * txt_kv).view(b, t, 2, h, d)
    wq = wq * torch.linspace(-3, 3, d)  # large and signed weights
    sc = kernels.fp8_attention_scales_torch(kv[:, :, 1], mask, qkv[:, :, 2], wq, wk, wt)
    q = library.qk_norm_rope_torch(qkv[:, :, 0], wq, eps, rope[:, 0])
    k = library.qk_norm_rope_torch(qkv[:, :, 1], wk, eps, rope[:, 0])
    tk = library.qk_norm_rope_torch(kv[:, :, 0], wt, eps, None)
    assert (q.abs() * sc[kernels.MULT, 0]).max() <= 448
    assert (torch.cat([k, tk], 1).abs() * sc[kernels.MULT, 1]).max() <= 448
    assert (q.abs() * sc[kernels.MULT, 0]).max() > 448 / 16  # and use e4m3's range, not a corner of it
    kept_v = torch.cat([qkv[:, :, 2].flatten(), kv[:, :, 1][mask].flatten()])
    assert sc[kernels.AMAX_V, 0] == kept_v.abs().max()
    assert sc[kernels.SCALE_O, 0] * sc[kernels.DESCALE_V, 0] == pytest.approx(1.0)


def test_fp8_precision_measures_it_beside_our_kernels(monkeypatch):
    """With the ``cudnn`` extra, ``precision: fp8`` adds "cudnn_fp8" to the attention candidates; a
    choice of it lowers every ``prx_attention`` to ``prx_attention_cudnn_fp8``; the record takes it."""
    monkeypatch.setattr(cudnn_attention, "installed", lambda: True)
    plan = plan_of(precision="fp8")
    assert "cudnn_fp8" in plan.attention_candidates
    assert "cudnn_fp8" in plan_of(precision="fp8", fp8_attention=True).attention_candidates
    assert "cudnn_fp8" not in plan_of(precision="fp8", fp8_attention=False).attention_candidates
    assert "cudnn_fp8" not in plan_of().attention_candidates  # bf16
    choice = KernelChoice("cudnn_fp8", False, "measured")
    assert KernelChoice.from_json(choice.to_json()) == choice
    settings = plan.lowering(None, choice)
    assert settings.padded_attention == "cudnn_fp8" and not settings.fp8_attention
    monkeypatch.setattr(cudnn_attention, "installed", lambda: False)
    assert "cudnn_fp8" not in plan_of(precision="fp8").attention_candidates

    g = torch.fx.Graph()
    a = [g.placeholder(n) for n in ("qkv", "kv", "mask", "w")]
    g.output(g.call_function(PRX_ATTENTION, (a[0], a[1], a[2], None, a[3], a[3], a[3], 2, 1e-6, 0.25)))
    gm = lower(torch.fx.GraphModule(torch.nn.Module(), g), settings)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [PRX_ATTENTION_CUDNN_FP8]


def test_the_kernel_path_needs_cudnns_fp8_sdpa(monkeypatch):
    monkeypatch.setattr(kernels, "norm_rope_supported", lambda x: True)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    qkv = torch.zeros(2, 8, 3, 2, 16)
    for ok in (True, False):
        monkeypatch.setattr(cudnn_attention, "fp8_supported", lambda q, ok=ok: ok)
        want = cudnn_attention if ok else None
        assert library._padded_kernel("cudnn_fp8", qkv, torch.ones(16), 4) is want
    assert library._padded_kernel("cudnn_fp8", qkv, torch.ones(16), 0) is None  # no text token


def test_norm_rope_refuses_fp8_buffers_without_multipliers():
    x = torch.randn(1, 4, 2, 8)
    out = torch.empty(1, 4, 2, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="mult"):
        kernels.qk_norm_rope_into(x, torch.ones(8), 1e-6, None, None, out, None, 0)
    w, bf16 = torch.ones(8), out.float()
    with pytest.raises(ValueError, match="mult"):  # multipliers for a buffer that is not e4m3
        kernels.qk_norm_rope_into(x, w, 1e-6, None, None, bf16, None, 0, mult=torch.ones(3))


def fp8_weight(n, k, seed=3):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    return fp8.quantize_weight(w)


@pytest.mark.parametrize("bias", [False, True])
def test_attention_with_its_projection_is_the_composition_on_a_cpu(bias):
    args = op_args(b=2, seq=16, t=10, h=2, d=16)
    w8, ws = fp8_weight(48, 32)
    b = torch.randn(48) if bias else None
    got = torch.ops.prx_compile.prx_attention_cudnn_fp8_linear(*args, w8, ws, b)
    attention = torch.ops.prx_compile.prx_attention_cudnn_fp8(*args)
    assert torch.equal(got, torch.ops.prx_compile.fp8_linear(attention, w8, ws, b))
    with pytest.raises(ValueError, match="features|bias"):
        torch.ops.prx_compile.prx_attention_cudnn_fp8_linear(*args, *fp8_weight(48, 40), None)


def attention_then_linear(second_user=False):
    g = torch.fx.Graph()
    qkv, kv, mask, w, w8, ws = (g.placeholder(n) for n in ("qkv", "kv", "mask", "w", "w8", "ws"))
    att = g.call_function(PRX_ATTENTION, (qkv, kv, mask, None, w, w, w, 2, 1e-6, 0.25))
    out = g.call_function(FP8_LINEAR, (att, w8, ws, None))
    g.output((out, att) if second_user else out)
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize(
    "kind, second_user, expected",
    [
        ("cudnn_fp8", False, [PRX_ATTENTION_CUDNN_FP8_LINEAR]),
        ("cudnn_fp8", True, [PRX_ATTENTION_CUDNN_FP8, FP8_LINEAR]),  # the bf16 output is read too
        ("cudnn", False, [PRX_ATTENTION_CUDNN, FP8_LINEAR]),  # only an e4m3 output feeds the GEMM as it is
    ],
)
def test_rule_folds_the_projection_into_cudnn_fp8_only(kind, second_user, expected):
    gm = lower(attention_then_linear(second_user), LoweringSettings(padded_attention=kind))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == expected
    args = op_args(b=2, seq=16, t=10, h=2, d=16)
    inputs = (*args[:3], args[4], *fp8_weight(48, 32))
    got = gm(*inputs)
    w = args[4]
    exact = torch.ops.prx_compile.prx_attention(*args[:3], None, w, w, w, 2, 1e-6, 0.25)
    want = torch.ops.prx_compile.fp8_linear(exact, *fp8_weight(48, 32), None)
    got = got[0] if second_user else got
    assert 1e-3 < rel(got, want) < 8e-2 if kind == "cudnn_fp8" else torch.equal(got, want)


def test_a_prx_export_folds_every_projection():
    """Under ``precision: fp8`` every block's attention and its output projection become one op, and
    the lowered step stays within FP8's error of eager."""
    from prx_compile.export.step import example_inputs, export_step
    from prx_compile.models import spec_for
    from prx_compile.tools.testing import make_prx

    model = make_prx()
    kw = example_inputs(model, 2, 16, 16, 12, masked_tokens=5)
    with torch.no_grad():
        ref = model(**kw, return_dict=False)[0]
    fp8.install(model, spec_for(model).block_linears)
    gm = export_step(model, kw, fuse_attention=True)[0].module()
    gm = lower(gm, LoweringSettings(padded_attention="cudnn_fp8"))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(PRX_ATTENTION_CUDNN_FP8_LINEAR) == model.config.depth
    assert PRX_ATTENTION_CUDNN_FP8 not in targets
    with torch.no_grad():
        out = gm(**kw)
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert 0 < rel(out, ref) < 8e-2  # the blocks add small updates to the residual stream
