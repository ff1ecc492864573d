"""``attention_kernel: flash4`` on a Hopper GPU: ``prx_attention_flash4`` (the key-padding layout written
by the norm/RoPE kernels, one FlashAttention-4 call) against exact fp32 attention, the split path and
the cuDNN call, garbage in the dropped text tokens, CUDA-graph replay with a new mask, and
compile_prx with it against eager (bf16, small PRX). Needs ``flash-attn-4`` (the ``flash4`` extra)."""

import pytest
import torch

from prx_compile import compile_prx
from prx_compile.ops import flash4_attention, library, prx_attention, prx_attention_flash4
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX
from .test_cudnn_attention import attention_args
from .test_fused_attention import cpu_fp32
from .test_tensorrt import TOL, eager, inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (
            flash4_attention.installed()
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] == 9
        ),
        reason="needs FlashAttention-4 (flash-attn-4) and a Hopper GPU",
    ),
]


def test_the_op_runs_flash_attention_4():
    args = attention_args()
    qkv = args[0].reshape(2, 256, 3, 4, 64)
    assert library._padded_kernel("flash4", qkv, args[4], 64) is flash4_attention


@pytest.mark.parametrize("kept", [(1, 40), (64, 0), (7, 64)])  # scattered kept tokens; none; all
def test_matches_exact_attention_the_split_path_and_cudnn(kept):
    args = attention_args(kept=kept)
    got = prx_attention_flash4(*args)
    ref = prx_attention(*map(cpu_fp32, args))  # PyTorch ops in fp32
    split = prx_attention(*args)
    assert got.shape == split.shape and torch.isfinite(got).all()
    assert rel_err(got.cpu(), ref) < 1e-2, rel_err(got.cpu(), ref)
    assert rel_err(got, split) < 1e-2, rel_err(got, split)
    assert rel_err(got, torch.ops.prx_compile.prx_attention_cudnn(*args)) < 1e-2


def test_padded_text_tokens_do_not_matter():
    """Garbage, infinities and NaN in the text tokens the mask drops change nothing, bit for bit."""
    args = attention_args()
    base = prx_attention_flash4(*args)
    txt = args[1].clone().view(2, 64, 2, -1)
    txt[~args[2]] = float("nan")
    txt[~args[2], 0, :8] = float("inf")
    args[1] = txt.view(2, 64, -1)
    assert torch.equal(prx_attention_flash4(*args), base)


def test_captured_in_a_cuda_graph():
    args = attention_args()
    eager_out = prx_attention_flash4(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prx_attention_flash4(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prx_attention_flash4(*args)
    args[2][1, :5] = ~args[2][1, :5]  # a new mask, read by the replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, prx_attention_flash4(*args)) and not torch.equal(out, eager_out)


def test_compile_prx_attention_kernel_flash4():
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, attention_kernel="flash4", **RANGE)
    for masked in (0, 40, 64):
        kw = inputs(model, masked=masked, seed=masked)
        out = ct(**kw, return_dict=False)[0]
        assert not out.isnan().any() and rel_err(out, eager(model, kw)) < TOL
    assert ct.report()["torch_ops"] == {"prx_compile.prx_attention_flash4.default": SMALL_PRX["depth"]}
