"""FP8 attention on a CPU: the twin of the Triton kernels (block quantisation of Q, K, V, then exact
attention), the ``prx_attention_fp8`` op it serves, and the lowering rule that selects it."""

import pytest
import torch

from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import PRX_ATTENTION, PRX_ATTENTION_FP8, library
from prx_compile.ops import fp8_attention as fa
from prx_compile.tools.bench import rel_err


def case(b=2, lq=150, la=40, lb=150, h=3, d=32, kept=(25, 1), sharp=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)

    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    q = norm(torch.randn(b, lq, h, d, generator=g)) * sharp
    k_a, v_a = norm(torch.randn(b, la, h, d, generator=g)), torch.randn(b, la, h, d, generator=g)
    k_b, v_b = norm(torch.randn(b, lb, h, d, generator=g)), torch.randn(b, lb, h, d, generator=g)
    mask = torch.zeros(b, la, dtype=torch.bool)
    for i in range(b):
        mask[i, : kept[i % len(kept)]] = True
    return q, k_a, v_a, mask, k_b, v_b


def exact(q, k_a, v_a, mask, k_b, v_b, scale):
    keep = torch.cat([mask, torch.ones(k_b.shape[:2], dtype=torch.bool)], 1)
    return library._reference(
        q.double(), torch.cat([k_a, k_b], 1).double(), torch.cat([v_a, v_b], 1).double(), keep, scale
    )


def test_block_quantisation_uses_one_scale_per_block_and_head():
    x = torch.randn(2, 300, 3, 8, generator=torch.Generator().manual_seed(0))
    x[0, 5, 1, 0] = 1e6  # one outlier: only its (batch 0, block 0, head 1) falls into subnormals
    deq = fa._qdq_blocks(x, 128)
    err = (deq - x).abs() / x.abs().clamp(min=1e-3)
    others = (err[0, :128, 0].median(), err[0, 128:, 1].median(), err[1, :128, 1].median())
    assert all(err[0, :128, 1].median() > 10 * o for o in others)
    assert all(o < 0.05 for o in others)  # e4m3: 3 mantissa bits, half a step at most
    assert not torch.equal(deq, x)
    assert deq.shape == x.shape


@pytest.mark.parametrize("kept", [(25, 1), (40, 40), (1, 1)])
def test_twin_is_fp8_close_to_exact_attention_and_ignores_padded_keys(kept):
    q, k_a, v_a, mask, k_b, v_b = case(kept=kept)
    scale = 32**-0.5
    got = fa.joint_attention_fp8_torch(q, k_a, v_a, mask, k_b, v_b, scale)
    err = rel_err(got, exact(q, k_a, v_a, mask, k_b, v_b, scale))
    # random data is the worst case (near-uniform softmax: averaging shrinks the output, not the
    # error): about 2.6 % each from Q, K and V here; a wrong mask or scale is off by far more
    assert 1e-2 < err < 7e-2, err
    pad = ~mask[:, :, None, None]
    dirty = fa.joint_attention_fp8_torch(
        q, k_a.masked_fill(pad, 1e4), v_a.masked_fill(pad, -1e4), mask, k_b, v_b, scale
    )
    torch.testing.assert_close(dirty, got, rtol=0, atol=0)


def test_the_op_is_prx_attention_with_fp8_attention():
    b, seq, t, h, d = 2, 40, 12, 2, 16
    g = torch.Generator().manual_seed(1)
    img_qkv, txt_kv = torch.randn(b, seq, 3 * h * d, generator=g), torch.randn(b, t, 2 * h * d, generator=g)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[0, :7], mask[1, :1] = True, True
    w = 1 + 0.1 * torch.randn(d, generator=g)
    args = (img_qkv, txt_kv, mask, None, w, w, w, h, 1e-6, d**-0.5)
    full = torch.ops.prx_compile.prx_attention(*args)
    got = torch.ops.prx_compile.prx_attention_fp8(*args)
    assert got.shape == full.shape == (b, seq, h * d)
    assert 1e-3 < rel_err(got, full) < 5e-2
    qkv, kv = img_qkv.view(b, seq, 3, h, d), txt_kv.view(b, t, 2, h, d)
    q = library.qk_norm_rope_torch(qkv[:, :, 0], w, 1e-6)
    k = library.qk_norm_rope_torch(qkv[:, :, 1], w, 1e-6)
    tk = library.qk_norm_rope_torch(kv[:, :, 0], w, 1e-6)
    twin = fa.joint_attention_fp8_torch(q, tk, kv[:, :, 1], mask, k, qkv[:, :, 2], d**-0.5)
    torch.testing.assert_close(got, twin.reshape(b, seq, h * d), rtol=0, atol=0)


def test_lowering_rule_retargets_prx_attention_only_when_asked():
    def graph():
        g = torch.fx.Graph()
        a = [g.placeholder(n) for n in ("qkv", "kv", "mask", "w")]
        out = g.call_function(PRX_ATTENTION, (a[0], a[1], a[2], None, a[3], a[3], a[3], 2, 1e-6, 0.25))
        g.output(out)
        return torch.fx.GraphModule(torch.nn.Module(), g)

    def targets(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    assert targets(lower(graph(), LoweringSettings())) == [PRX_ATTENTION]
    assert targets(lower(graph(), LoweringSettings(fp8_attention=True))) == [PRX_ATTENTION_FP8]
