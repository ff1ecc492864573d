"""``attention_kernel: cudnn`` on CUDA: ``prx_attention_cudnn`` (the key-padding layout written by the
norm/RoPE kernels, one cuDNN call) against exact fp32 attention and the split path, and compile_prx
with it against eager (bf16, small PRX). Needs cuDNN's frontend (``pip install nvidia-cudnn-frontend``)."""

import pytest
import torch

from prx_compile import compile_prx
from prx_compile.ops import cudnn_attention, kernels, prx_attention, prx_attention_cudnn
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX
from .test_fused_attention import cpu_fp32, rand, rotations
from .test_tensorrt import TOL, eager, inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not cudnn_attention.installed(), reason="needs cuDNN's frontend (nvidia-cudnn-frontend)"
    ),
]


def attention_args(b=2, seq=256, t=64, h=4, d=64, kept=(1, 40)):
    img_qkv, txt_kv = rand(b, seq, 3 * h * d), rand(b, t, 2 * h * d, seed=1)
    mask = torch.zeros(b, t, dtype=torch.bool, device="cuda")
    for i in range(b):
        mask[i, torch.randperm(t, generator=torch.Generator().manual_seed(i))[: kept[i % len(kept)]]] = True
    rope = rotations(b, seq, d // 2, seed=2)[:, None]
    ws = [1 + 0.3 * rand(d, seed=s) for s in (3, 4, 5)]
    return [img_qkv, txt_kv, mask, rope, *ws, h, 1e-6, d**-0.5]


def test_frontend_binds_torchs_cudnn():
    cudnn = cudnn_attention.frontend()
    assert cudnn is not None and cudnn.backend_version() == torch.backends.cudnn.version()


@pytest.mark.parametrize("kept", [(1, 40), (64, 0), (7, 64)])  # scattered kept tokens; none; all
def test_matches_exact_attention_and_the_split_path(kept):
    args = attention_args(kept=kept)
    got = prx_attention_cudnn(*args)
    ref = prx_attention(*map(cpu_fp32, args))  # PyTorch ops in fp32
    split = prx_attention(*args)
    assert got.shape == split.shape and torch.isfinite(got).all()
    assert rel_err(got.cpu(), ref) < 1e-2, rel_err(got.cpu(), ref)
    assert rel_err(got, split) < 1e-2, rel_err(got, split)


def test_padded_text_tokens_do_not_matter():
    """Garbage, infinities and NaN in the text tokens the mask drops change nothing, bit for bit."""
    args = attention_args()
    base = prx_attention_cudnn(*args)
    txt = args[1].clone().view(2, 64, 2, -1)
    txt[~args[2]] = float("nan")
    txt[~args[2], 0, :8] = float("inf")
    args[1] = txt.view(2, 64, -1)
    assert torch.equal(prx_attention_cudnn(*args), base)


def test_layout_written_by_the_kernels():
    """[image keys; kept text keys in order; zeros] and the sequence lengths, from the norm/RoPE kernel."""
    b, seq, t, h, d = 2, 32, 16, 2, 64
    x, v = rand(b, t, h, d), rand(b, t, h, d, seed=1)
    w = 1 + 0.3 * rand(d, seed=3)
    mask = torch.zeros(b, t, dtype=torch.bool, device="cuda")
    mask[0, [2, 5, 11]] = True
    keys = torch.full((b, seq + t, h, d), 3.0, device="cuda", dtype=torch.bfloat16)
    values = keys.clone()
    lengths = cudnn_attention.seq_buffer(b, keys.device)
    kernels.qk_norm_rope_into(x, w, 1e-6, None, v, keys, values, seq, mask, lengths, seq)
    normed, _ = kernels.qk_norm_rope(x, w, 1e-6)
    assert torch.equal(keys[0, seq : seq + 3], normed[0, [2, 5, 11]])
    assert torch.equal(values[0, seq : seq + 3], v[0, [2, 5, 11]])
    assert (keys[0, seq + 3 :] == 0).all() and (values[1, seq:] == 0).all()
    assert (keys[:, :seq] == 3).all()  # rows before the offset are not touched
    assert lengths[:, :b].tolist() == [[seq, seq], [seq + 3, seq]]


def test_captured_in_a_cuda_graph():
    args = attention_args()
    eager_out = prx_attention_cudnn(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prx_attention_cudnn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prx_attention_cudnn(*args)
    args[2][1, :5] = ~args[2][1, :5]  # a new mask, read by the replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, prx_attention_cudnn(*args)) and not torch.equal(out, eager_out)


@pytest.mark.parametrize("kernel", ["cudnn", "split"])
def test_compile_prx_attention_kernel(kernel):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, attention_kernel=kernel, **RANGE)
    for masked in (0, 40, 64):
        kw = inputs(model, masked=masked, seed=masked)
        out = ct(**kw, return_dict=False)[0]
        assert not out.isnan().any() and rel_err(out, eager(model, kw)) < TOL
    op = "prx_attention_cudnn" if kernel == "cudnn" else "prx_attention"
    assert ct.report()["torch_ops"] == {f"prx_compile.{op}.default": SMALL_PRX["depth"]}
