"""GPU helpers for the attention ops: merge two partial attentions by their log-sum-exp.

``merge`` is one fused Triton kernel on CUDA (triton ships with CUDA builds of torch) and
``merge_torch`` the same arithmetic in PyTorch ops (CPU, or CUDA without triton).
"""

from __future__ import annotations

import torch


def _clean_lse(lse: torch.Tensor) -> torch.Tensor:
    """Non-finite log-sum-exp (a part with no keys: -inf, +inf or NaN by kernel) -> -inf."""
    return torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("-inf")))


def merge_torch(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted sum of two partial attentions.

    o1, o2: (B, Lq, H, D) outputs of attention over two disjoint key sets; lse1, lse2: (B, H, Lq)
    their log-sum-exp. Returns (B, Lq, H, D) contiguous, in o1's dtype; a row with no keys in
    either part is 0.
    """
    acc = torch.promote_types(o1.dtype, torch.float32)  # fp32 for half inputs, fp64 stays fp64
    l1, l2 = _clean_lse(lse1.to(acc)), _clean_lse(lse2.to(acc))
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    s = w1 + w2
    s = torch.where(s == 0, torch.ones_like(s), s)
    w1 = (w1 / s).transpose(1, 2)[..., None]  # (B, Lq, H, 1)
    w2 = (w2 / s).transpose(1, 2)[..., None]
    x1 = torch.where(w1 > 0, o1.to(acc) * w1, torch.zeros((), device=o1.device, dtype=acc))
    x2 = torch.where(w2 > 0, o2.to(acc) * w2, torch.zeros((), device=o2.device, dtype=acc))
    return (x1 + x2).to(o1.dtype).contiguous()


_TRITON_KERNEL = None


def _triton_kernel():
    global _TRITON_KERNEL
    if _TRITON_KERNEL is not None:
        return _TRITON_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_kernel(
        o1,
        o2,
        l1,
        l2,
        out,
        n_rows,
        Lq,
        H,
        s1b,
        s1q,
        s1h,
        s2b,
        s2q,
        s2h,
        t1b,
        t1h,
        t1q,
        t2b,
        t2h,
        t2q,
        D: tl.constexpr,
        BD: tl.constexpr,
        BR: tl.constexpr,
    ):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = r < n_rows
        h = r % H
        t = r // H
        qi = t % Lq
        b = t // Lq
        a = tl.load(l1 + b * t1b + h * t1h + qi * t1q, mask=rm, other=float("-inf"))
        c = tl.load(l2 + b * t2b + h * t2h + qi * t2q, mask=rm, other=float("-inf"))
        a = tl.where((a == a) & (a != float("inf")), a, float("-inf"))
        c = tl.where((c == c) & (c != float("inf")), c, float("-inf"))
        m = tl.maximum(a, c)
        m = tl.where(m == float("-inf"), 0.0, m)
        w1 = tl.exp(a - m)
        w2 = tl.exp(c - m)
        s = w1 + w2
        s = tl.where(s == 0, 1.0, s)
        w1 = w1 / s
        w2 = w2 / s
        cols = tl.arange(0, BD)
        mk = rm[:, None] & (cols < D)[None, :]
        x1 = tl.load(o1 + (b * s1b + qi * s1q + h * s1h)[:, None] + cols[None, :], mask=mk, other=0.0)
        x2 = tl.load(o2 + (b * s2b + qi * s2q + h * s2h)[:, None] + cols[None, :], mask=mk, other=0.0)
        y = tl.where(w1[:, None] > 0, x1.to(tl.float32) * w1[:, None], 0.0)
        y += tl.where(w2[:, None] > 0, x2.to(tl.float32) * w2[:, None], 0.0)
        tl.store(out + (r * D)[:, None] + cols[None, :], y.to(out.dtype.element_ty), mask=mk)

    _TRITON_KERNEL = (_merge_kernel, triton)
    return _TRITON_KERNEL


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """``merge_torch`` as one Triton kernel when o1 is on CUDA and triton is importable."""
    if not (o1.is_cuda and triton_available()) or o1.stride(-1) != 1 or o2.stride(-1) != 1:
        return merge_torch(o1, lse1, o2, lse2)
    kernel, triton = _triton_kernel()
    b, lq, h, d = o1.shape
    out = torch.empty((b, lq, h, d), device=o1.device, dtype=o1.dtype)
    n_rows = b * lq * h
    br = 32
    kernel[(triton.cdiv(n_rows, br),)](
        o1,
        o2,
        lse1,
        lse2,
        out,
        n_rows,
        lq,
        h,
        o1.stride(0),
        o1.stride(1),
        o1.stride(2),
        o2.stride(0),
        o2.stride(1),
        o2.stride(2),
        lse1.stride(0),
        lse1.stride(1),
        lse1.stride(2),
        lse2.stride(0),
        lse2.stride(1),
        lse2.stride(2),
        D=d,
        BD=triton.next_power_of_2(d),
        BR=br,
    )
    return out
