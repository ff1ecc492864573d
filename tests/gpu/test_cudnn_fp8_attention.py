"""``prx_attention_cudnn_fp8`` on CUDA: the Triton scales and e4m3 norm/RoPE kernels against their
PyTorch twins, the one cuDNN FP8 SDPA call against its named fallback and exact attention, the text
mask exact, and a CUDA graph of it replaying. Needs a Hopper GPU and cuDNN's frontend."""

import pytest
import torch

from prx_compile.ops import (
    cudnn_attention,
    kernels,
    library,
    prx_attention_cudnn_fp8,
    prx_attention_cudnn_fp8_linear,
)
from prx_compile.tools.bench import rel_err

from .test_cudnn_attention import attention_args
from .test_fused_attention import cpu_fp32, rand

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (cudnn_attention.installed() and torch.cuda.get_device_capability()[0] == 9),
        reason="needs cuDNN's frontend (nvidia-cudnn-frontend) on a Hopper GPU",
    ),
]


def fallback(args):
    """The named fallback (PyTorch ops, CPU, fp32 inputs): the same quantisation, exact attention."""
    return torch.ops.prx_compile.prx_attention_cudnn_fp8(*map(cpu_fp32, args))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kept", [(1, 40), (64, 0)])
def test_kernel_path_matches_its_fallback_and_exact_attention(d, kept):
    args = attention_args(b=2, seq=256, t=64, h=4, d=d, kept=kept)
    x = args[0].view(2, 256, 3, 4, d)[:, :, 0]
    assert library._padded_kernel("cudnn_fp8", args[0].view(2, 256, 3, 4, d), args[4], 64) is cudnn_attention
    assert cudnn_attention.fp8_supported(x)
    got = prx_attention_cudnn_fp8(*args)
    exact = torch.ops.prx_compile.prx_attention(*map(cpu_fp32, args))
    emulated = fallback(args)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    err, emulated_err = rel_err(got.cpu(), exact), rel_err(emulated, exact)
    assert 1e-3 < err < 8e-2, err  # FP8's error: present, bounded
    assert err < 1.5 * emulated_err, (err, emulated_err)  # no worse than the quantisation it claims


def test_scales_kernel_matches_its_twin():
    b, seq, t, h, d = 2, 256, 64, 4, 128
    args = attention_args(b=b, seq=seq, t=t, h=h, d=d)
    qkv, kv = args[0].view(b, seq, 3, h, d), args[1].view(b, t, 2, h, d)
    kv = kv.clone()
    kv[:, :, 1][~args[2]] = 1e4  # dropped values must not set V's scale
    got = kernels.fp8_attention_scales(kv[:, :, 1], args[2], qkv[:, :, 2], *args[4:7])
    want = kernels.fp8_attention_scales_torch(kv[:, :, 1], args[2], qkv[:, :, 2], *args[4:7])
    assert got[kernels.AMAX_V, 0] == want[kernels.AMAX_V, 0] < 100
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[kernels.MULT, :3], want[kernels.MULT, :3], rtol=1e-6, atol=0)


def test_norm_rope_writes_e4m3_by_the_multiplier():
    """The kernel's e4m3 Q is its fp32 result times the multiplier, cast once: the twin rounds the
    norm as diffusers does (bf16), applies RoPE in fp32, multiplies and casts. Only ties from the
    order of fp32 operations may differ: under 1 in 1000 elements, one e4m3 step apart."""
    b, seq, h, d = 2, 256, 4, 128
    args = attention_args(b=b, seq=seq, h=h, d=d)
    x, w, rope = args[0].view(b, seq, 3, h, d)[:, :, 0], args[4], args[3][:, 0]
    mult = torch.tensor([37.5, 1.0, 1.0, 0.0], device="cuda")
    q8 = torch.empty(b, seq, h, d, device="cuda", dtype=torch.float8_e4m3fn)
    kernels.qk_norm_rope_into(x, w, 1e-6, rope, None, q8, None, 0, mult=mult)
    y = library.qk_norm_rope_torch(x, w, 1e-6, None).float().view(b, seq, h, d // 2, 1, 2)
    rotated = (rope.float()[:, :, None] * y).sum(-1).view(b, seq, h, d)
    twin = (rotated * 37.5).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    got = q8.float()
    differ = got != twin
    assert differ.float().mean() < 1e-3, differ.float().mean()
    assert ((got - twin).abs()[differ] <= twin.abs()[differ] / 4).all()
    assert got.abs().max() > 448 / 16  # the multiplier was applied


def test_the_projection_reads_the_e4m3_output():
    """Attention and output projection in one op: the e4m3 attention is the GEMM's input as it is.
    Within FP8's error of the two ops composed, and no further from exact than they are."""
    from prx_compile.quant import fp8

    args = attention_args(d=128)
    weight = torch.randn(384, 512, generator=torch.Generator().manual_seed(7)) / 512**0.5
    w8, ws = (t.cuda() for t in fp8.quantize_weight(weight))
    bias = rand(384, seed=8)
    fused = prx_attention_cudnn_fp8_linear(*args, w8, ws, bias)
    composed = torch.ops.prx_compile.fp8_linear(prx_attention_cudnn_fp8(*args), w8, ws, bias)
    exact = torch.ops.prx_compile.prx_attention(*map(cpu_fp32, args))
    exact = torch.nn.functional.linear(exact, w8.cpu().float() * ws.cpu()[:, None], bias.cpu().float())
    assert fused.shape == (2, 256, 384) and fused.dtype == torch.bfloat16 and torch.isfinite(fused).all()
    assert rel_err(fused, composed) < 3e-2, rel_err(fused, composed)
    err, composed_err = rel_err(fused.cpu(), exact), rel_err(composed.cpu(), exact)
    assert err < 1.1 * composed_err + 1e-3, (err, composed_err)


def test_the_text_mask_stays_exact():
    """Anything in the dropped text tokens, NaN and infinities included, changes nothing, bit for bit."""
    args = attention_args(d=128)
    base = prx_attention_cudnn_fp8(*args)
    txt = args[1].clone().view(2, 64, 2, 4, 128)
    txt[~args[2]] = float("nan")
    txt[~args[2], 0, 0, :8] = float("inf")
    args[1] = txt.view(2, 64, -1)
    assert torch.equal(prx_attention_cudnn_fp8(*args), base)


def test_cuda_graph_replays_it():
    """Captured once, replayed on new inputs (new scales read on the device): as called directly."""
    args = attention_args(d=128)
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    prx_attention_cudnn_fp8(*static)  # builds the cuDNN graph before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prx_attention_cudnn_fp8(*static)
    fresh = attention_args(d=128, kept=(9, 3))
    for s, a in zip(static, fresh, strict=True):
        if isinstance(s, torch.Tensor):
            s.copy_(3 * a if a.is_floating_point() else a)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, prx_attention_cudnn_fp8(*static))
