"""The Triton kernels of ``ops.fp8_attention`` (imported only when they first run: triton ships with
CUDA builds of torch). Layouts and arithmetic: ``ops.fp8_attention``'s docstring."""

import triton
import triton.language as tl


@triton.jit
def _quant_kv(
    ka, va, mask, kb, vb, k8, vt8, sk, sv, La, La_pad, Lb, Lk_pad, nkb, H,
    D: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # key positions: text at [0, La) (padded to La_pad, a multiple of BN), image at [La_pad, ...)
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    p = j * BN + tl.arange(0, BN)
    e = tl.arange(0, D)
    in_a = p < La
    in_b = (p >= La_pad) & (p < La_pad + Lb)
    keep = tl.load(mask + b * La + p, mask=in_a, other=0) != 0
    off_a = ((b * La + tl.where(in_a, p, 0)) * H + h) * D
    off_b = ((b * Lb + tl.where(in_b, p - La_pad, 0)) * H + h) * D
    ma = (in_a & keep)[:, None]
    mb = in_b[:, None]
    k = tl.load(ka + off_a[:, None] + e[None, :], mask=ma, other=0.0).to(tl.float32)
    k += tl.load(kb + off_b[:, None] + e[None, :], mask=mb, other=0.0).to(tl.float32)
    v = tl.load(va + off_a[:, None] + e[None, :], mask=ma, other=0.0).to(tl.float32)
    v += tl.load(vb + off_b[:, None] + e[None, :], mask=mb, other=0.0).to(tl.float32)
    s_k = tl.maximum(tl.max(tl.abs(k)), 1e-12) / 448.0
    s_v = tl.maximum(tl.max(tl.abs(v)), 1e-12) / 448.0
    tl.store(k8 + (bh * Lk_pad + p)[:, None] * D + e[None, :], (k / s_k).to(tl.float8e4nv))
    tl.store(vt8 + (bh * D + e)[None, :] * Lk_pad + p[:, None], (v / s_v).to(tl.float8e4nv))
    tl.store(sk + bh * nkb + j, s_k)
    tl.store(sv + bh * nkb + j, s_v)


@triton.jit
def _step(
    q8, c, acc, m, row_sum, k8, vt8, sk, sv, bh, j, Lk_pad, nkb, valid,
    D: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # one key block of the online softmax; P scaled by 2^8 (exp2(... + 8)): out of e4m3's
    # subnormals, and the row sum carries the same factor
    pos = j * BN + tl.arange(0, BN)
    e = tl.arange(0, D)
    kt = tl.load(k8 + (bh * Lk_pad + pos)[:, None] * D + e[None, :])  # (BN, D)
    s = tl.dot(q8, tl.trans(kt)) * (c * tl.load(sk + bh * nkb + j))
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None] + 8.0)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    vt = tl.load(vt8 + (bh * D + e)[:, None] * Lk_pad + pos[None, :])  # (D, BN)
    pv = tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
    acc = acc * alpha[:, None] + pv * tl.load(sv + bh * nkb + j)
    return acc, m_new, row_sum


@triton.jit
def _attention(
    q, k8, vt8, sk, sv, mask, o, Lq, La, La_pad, Lb, Lk_pad, nkb, H, qk_scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    r = i * BM + tl.arange(0, BM)
    e = tl.arange(0, D)
    n = tl.arange(0, BN)
    rows = (((b * Lq + r) * H + h) * D)[:, None] + e[None, :]
    qt = tl.load(q + rows, mask=(r < Lq)[:, None], other=0.0).to(tl.float32)
    s_q = tl.maximum(tl.max(tl.abs(qt)), 1e-12) / 448.0
    q8 = (qt / s_q).to(tl.float8e4nv)
    c = qk_scale * 1.4426950408889634 * s_q  # scores in log2 units
    m = tl.full([BM], float("-inf"), tl.float32)
    row_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for j in range(0, La_pad // BN):  # text blocks: the mask; a block with no kept key is skipped
        pos = j * BN + n
        keep = (tl.load(mask + b * La + pos, mask=pos < La, other=0) != 0) & (pos < La)
        if tl.max(keep.to(tl.int32), 0) > 0:
            acc, m, row_sum = _step(
                q8, c, acc, m, row_sum, k8, vt8, sk, sv, bh, j, Lk_pad, nkb, keep, D, BN, True
            )
    full = (La_pad + (Lb // BN) * BN) // BN
    for j in range(La_pad // BN, full):  # whole image blocks: no mask
        acc, m, row_sum = _step(
            q8, c, acc, m, row_sum, k8, vt8, sk, sv, bh, j, Lk_pad, nkb, n < BN, D, BN, False
        )
    if full < nkb:  # the last, partial image block
        valid = full * BN + n < La_pad + Lb
        acc, m, row_sum = _step(
            q8, c, acc, m, row_sum, k8, vt8, sk, sv, bh, full, Lk_pad, nkb, valid, D, BN, True
        )
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(o + rows, out.to(o.dtype.element_ty), mask=(r < Lq)[:, None])
