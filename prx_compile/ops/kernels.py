"""GPU helpers for the attention ops, each a Triton kernel with a PyTorch twin.

* ``merge`` — two partial attentions merged by their log-sum-exp (``merge_torch``: same arithmetic
  in PyTorch ops, for CPU or CUDA without triton).
* ``qk_norm_rope`` — per-head RMSNorm, optional RoPE and a copy of the matching values, in one pass
  over a projection's output (``ops.qk_norm_rope_torch``: diffusers' arithmetic in PyTorch ops).
* ``row_quant_fp8`` — per-row FP8 quantisation of a GEMM input (``row_quant_fp8_torch``);
  ``rows_quant_fp8`` the same of ``cat([gelu_tanh(a) or a, gelu_tanh(b) or b], -1)`` in the same pass
  (``rows_quant_fp8_torch``).
* ``gelu_mul_quant_fp8`` — ``gelu_tanh(gate) * up`` quantised per row for the next FP8 GEMM, one pass
  (``gelu_mul_quant_fp8_torch``).

triton ships with CUDA builds of torch; it is imported only when a kernel first runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


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


_NORM_ROPE_KERNEL = None


def _norm_rope_kernel():
    global _NORM_ROPE_KERNEL
    if _NORM_ROPE_KERNEL is not None:
        return _NORM_ROPE_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _kernel(
        x, sxb, sxl, sxh, w, f, sfb, sfl, out, sob, oof, v, svb, svl, svh, vout, n_rows, L, H, eps,
        m, smb, T, seq, sqs, lq, mult,
        D: tl.constexpr, BR: tl.constexpr, HAS_ROPE: tl.constexpr, COPY_V: tl.constexpr,
        PACK: tl.constexpr, BT: tl.constexpr, ROUND_TWICE: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        # A program = BR rows (b, l, h) of D contiguous elements, each row and its rotations read
        # once, contiguously; RoPE pairs (2i, 2i + 1) are split apart and joined back in registers.
        # Row (b, l, h) goes to out[b * sob + (oof + l') * H * D + h * D]: l' = l, or with PACK the
        # rank of l among the kept tokens of row b of the mask m (kept tokens first, in order; the
        # others after them, zeroed), and seq[0, b] = lq, seq[1, b] = oof + kept for cuDNN.
        # With FP8, out and vout are e4m3: y x mult[0] and v x mult[1], clamped to +-448.
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = (r < n_rows)[:, None]
        h = r % H
        t = r // H
        tok = t % L
        b = t // L
        e = tl.arange(0, D)
        xv = tl.load(x + (b * sxb + tok * sxl + h * sxh)[:, None] + e[None, :], mask=rm, other=0.0)
        xf = xv.to(tl.float32)
        rs = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=1) / D + eps)
        wf = tl.load(w + e).to(tl.float32)[None, :]
        if ROUND_TWICE:  # diffusers' RMSNorm rounds to the (half) weight dtype before the weight product
            y = (xf * rs[:, None]).to(xv.dtype).to(tl.float32)
            y = (y * wf).to(xv.dtype).to(tl.float32)
        else:  # torch.nn.RMSNorm (FLUX) rounds once, after it
            y = (xf * rs[:, None] * wf).to(xv.dtype).to(tl.float32)
        if HAS_ROPE:
            # f[b, l] is (D/2, 2, 2): out[2i + j] = f[i, j, 0] x[2i] + f[i, j, 1] x[2i + 1]
            ye, yo = tl.split(tl.reshape(y, (BR, D // 2, 2)))
            q = tl.arange(0, 2 * D)  # one token's (D/2, 2, 2) table, flat
            fr = tl.load(f + (b * sfb + tok * sfl)[:, None] + q[None, :], mask=rm, other=0.0)
            f_k0, f_k1 = tl.split(tl.reshape(fr, (BR, D // 2, 2, 2)))  # f[i, j, 0], f[i, j, 1]
            f00, f10 = tl.split(f_k0)
            f01, f11 = tl.split(f_k1)
            y = tl.reshape(tl.join(f00 * ye + f01 * yo, f10 * ye + f11 * yo), (BR, D))
        dest = tok
        if PACK:
            j = tl.arange(0, BT)
            row = tl.load(m + b[:, None] * smb + j[None, :], mask=rm & (j < T)[None, :], other=0).to(tl.int32)
            row = (row != 0).to(tl.int32)
            kept = tl.sum(row, axis=1)
            before = tl.sum(tl.where(j[None, :] < tok[:, None], row, 0), axis=1)
            keep = tl.load(m + b * smb + tok, mask=r < n_rows, other=0) != 0
            dest = tl.where(keep, before, kept + tok - before)
            y = tl.where(keep[:, None], y, 0.0)
            first = (r < n_rows) & (tok == 0) & (h == 0)
            tl.store(seq + b, lq + 0 * b, mask=first)
            tl.store(seq + sqs + b, oof + kept, mask=first)
        dst = (b * sob + (oof + dest) * (H * D) + h * D)[:, None] + e[None, :]
        if FP8:
            y = tl.minimum(tl.maximum(y * tl.load(mult), -448.0), 448.0)
        tl.store(out + dst, y.to(out.dtype.element_ty), mask=rm)
        if COPY_V:
            val = tl.load(v + (b * svb + tok * svl + h * svh)[:, None] + e[None, :], mask=rm, other=0.0)
            if PACK:
                val = tl.where(keep[:, None], val, 0.0)
            if FP8:
                val = tl.minimum(tl.maximum(val.to(tl.float32) * tl.load(mult + 1), -448.0), 448.0)
            tl.store(vout + dst, val.to(vout.dtype.element_ty), mask=rm)

    _NORM_ROPE_KERNEL = (_kernel, triton)
    return _NORM_ROPE_KERNEL


def norm_rope_supported(x: torch.Tensor) -> bool:
    """The Triton kernel's domain: CUDA, fp16/bf16, power-of-two head dim 8..256, unit last stride."""
    d = x.shape[-1]
    return (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and 8 <= d <= 256
        and d & (d - 1) == 0
        and x.stride(-1) == 1
        and triton_available()
    )


def qk_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rope: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    round_twice: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of ``x`` (B, L, H, D), then RoPE, in one Triton kernel.

    Args:
        x: (B, L, H, D) fp16/bf16, any strides with unit last stride (e.g. a slice of a fused QKV).
        weight: (D,) the RMSNorm scale, in ``x``'s dtype.
        eps: the RMSNorm epsilon.
        rope: None, or (B, L, D/2, 2, 2) fp32 rotations (diffusers' PRX ``freqs_cis``, heads squeezed).
        v: None, or (B, L, H, D) values copied alongside into a contiguous tensor.
        round_twice: diffusers' ``RMSNorm`` (PRX) rounds to x's dtype before the weight product and
            after it; False: ``torch.nn.RMSNorm`` (FLUX), after it only.

    Returns:
        (normalised x (B, L, H, D) contiguous, contiguous copy of v or None). Arithmetic as
        diffusers' RMSNorm and ``apply_rope``: fp32 inside, rounded to x's dtype where they round.
    """
    b, seq, h, d = x.shape
    out = torch.empty((b, seq, h, d), device=x.device, dtype=x.dtype)
    vout = torch.empty_like(out) if v is not None else None
    _norm_rope_launch(x, weight, eps, rope, v, out, vout, 0, round_twice=round_twice)
    return out, vout


def qk_norm_rope_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rope: torch.Tensor | None,
    v: torch.Tensor | None,
    out: torch.Tensor,
    vout: torch.Tensor | None,
    offset: int,
    mask: torch.Tensor | None = None,
    seq: torch.Tensor | None = None,
    lq: int = 0,
    round_twice: bool = True,
    mult: torch.Tensor | None = None,
) -> None:
    """``qk_norm_rope`` written into rows ``offset:`` of key/value buffers (one Triton kernel).

    Args:
        x, weight, eps, rope, v, round_twice: as ``qk_norm_rope``; x, v are (B, L, H, D).
        out, vout: (B, S, H, D) contiguous buffers with S >= offset + L (vout None without v).
        offset: the first buffer row that token 0 goes to.
        mask: None, or (B, L) bool: then the kept tokens of each row go first, in order, and the
            others after them as zeros (a key-padding layout), and ``seq`` is written.
        seq: (2, >= B) int32 with unit last stride, with ``mask``: ``seq[0, b] = lq`` and
            ``seq[1, b] = offset + kept`` for each row b (cuDNN's ``seq_len_q`` / ``seq_len_kv``).
        mult: with float8_e4m3fn buffers, (2,) fp32 on the device: out gets the normalised x times
            ``mult[0]``, vout v times ``mult[1]``, each clamped to +-448 before the cast.
    """
    if mask is not None and (
        seq is None
        or mask.shape != x.shape[:2]
        or mask.dtype != torch.bool
        or mask.stride(1) != 1
        or seq.dtype != torch.int32
        or seq.dim() != 2
        or seq.shape[0] != 2
        or seq.shape[1] < x.shape[0]
        or seq.stride(1) != 1
    ):
        raise ValueError("qk_norm_rope_into: mask must be (B, L) bool, with seq (2, >= B) int32")
    _norm_rope_launch(x, weight, eps, rope, v, out, vout, offset, mask, seq, lq, round_twice, mult)


def _norm_rope_launch(
    x, weight, eps, rope, v, out, vout, offset, mask=None, seq=None, lq=0, round_twice=True, mult=None
) -> None:
    fp8 = out.dtype == torch.float8_e4m3fn
    if fp8 != (mult is not None) or (fp8 and (mult.dtype != torch.float32 or mult.numel() < 2)):
        raise ValueError("norm/RoPE: float8_e4m3fn buffers need mult, (2,) fp32 multipliers, and only they")
    kernel, triton = _norm_rope_kernel()
    b, seq_len, h, d = x.shape
    if out.dim() != 4 or not out.is_contiguous() or out.shape[0] != b or out.shape[2:] != (h, d):
        raise ValueError(
            f"norm/RoPE output buffer of shape {tuple(out.shape)} does not fit x {tuple(x.shape)}"
        )
    if out.shape[1] < offset + seq_len or (vout is not None and vout.shape != out.shape):
        raise ValueError("norm/RoPE output buffers too short or of different shapes")
    if rope is not None:
        rope = rope.expand(b, seq_len, d // 2, 2, 2)
        if rope.stride()[2:] != (4, 2, 1):
            rope = rope.contiguous()
    n_rows = b * seq_len * h
    br = 16  # 16 rows x 4 warps: 0.077 ms against 0.10 for 64 rows (results/norm_rope_variants_h200.json)
    pack = mask is not None
    kernel[(triton.cdiv(n_rows, br),)](
        x,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        weight.contiguous(),
        rope if rope is not None else x,
        rope.stride(0) if rope is not None else 0,
        rope.stride(1) if rope is not None else 0,
        out,
        out.stride(0),
        offset,
        v if v is not None else x,
        v.stride(0) if v is not None else 0,
        v.stride(1) if v is not None else 0,
        v.stride(2) if v is not None else 0,
        vout if vout is not None else out,
        n_rows,
        seq_len,
        h,
        eps,
        mask.view(torch.uint8) if pack else out,
        mask.stride(0) if pack else 0,
        seq_len,
        seq if pack else out,
        seq.stride(0) if pack else 0,
        lq,
        mult if fp8 else out,
        D=d,
        BR=br,
        HAS_ROPE=rope is not None,
        COPY_V=v is not None,
        PACK=pack,
        BT=triton.next_power_of_2(seq_len) if pack else 1,
        ROUND_TWICE=round_twice,
        FP8=fp8,
        num_warps=4,
    )


# -- FP8 row quantisation ------------------------------------------------------------------------
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_ROW_QUANT_KERNEL = None


def row_quant_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (M, K) float8_e4m3fn and (M, 1) fp32 scales with ``x ~= q * scale`` row by row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _row_quant_kernel():
    global _ROW_QUANT_KERNEL
    if _ROW_QUANT_KERNEL is not None:
        return _ROW_QUANT_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _row_quant(
        a,
        b,
        q,
        s,
        mult,
        shift,
        KA,
        KB,
        stride_a,
        stride_b,
        L,
        eps,
        GELU_A: tl.constexpr,
        GELU_B: tl.constexpr,
        NORM: tl.constexpr,
        BKA: tl.constexpr,
        BKB: tl.constexpr,
    ):
        """One row of cat([a or gelu_tanh(a), b or gelu_tanh(b)], -1) (BKB == 0: a alone) -> e4m3
        codes and the row's scale. A GELU is rounded to the input dtype, as torch's gelu writes it:
        x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3)). NORM (a alone): the row is first
        layer_norm(a, eps) * mult[row // L] + shift[row // L], mult and shift (B, KA) contiguous,
        each of the three rounded to the input dtype as torch's ops write them in the source; compiled,
        the product's rounding does not survive (as if the multiply and the add fused: about
        4 % of the codes differ from torch's, the error against the exact value no larger,
        ``benchmarks/results/norm_rounding_v33_h100.json``). Helpers are written out: the CPU
        interpreter does not resolve a nested jit function."""
        row = tl.program_id(0)
        ca = tl.arange(0, BKA)
        xa = tl.load(a + row * stride_a + ca, mask=ca < KA, other=0.0)
        va = xa.to(tl.float32)
        if NORM:
            mean = tl.sum(va, axis=0) / KA
            centred = tl.where(ca < KA, va - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / KA + eps)
            va = (centred * rstd).to(xa.dtype).to(tl.float32)
            batch = row // L
            m = tl.load(mult + batch * KA + ca, mask=ca < KA, other=0.0).to(tl.float32)
            va = (va * m).to(xa.dtype).to(tl.float32)
            sh = tl.load(shift + batch * KA + ca, mask=ca < KA, other=0.0).to(tl.float32)
            va = (va + sh).to(xa.dtype).to(tl.float32)
        if GELU_A:
            va = va * tl.sigmoid(1.5957691216057308 * (va + 0.044715 * va * va * va))
            va = va.to(xa.dtype).to(tl.float32)
        amax = tl.max(tl.abs(va), axis=0)
        if BKB > 0:
            cb = tl.arange(0, BKB)
            xb = tl.load(b + row * stride_b + cb, mask=cb < KB, other=0.0)
            vb = xb.to(tl.float32)
            if GELU_B:
                vb = vb * tl.sigmoid(1.5957691216057308 * (vb + 0.044715 * vb * vb * vb))
                vb = vb.to(xb.dtype).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(vb), axis=0))
        # a NaN element stays NaN, as in torch (the row's scale ignores it, where torch's becomes
        # NaN: the GEMM's output row is NaN either way); the rest is clamped
        scale = tl.maximum(amax, 1e-12) / 448.0
        ya = va / scale
        ya = tl.where(ya != ya, ya, tl.minimum(tl.maximum(ya, -448.0), 448.0))
        tl.store(q + row * (KA + KB) + ca, ya.to(q.dtype.element_ty), mask=ca < KA)
        if BKB > 0:
            yb = vb / scale
            yb = tl.where(yb != yb, yb, tl.minimum(tl.maximum(yb, -448.0), 448.0))
            tl.store(q + row * (KA + KB) + KA + cb, yb.to(q.dtype.element_ty), mask=cb < KB)
        tl.store(s + row, scale)

    @triton.jit
    def _gelu_mul_quant(g, u, q, s, K, stride_g, stride_u, BK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BK)
        a = tl.load(g + row * stride_g + cols, mask=cols < K, other=0.0)
        b = tl.load(u + row * stride_u + cols, mask=cols < K, other=0.0)
        x = a.to(tl.float32)
        # gelu(x, "tanh") as above, rounded to the input dtype, then the product rounded again: the
        # same two roundings as torch's gelu(g) * u
        act = (x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))).to(a.dtype)
        v = (act.to(tl.float32) * b.to(tl.float32)).to(a.dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12) / 448.0
        y = v / scale
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
        tl.store(q + row * K + cols, y.to(q.dtype.element_ty), mask=cols < K)
        tl.store(s + row, scale)

    _ROW_QUANT_KERNEL = (_row_quant, _gelu_mul_quant, triton)
    return _ROW_QUANT_KERNEL


def _use_triton(*xs: torch.Tensor) -> bool:
    """CUDA tensors of unit column stride whose rows hold at most 2^15 values together (a Triton
    program holds a row in registers)."""
    return (
        all(x.is_cuda and x.stride(-1) == 1 for x in xs)
        and sum(x.shape[-1] for x in xs) <= 1 << 15
        and triton_available()
    )


def _quant_out(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty((m, k), device=device, dtype=torch.float8_e4m3fn)
    return q, torch.empty((m, 1), device=device, dtype=torch.float32)


def row_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_quant_fp8_torch`` in one pass (one Triton program per row) on CUDA; the torch ops elsewhere."""
    return rows_quant_fp8([x], [False])


#: the layer norm and modulation a quantising pass may run first: (mult, shift, eps), mult and
#: shift (B, K) for (M, K) rows, M = B * L: row i becomes layer_norm(row, eps) * mult[i // L] +
#: shift[i // L] (diffusers' ``norm(x) * (1 + scale) + shift``, the ``1 + scale`` already made)
Norm = tuple[torch.Tensor, torch.Tensor, float]


def _modulated_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """(M, K) rows -> layer_norm(x, eps) * mult + shift, per batch of M // B rows, in torch ops."""
    mult, shift, eps = norm
    (m, k), b = x.shape, mult.shape[0]
    y = F.layer_norm(x, (k,), eps=eps).view(b, m // b, k)
    return (y * mult.reshape(b, 1, k) + shift.reshape(b, 1, k)).view(m, k)


def _check_norm(parts: list[torch.Tensor], gelu: list[bool], norm: Norm) -> None:
    if not (
        isinstance(norm, tuple)
        and len(norm) == 3
        and all(isinstance(t, torch.Tensor) for t in norm[:2])
        and isinstance(norm[2], float)
    ):
        raise ValueError(f"rows_quant_fp8's norm is (mult, shift, eps: float), got {str(norm)[:100]}")
    mult, shift, eps = norm
    x = parts[0]
    m, k = x.shape
    ok = (
        len(parts) == 1
        and not gelu[0]
        and mult.dim() == 2
        and mult.shape[1] == k
        and mult.shape[0] > 0
        and m % mult.shape[0] == 0
        and tuple(shift.shape) == tuple(mult.shape)
        and mult.dtype == shift.dtype == x.dtype
        and mult.device == shift.device == x.device
        and math.isfinite(eps)
        and eps >= 0
    )
    if not ok:
        raise ValueError(
            f"rows_quant_fp8's norm needs one part (M, K) without GELU, mult and shift (B, K) of its dtype "
            f"and device with M a multiple of B, and an eps >= 0; got part {tuple(x.shape)} {x.dtype}, "
            f"{len(parts)} part(s), mult {tuple(mult.shape)} {mult.dtype}, shift {tuple(shift.shape)} "
            f"{shift.dtype}, eps {eps!r}"
        )


def rows_quant_fp8_torch(
    parts: list[torch.Tensor], gelu: list[bool], norm: Norm | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K_i) parts -> ``row_quant_fp8_torch(cat([gelu_tanh(p) if g else p], -1))``; with ``norm``
    (one part), ``row_quant_fp8_torch(layer_norm(p) * mult + shift)`` (``Norm``)."""
    if norm is not None:
        return row_quant_fp8_torch(_modulated_norm(parts[0], norm))
    acts = [F.gelu(p, approximate="tanh") if g else p for p, g in zip(parts, gelu, strict=True)]
    return row_quant_fp8_torch(acts[0] if len(acts) == 1 else torch.cat(acts, -1))


def rows_quant_fp8(
    parts: list[torch.Tensor], gelu: list[bool], norm: Norm | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows_quant_fp8_torch`` in one pass on CUDA for one or two parts (neither the GELU, the
    concatenation nor the modulated norm is written in bf16); the torch ops elsewhere. parts:
    (M, K_i), K_i > 0, of one floating dtype and device; norm: see ``Norm`` (one part, no GELU).
    Returns (M, sum K_i) float8_e4m3fn and (M, 1) fp32 scales."""
    a = parts[0] if parts else None

    def fits(p: torch.Tensor) -> bool:
        return p.dim() == 2 and p.shape[0] == a.shape[0] and p.shape[1] > 0 and p.dtype == a.dtype

    if a is None or len(gelu) != len(parts) or not a.is_floating_point() or not all(map(fits, parts)):
        got = [(tuple(p.shape), p.dtype) for p in parts]
        raise ValueError(
            f"rows_quant_fp8 needs (M, K_i) parts with K_i > 0 of one floating dtype and one gelu flag "
            f"each, got {got} and {len(gelu)} flags"
        )
    if any(p.device != a.device for p in parts):
        raise ValueError(f"rows_quant_fp8: parts on {sorted({str(p.device) for p in parts})}, not one device")
    if norm is not None:
        _check_norm(parts, gelu, norm)
    if len(parts) > 2 or not _use_triton(*parts):
        return rows_quant_fp8_torch(parts, gelu, norm)
    kernel, _, triton = _row_quant_kernel()
    b = parts[-1]
    ka, kb = a.shape[1], b.shape[1] if len(parts) == 2 else 0
    q, s = _quant_out(a.shape[0], ka + kb, a.device)
    bka, bkb = triton.next_power_of_2(ka), triton.next_power_of_2(kb) if kb else 0
    mult, shift, eps = (norm[0].contiguous(), norm[1].contiguous(), norm[2]) if norm else (a, a, 0.0)
    rows = a.shape[0] // mult.shape[0] if norm is not None else 1  # without NORM: unread
    # widths measured at the step's shapes (``quant_kernels_v21_h200.json``): 4 warps up to 4096
    # columns (3.50 against 3.27 TB/s at 3072), 8 above (3.93 TB/s at 15360); two parts and the
    # norm: the same rule, not measured yet (``benchmarks/quant_kernels.py`` has their shapes)
    warps = 8 if bka + bkb > 4096 else 4
    kernel[(a.shape[0],)](
        a,
        b,
        q,
        s,
        mult,
        shift,
        ka,
        kb,
        a.stride(0),
        b.stride(0),
        rows,
        eps,
        gelu[0],
        gelu[-1],
        norm is not None,
        BKA=bka,
        BKB=bkb,
        num_warps=warps,
    )
    return q, s


def gelu_mul_quant_fp8_torch(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, N), (M, N) -> ``row_quant_fp8_torch(gelu(gate, approximate="tanh") * up)``."""
    return row_quant_fp8_torch(torch.nn.functional.gelu(gate, approximate="tanh") * up)


def gelu_mul_quant_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gelu_mul_quant_fp8_torch`` in one pass on CUDA (the (M, N) product is never written in bf16);
    the torch ops elsewhere. Returns (M, N) float8_e4m3fn and (M, 1) fp32 scales."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.dtype != up.dtype:
        raise ValueError(
            f"gelu_mul_quant_fp8 needs two (M, N) tensors of one shape and dtype, got gate "
            f"{tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype}"
        )
    if not _use_triton(gate, up):
        return gelu_mul_quant_fp8_torch(gate, up)
    _, kernel, triton = _row_quant_kernel()
    m, k = gate.shape
    q, s = _quant_out(m, k, gate.device)
    bk = triton.next_power_of_2(k)
    # 8 warps up to 16384 columns: 3.26 against 16 warps' 2.93 TB/s at 12288 (``quant_kernels_v21_h200.json``)
    kernel[(m,)](gate, up, q, s, k, gate.stride(0), up.stride(0), BK=bk, num_warps=16 if bk > 16384 else 8)
    return q, s


# -- FP8 attention's per-tensor scales (cuDNN's FP8 SDPA) ------------------------------------------
#: rows of the (FP8_SCALARS, 4) fp32 buffer ``fp8_attention_scales`` writes (column 0; rows 16 bytes
#: apart, the alignment cuDNN's tensors take). MULT holds the quantisation multipliers of Q, K and V
#: (448 / their bound) in columns 0-2, as ``qk_norm_rope_into``'s ``mult`` reads them.
AMAX_V, DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_S, SCALE_S, SCALE_O, AMAX_O, MULT = range(9)
FP8_SCALARS = 9
_FP8_SCALE_KERNELS = None


def _fp8_scale_kernels():
    global _FP8_SCALE_KERNELS
    if _FP8_SCALE_KERNELS is not None:
        return _FP8_SCALE_KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def _amax_rows(
        x, sxb, sxl, n_rows, L, W, out, keep, skb,
        BR: tl.constexpr, BW: tl.constexpr, STEPS: tl.constexpr, MASKED: tl.constexpr,
    ):  # fmt: skip
        # max |x| over the program's STEPS x BR rows (b, l) of W contiguous elements (with MASKED
        # only the rows whose keep[b, l] is set), folded into out[0] atomically (one atomic per
        # program)
        start = tl.program_id(0) * (STEPS * BR)
        c = tl.arange(0, BW)
        acc = tl.zeros((BR, BW), dtype=tl.float32)
        for i in range(STEPS):
            r = start + i * BR + tl.arange(0, BR)
            ok = r < n_rows
            if MASKED:
                ok = ok & (tl.load(keep + (r // L) * skb + r % L, mask=ok, other=0) != 0)
            ptr = x + ((r // L) * sxb + (r % L) * sxl)[:, None] + c[None, :]
            v = tl.load(ptr, mask=ok[:, None] & (c < W)[None, :], other=0.0)
            acc = tl.maximum(acc, tl.abs(v.to(tl.float32)))
        tl.atomic_max(out, tl.max(tl.max(acc, axis=1), axis=0))

    @triton.jit
    def _finish(sc, wq, wk, wt, bound, D: tl.constexpr):
        # row r of the scalars is at sc + 4 * r: DESCALE_Q = 1 ... SCALE_O = 6, MULT = 8 (as above)
        e = tl.arange(0, D)
        aq = tl.max(tl.abs(tl.load(wq + e).to(tl.float32)), axis=0) * bound
        ak = (
            tl.maximum(
                tl.max(tl.abs(tl.load(wk + e).to(tl.float32)), axis=0),
                tl.max(tl.abs(tl.load(wt + e).to(tl.float32)), axis=0),
            )
            * bound
        )
        aq = tl.maximum(aq, 1e-12)
        ak = tl.maximum(ak, 1e-12)
        av = tl.maximum(tl.load(sc), 1e-12)
        tl.store(sc + 4 * 1, aq / 448.0)
        tl.store(sc + 4 * 2, ak / 448.0)
        tl.store(sc + 4 * 3, av / 448.0)
        tl.store(sc + 4 * 4, 1.0 / 448.0)
        tl.store(sc + 4 * 5, 448.0)
        tl.store(sc + 4 * 6, 448.0 / av)
        tl.store(sc + 4 * 8, 448.0 / aq)
        tl.store(sc + 4 * 8 + 1, 448.0 / ak)
        tl.store(sc + 4 * 8 + 2, 448.0 / av)

    @triton.jit
    def _dequant(x, out, sc, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x + i, mask=i < n, other=0.0).to(tl.float32) * tl.load(sc + 4 * 3)
        tl.store(out + i, v.to(out.dtype.element_ty), mask=i < n)

    _FP8_SCALE_KERNELS = (_amax_rows, _finish, _dequant, triton)
    return _FP8_SCALE_KERNELS


def fp8_attention_scales_torch(
    v_a: torch.Tensor,
    mask_a: torch.Tensor,
    v_b: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    t_weight: torch.Tensor,
) -> torch.Tensor:
    """The per-tensor scales of FP8 attention over [keys a under mask_a; keys b], in PyTorch ops.

    Q and K are RMS-normalised: an element never exceeds sqrt(D) times the norm weight's largest
    magnitude (RoPE rotates pairs, keeping their norm), so their bounds come from the weights, with no
    pass over the tensors; V's is the largest magnitude of the values attended (masked-out values
    change nothing). Q gets ``q_weight``'s bound, K (both parts) the larger of ``k_weight``'s
    (keys b) and ``t_weight``'s (keys a).

    Args:
        v_a: (B, La, H, D) values, mask_a (B, La) bool (True = attend). v_b: (B, Lb, H, D).
        q_weight, k_weight, t_weight: (D,).

    Returns:
        (FP8_SCALARS, 4) fp32 on v_b's device, column 0 by the row constants above: the descales
        (bound / 448) of Q, K, V and P (1/448), P's scale 448, O's scale 448 / amax(V), and in row
        MULT the multipliers 448 / bound of Q, K and V.
    """
    bound = q_weight.shape[0] ** 0.5

    def amax(x):
        return x.detach().float().abs().amax() if x.numel() else torch.zeros((), device=v_b.device)

    aq = (amax(q_weight) * bound).clamp(min=1e-12)
    ak = (torch.maximum(amax(k_weight), amax(t_weight)) * bound).clamp(min=1e-12)
    kept = v_a * mask_a[:, :, None, None].to(v_a.dtype)
    av = torch.maximum(amax(kept), amax(v_b)).clamp(min=1e-12)
    sc = torch.zeros(FP8_SCALARS, 4, dtype=torch.float32, device=v_b.device)
    sc[AMAX_V, 0], sc[DESCALE_Q, 0], sc[DESCALE_K, 0], sc[DESCALE_V, 0] = av, aq / 448, ak / 448, av / 448
    sc[DESCALE_S, 0], sc[SCALE_S, 0], sc[SCALE_O, 0] = 1 / 448, 448.0, 448 / av
    sc[MULT, 0], sc[MULT, 1], sc[MULT, 2] = 448 / aq, 448 / ak, 448 / av
    return sc


def fp8_attention_scales(
    v_a: torch.Tensor,
    mask_a: torch.Tensor,
    v_b: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    t_weight: torch.Tensor,
) -> torch.Tensor:
    """``fp8_attention_scales_torch`` on the device in three Triton launches (V's largest magnitude
    folded atomically over both parts, then the scalars), no host sync; the torch ops elsewhere.
    ``mask_a`` (B, La) bool with unit last stride."""
    ws = (q_weight, k_weight, t_weight)
    d = q_weight.shape[0]
    if not (
        _use_triton(v_a, v_b)
        and all(w.is_cuda and w.shape == (d,) and w.is_contiguous() for w in ws)
        and v_a.shape[-1] == d == v_b.shape[-1]
        and all(x.stride(2) == d for x in (v_a, v_b))  # heads then dims contiguous within a token
        and d & (d - 1) == 0
        and mask_a.dtype == torch.bool
        and mask_a.stride(-1) == 1
    ):
        return fp8_attention_scales_torch(v_a, mask_a, v_b, *ws)
    amax_rows, finish, _, triton = _fp8_scale_kernels()
    sc = torch.zeros(FP8_SCALARS, 4, dtype=torch.float32, device=v_b.device)
    for x, mask in ((v_a, mask_a), (v_b, None)):
        b, seq, h, _ = x.shape
        rows = b * seq
        if rows:
            bw = triton.next_power_of_2(h * d)
            br = max(1, 4096 // bw)
            # 16 steps of br rows a program: 512 programs (so 512 atomics) for 7B's 8192 image rows
            amax_rows[(triton.cdiv(rows, 16 * br),)](
                x, x.stride(0), x.stride(1), rows, seq, h * d, sc,
                mask.view(torch.uint8) if mask is not None else sc, mask.stride(0) if mask is not None else 0,
                BR=br, BW=bw, STEPS=16, MASKED=mask is not None, num_warps=8,
            )  # fmt: skip
    finish[(1,)](sc, *ws, float(d) ** 0.5, D=d, num_warps=1)
    return sc


def dequant_fp8(x: torch.Tensor, scalars: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(...) float8_e4m3fn -> (...) ``dtype``: x times ``scalars[DESCALE_V, 0]`` (an FP8 attention's
    output scaled by 448 / amax(V) back to its values); one Triton pass on CUDA."""
    if not (x.is_cuda and x.is_contiguous() and triton_available()):
        return (x.float() * scalars[DESCALE_V, 0]).to(dtype)
    _, _, dequant, triton = _fp8_scale_kernels()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    dequant[(triton.cdiv(n, 4096),)](x, out, scalars, n, BLOCK=4096, num_warps=8)
    return out
