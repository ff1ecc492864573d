"""The attention ops' CPU fallbacks and the log-sum-exp merge they use on the GPU."""

import torch

from prx_compile.ops import kernels
from prx_compile.ops.library import _reference, flash_attention, joint_attention


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def partial(q, k, v, mask, scale):
    """Exact attention over a subset of keys with its log-sum-exp: (out (B,Lq,H,D), lse (B,H,Lq))."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double()), lse


def test_lse_merge_is_exact_including_empty_parts():
    q, ka, kb = rand(2, 5, 3, 8), rand(2, 4, 3, 8, seed=1), rand(2, 6, 3, 8, seed=2)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1] = False  # row 1: the masked part has no keys at all
    ref = _reference(
        q.double(),
        torch.cat([ka, kb], 1).double(),
        torch.cat([ka, kb], 1).double(),
        torch.cat([mask, torch.ones(2, 6, dtype=torch.bool)], 1),
        0.3,
    )
    o1, l1 = partial(q, kb, kb, None, 0.3)
    o2, l2 = partial(q, ka, ka, mask, 0.3)
    merged = kernels.merge_torch(o1, l1, o2, l2)
    torch.testing.assert_close(merged, ref, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(merged).all()


def test_joint_attention_cpu_fallback_equals_sdpa():
    q, ka, va, kb, vb = (rand(2, 5, 3, 8, seed=i) for i in range(5))
    mask = torch.tensor([[True] * 5, [True, False, True, False, False]])
    out = joint_attention(q, ka, va, mask, kb, vb, 0.35)
    ref = _reference(
        q,
        torch.cat([ka, kb], 1),
        torch.cat([va, vb], 1),
        torch.cat([mask, torch.ones(2, 5, dtype=torch.bool)], 1),
        0.35,
    )
    assert torch.equal(out, ref)


def test_flash_attention_cpu_fallback_and_empty_rows():
    q, k, v = rand(2, 5, 3, 8), rand(2, 7, 3, 8, seed=1), rand(2, 7, 3, 8, seed=2)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1] = False
    out = flash_attention(q, k, v, mask, 0.3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    additive = torch.zeros(2, 7).masked_fill(~mask, float("-inf"))
    assert torch.equal(flash_attention(q, k, v, additive, 0.3)[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(flash_attention(q, k, v, additive, 0.3)[0], out[0])


def test_ops_are_exportable_and_keep_their_names():
    class M(torch.nn.Module):
        def forward(self, q, k, v, m):
            return torch.ops.prx_compile.flash_attention(q, k, v, m, 0.5)

    args = (rand(1, 4, 2, 8), rand(1, 6, 2, 8), rand(1, 6, 2, 8), torch.ones(1, 6, dtype=torch.bool))
    ep = torch.export.export(M(), args)
    assert any(n.target == torch.ops.prx_compile.flash_attention.default for n in ep.graph.nodes)
