"""FP8 joint attention on the GPU: the Triton kernels against exact attention and against their
PyTorch twin (the same block quantisation), padded text keys, one valid text token, CUDA graphs,
and compile_prx's fp8 preset with and without ``fp8_attention`` against eager (small PRX)."""

import pytest
import torch

from prx_compile import compile_prx
from prx_compile.ops import fp8_attention as fa
from prx_compile.ops import library
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX
from .test_tensorrt import eager, inputs

pytestmark = pytest.mark.gpu


def case(b=2, lq=1000, la=77, lb=1000, h=4, d=64, kept=(50, 1), sharp=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        x = torch.randn(*s, generator=g)
        return x

    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    q = (norm(r(b, lq, h, d)) * sharp).to("cuda", torch.bfloat16)
    k_a, v_a = norm(r(b, la, h, d)).to("cuda", torch.bfloat16), r(b, la, h, d).to("cuda", torch.bfloat16)
    k_b, v_b = norm(r(b, lb, h, d)).to("cuda", torch.bfloat16), r(b, lb, h, d).to("cuda", torch.bfloat16)
    mask = torch.zeros(b, la, dtype=torch.bool)
    for i in range(b):
        mask[i, : kept[i % len(kept)]] = True
    return q, k_a, v_a, mask.cuda(), k_b, v_b


def exact(q, k_a, v_a, mask, k_b, v_b, scale):
    keep = torch.cat([mask, torch.ones(k_b.shape[:2], dtype=torch.bool, device=mask.device)], 1)
    return library._reference(
        q.float(), torch.cat([k_a, k_b], 1).float(), torch.cat([v_a, v_b], 1).float(), keep, scale
    )


@pytest.mark.parametrize(
    "shape", [dict(), dict(lq=129, la=1, lb=300, kept=(1,)), dict(b=1, la=256, kept=(256,))]
)
def test_kernels_match_their_twin_and_stay_near_exact_attention(shape):
    x = case(**shape)
    scale = 64**-0.5
    assert fa.supported(x[0])
    got = fa.joint_attention_fp8(*x, scale)
    assert got.shape == x[0].shape and got.dtype == torch.bfloat16 and not got.isnan().any()
    ref = exact(*x, scale)
    err = rel_err(got, ref)
    assert 1e-2 < err < 8e-2, err  # FP8: not silently bf16; random data is the worst case (CPU tests)
    assert rel_err(got, fa.joint_attention_fp8_torch(*x, scale)) < 5e-2  # + P in e4m3


def test_padded_text_keys_contribute_nothing():
    q, k_a, v_a, mask, k_b, v_b = case(kept=(20, 1))
    scale = 0.125
    clean = fa.joint_attention_fp8(q, k_a, v_a, mask, k_b, v_b, scale)
    dirty_k = k_a.masked_fill(~mask[:, :, None, None], 3e4)
    dirty_v = v_a.masked_fill(~mask[:, :, None, None], -3e4)
    torch.testing.assert_close(
        fa.joint_attention_fp8(q, dirty_k, dirty_v, mask, k_b, v_b, scale), clean, rtol=0, atol=0
    )


def test_the_op_runs_inside_a_cuda_graph():
    x = case()
    eager_out = fa.joint_attention_fp8(*x, 0.125)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fa.joint_attention_fp8(*x, 0.125)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fa.joint_attention_fp8(*x, 0.125)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)


def test_fp8_preset_with_fp8_attention_against_eager():
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    kw = inputs(model)
    ref = eager(model, kw)
    with_fa = compile_prx(model, precision="fp8", dtype="bf16", fp8_attention=True, **RANGE)
    out = with_fa(**kw, return_dict=False)[0]
    ops_run = with_fa.report()["torch_ops"]
    assert ops_run.get("prx_compile.prx_attention_fp8.default") == len(model.blocks)
    without = compile_prx(
        make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda"),
        precision="fp8",
        dtype="bf16",
        fp8_attention=False,
        **RANGE,
    )
    out_bf16_attn = without(**kw, return_dict=False)[0]
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 2e-2 and rel_err(out_bf16_attn, ref) < 2e-2
    assert rel_err(out, out_bf16_attn) > 0  # the switch changes the kernels
