"""The fused PRX attention (``attention: fused``): processor swap, export, and numbers against eager."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_prx import apply_rope

from prx_compile import compile_prx
from prx_compile.export import example_inputs, export_step
from prx_compile.models.prx import FusedPRXAttnProcessor, fused_attention_processors
from prx_compile.ops import PRX_ATTENTION, qk_norm_rope_torch
from prx_compile.tools.bench import max_abs_err, rel_err
from prx_compile.tools.testing import make_prx

RANGE = dict(batch=[1, 2], text_len=[1, 12], resolution=128, aspect_bins=[], device="cpu")


def processors(model):
    return [type(m.processor).__name__ for m in model.modules() if type(m).__name__ == "PRXAttention"]


def test_swap_is_temporary_and_skips_custom_processors():
    model = make_prx()
    before = processors(model)
    with fused_attention_processors(model) as n:
        assert n == len(before) > 0
        assert set(processors(model)) == {"FusedPRXAttnProcessor"}
    assert processors(model) == before
    attn = next(m for m in model.modules() if type(m).__name__ == "PRXAttention")
    attn.processor = FusedPRXAttnProcessor()  # not diffusers' processor: left alone
    with fused_attention_processors(model) as n:
        assert n == len(before) - 1
    with fused_attention_processors(model, enabled=False) as n:
        assert n == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_reference_is_diffusers_arithmetic(dtype):
    g = torch.Generator().manual_seed(0)
    b, seq, h, d = 2, 10, 3, 16
    x = torch.randn(b, seq, 3, h, d, generator=g).to(dtype)[:, :, 1]  # strided, like a QKV slice
    norm = RMSNorm(d, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
    theta = torch.randn(b, seq, d // 2, generator=g)
    rope = torch.stack([theta.cos(), -theta.sin(), theta.sin(), theta.cos()], -1)
    rope = rope.reshape(b, seq, d // 2, 2, 2)
    with torch.no_grad():
        ref = apply_rope(norm(x.transpose(1, 2)), rope[:, None]).transpose(1, 2)  # diffusers' (B,H,L,D)
        got = qk_norm_rope_torch(x, norm.weight, 1e-6, rope)
    assert got.dtype == ref.dtype and torch.equal(got, ref)
    with torch.no_grad():
        assert torch.equal(qk_norm_rope_torch(x, norm.weight, 1e-6), norm(x))


_NORM_ROPE_CHECK = """
import torch
from prx_compile.ops import kernels
from prx_compile.ops import qk_norm_rope_torch

g = torch.Generator().manual_seed(1)
b, seq, h, d = 2, 7, 3, 16  # 42 rows: not a multiple of the kernel's 16-row blocks
qkv = torch.randn(b, seq, 3, h, d, generator=g) * 3  # q, k, v: strided slices, as of a fused QKV
w = 1 + 0.3 * torch.randn(d, generator=g)
theta = torch.randn(b, seq, d // 2, generator=g) * 3
rope = torch.stack([theta.cos(), -theta.sin(), theta.sin(), theta.cos()], -1).reshape(b, seq, d // 2, 2, 2)
for r in (rope, None):
    got, v = kernels.qk_norm_rope(qkv[:, :, 1], w, 1e-6, r, qkv[:, :, 2])
    torch.testing.assert_close(got, qk_norm_rope_torch(qkv[:, :, 1], w, 1e-6, r), rtol=1e-5, atol=1e-5)
    assert got.is_contiguous() and torch.equal(v, qkv[:, :, 2])
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
def test_triton_norm_rope_kernel_in_the_interpreter():
    """The Triton Q/K norm + RoPE kernel's indexing (row blocks, RoPE pairs, strided q/k/v, a
    partial last block) on the CPU through TRITON_INTERPRET, in fp32 (the interpreter's bf16 casts
    do not round as the GPU does; tests/gpu compares bf16 on the device). In a new process: the
    interpreter must be on before triton is first imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", _NORM_ROPE_CHECK], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_export_has_one_prx_attention_per_block_and_no_sdpa():
    model = make_prx()
    kw = example_inputs(model, 2, 16, 16, 12, masked_tokens=5)
    gm = export_step(model, kw, fuse_attention=True)[0].module()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(PRX_ATTENTION) == model.config.depth
    assert not any("scaled_dot_product" in str(t) for t in targets)


@pytest.mark.parametrize("masked", [0, 5, 12])  # text tokens hidden in row 1: none, some, all
def test_compiled_fused_matches_eager_fp32(masked):
    model = make_prx()
    kw = example_inputs(model, 2, 16, 16, 12, masked_tokens=masked, seed=masked)
    with torch.no_grad():
        ref = model(**kw, return_dict=False)[0]
    ct = compile_prx(model, backend="eager", **RANGE)
    out = ct(**kw, return_dict=False)[0]
    assert ct.report()["torch_ops"] == {"prx_compile.prx_attention.default": model.config.depth}
    assert max_abs_err(out, ref) <= 1e-5 and rel_err(out, ref) <= 1e-6
    assert torch.isfinite(out).all()
    assert set(processors(model)) == {"PRXAttnProcessor2_0"}  # the user's model is unchanged


def test_fused_switch_off_uses_the_lowering_rule():
    model = make_prx()
    kw = example_inputs(model, 1, 16, 16, 7)
    ct = compile_prx(model, backend="eager", attention="flash", **RANGE)
    out = ct(**kw, return_dict=False)[0]
    assert set(ct.report()["torch_ops"]) == {"prx_compile.joint_attention.default"}
    with torch.no_grad():
        assert max_abs_err(out, model(**kw, return_dict=False)[0]) <= 1e-5


def test_attention_mask_none_equals_all_true():
    attn = next(m for m in make_prx().modules() if type(m).__name__ == "PRXAttention")
    proc = FusedPRXAttnProcessor()
    g = torch.Generator().manual_seed(1)
    x, txt = torch.randn(2, 64, attn.query_dim, generator=g), torch.randn(2, 12, attn.query_dim, generator=g)
    with torch.no_grad():
        a = proc(attn, x, txt, None)
        b = proc(attn, x, txt, torch.ones(2, 12, dtype=torch.bool))
        ref = attn(x, txt, None)
    assert torch.equal(a, b)
    assert max_abs_err(a, ref) <= 1e-5
    with pytest.raises(ValueError, match="attention_mask shape"):
        proc(attn, x, txt, torch.ones(2, 11, dtype=torch.bool))
