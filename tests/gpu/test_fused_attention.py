"""The fused PRX attention on CUDA: the Triton norm/RoPE kernel and ``prx_attention`` against
PyTorch, and compile_prx with and without the fusion against eager (bf16, small PRX)."""

import pytest
import torch

from prx_compile import compile_prx
from prx_compile.ops import kernels, prx_attention, qk_norm_rope_torch
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX, fused_op
from .test_tensorrt import TOL, eager, inputs

pytestmark = pytest.mark.gpu


def rand(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)


def rotations(b, seq, half, seed=0):
    theta = rand(b, seq, half, seed=seed, dtype=torch.float32) * 10
    return torch.stack([theta.cos(), -theta.sin(), theta.sin(), theta.cos()], -1).reshape(b, seq, half, 2, 2)


def cpu_fp32(a):
    if not isinstance(a, torch.Tensor):
        return a
    return a.cpu().float() if a.is_floating_point() else a.cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_norm_rope_matches_pytorch(dtype):
    b, seq, h, d = 2, 300, 28, 64
    qkv = rand(b, seq, 3, h, d, dtype=dtype)
    w = 1 + 0.3 * rand(d, seed=1, dtype=dtype)
    rope = rotations(b, seq, d // 2)
    got, v = kernels.qk_norm_rope(qkv[:, :, 1], w, 1e-6, rope, qkv[:, :, 2])
    ref = qk_norm_rope_torch(qkv[:, :, 1], w, 1e-6, rope)
    assert torch.equal(v, qkv[:, :, 2]) and v.is_contiguous()
    assert rel_err(got, ref) < 1e-3, rel_err(got, ref)  # rsqrt / FMA rounding only
    assert (got == ref).float().mean() > 0.9
    got, _ = kernels.qk_norm_rope(qkv[:, :, 0], w, 1e-6)
    assert rel_err(got, qk_norm_rope_torch(qkv[:, :, 0], w, 1e-6)) < 1e-3


@pytest.mark.parametrize("hidden", [0, 3, 16])  # text tokens hidden in row 1
def test_prx_attention_cuda_matches_cpu_reference(hidden):
    b, seq, t, h, d = 2, 256, 16, 4, 64
    img_qkv, txt_kv = rand(b, seq, 3 * h * d), rand(b, t, 2 * h * d, seed=1)
    mask = torch.ones(b, t, dtype=torch.bool, device="cuda")
    mask[1, t - hidden :] = False
    rope = rotations(b, seq, d // 2, seed=2)[:, None]
    ws = [1 + 0.3 * rand(d, seed=s) for s in (3, 4, 5)]
    args = (img_qkv, txt_kv, mask, rope, *ws, h, 1e-6, d**-0.5)
    got = prx_attention(*args)
    ref = prx_attention(*map(cpu_fp32, args))  # the PyTorch fallback, in fp32
    assert got.shape == (b, seq, h * d) and torch.isfinite(got).all()
    assert rel_err(got.cpu(), ref) < 1e-2, rel_err(got.cpu(), ref)


@pytest.mark.parametrize("fused", [True, False])
def test_compile_prx_fused_switch(fused):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, attention="fused" if fused else "flash", **RANGE)
    for masked in (0, 64):
        kw = inputs(model, masked=masked, seed=masked)
        out = ct(**kw, return_dict=False)[0]
        assert rel_err(out, eager(model, kw)) < TOL
    rep = ct.report()
    op = fused_op(rep) if fused else "prx_compile.joint_attention.default"
    assert rep["torch_ops"] == {op: SMALL_PRX["depth"]}, rep["torch_ops"]
    assert rep["engines"] == SMALL_PRX["depth"] + 1
