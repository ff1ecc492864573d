"""FP8 joint attention for ``precision: fp8``: image queries over [masked text keys; image keys].

Two Triton kernels (Hopper FP8 tensor cores through ``tl.dot``), no host sync:

1. ``_quant_kv``: one program per (key block of ``BLOCK_N``, batch x head) reads the text or image
   keys and values of its block (the concatenation happens here, never in memory), zeroes padded
   text keys, and writes e4m3 K (B, H, Lk', D) and V transposed (B, H, D, Lk') with one fp32 scale per
   block and tensor (amax / 448). Lk' = text + image keys rounded up to ``BLOCK_N``.
2. ``_attention``: one program per (query block of ``BLOCK_M``, batch x head) quantises its queries
   (one scale per block), then runs the online softmax over every key block: S = Q8 K8^T x scales,
   padded keys -inf, P = exp2(S - max + 8) (x256, so small probabilities stay out of e4m3's
   subnormals; the row sum carries the same factor and cancels it), O += (P8 V8) x V's scale.

The scales are per block of tokens (the tiling's, ``TILES``) and head, computed on the device from
the values themselves, so no calibration and no host sync. ``joint_attention_fp8_torch`` is the same
block quantisation of Q, K and V followed by exact attention (P stays fp32): the named CPU fallback,
and the reference the GPU tests hold the kernels to.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
#: the kernels' tilings (BLOCK_M: queries per program and per Q scale, BLOCK_N: keys per step and
#: per K / V scale, num_warps, num_stages), among which an engine set chooses by measurement
#: (``ops.choice``; ``prx_attention_fp8``'s ``tile`` argument indexes this). 0 was tuned at head
#: dimension 64; at 128 the others ran 1.3-1.7x faster (``peers_v18_pixel_h200.json``).
TILES = ((128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 3))


def _kernels():
    """(quant_kv, attention, triton), imported on first use."""
    import triton

    from . import fp8_attention_kernels as k

    return k._quant_kv, k._attention, triton


def supported(q: torch.Tensor) -> bool:
    """The kernels' domain: CUDA, fp16/bf16, head dim a power of two in 32..128, Triton present."""
    from .kernels import triton_available

    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d in (32, 64, 128)
        and torch.cuda.get_device_capability(q.device) >= (8, 9)
        and triton_available()
    )


def joint_attention_fp8(
    q: torch.Tensor,
    k_a: torch.Tensor,
    v_a: torch.Tensor,
    mask_a: torch.Tensor,
    k_b: torch.Tensor,
    v_b: torch.Tensor,
    scale: float,
    tile: int = 0,
) -> torch.Tensor:
    """Attention of q over [k_a under mask_a; k_b] with Q, K, V, P in e4m3 (the Triton kernels).

    Args:
        q: (B, Lq, H, D) fp16/bf16. k_a, v_a: (B, La, H, D), the masked (text) keys; mask_a (B, La)
        bool, True = attend. k_b, v_b: (B, Lb, H, D), always attended. scale: softmax scale.
        tile: an index into ``TILES``: queries and keys per block (and per scale), Triton's warps
            and stages.

    Returns:
        (B, Lq, H, D) contiguous in q's dtype; a row with no kept key is 0.
    """
    block_m, block_n, num_warps, num_stages = TILES[tile]
    quant_kv, attention, triton = _kernels()
    b, lq, h, d = q.shape
    la, lb = k_a.shape[1], k_b.shape[1]
    la_pad = triton.cdiv(la, block_n) * block_n
    nkb = la_pad // block_n + triton.cdiv(lb, block_n)
    lk_pad = nkb * block_n
    dev = q.device
    k8 = torch.empty((b, h, lk_pad, d), device=dev, dtype=torch.float8_e4m3fn)
    vt8 = torch.empty((b, h, d, lk_pad), device=dev, dtype=torch.float8_e4m3fn)
    sk = torch.empty((b * h, nkb), device=dev, dtype=torch.float32)
    sv = torch.empty_like(sk)
    mask = mask_a.contiguous().view(torch.uint8) if la else torch.ones((b, 1), device=dev, dtype=torch.uint8)
    k_a, v_a, k_b, v_b = (t.contiguous() for t in (k_a, v_a, k_b, v_b))
    quant_kv[(nkb, b * h)](
        k_a, v_a, mask, k_b, v_b, k8, vt8, sk, sv, la, la_pad, lb, lk_pad, nkb, h,
        D=d, BN=block_n, num_warps=4,
    )  # fmt: skip
    out = torch.empty((b, lq, h, d), device=dev, dtype=q.dtype)
    attention[(triton.cdiv(lq, block_m), b * h)](
        q.contiguous(), k8, vt8, sk, sv, mask, out, lq, la, la_pad, lb, lk_pad, nkb, h, float(scale),
        D=d, BM=block_m, BN=block_n, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _qdq_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, L, H, D) -> the same values through e4m3 with one scale per (batch, block of ``block``
    tokens, head), as the kernels quantise them; fp32."""
    b, seq, h, d = x.shape
    nb = -(-seq // block)
    xp = torch.zeros((b, nb * block, h, d), dtype=torch.float32, device=x.device)
    xp[:, :seq] = x.float()
    xb = xp.view(b, nb, block, h, d)
    s = xb.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-12) / FP8_MAX
    deq = (xb / s).to(torch.float8_e4m3fn).float() * s
    return deq.view(b, nb * block, h, d)[:, :seq]


def joint_attention_fp8_torch(
    q: torch.Tensor,
    k_a: torch.Tensor,
    v_a: torch.Tensor,
    mask_a: torch.Tensor,
    k_b: torch.Tensor,
    v_b: torch.Tensor,
    scale: float,
    tile: int = 0,
) -> torch.Tensor:
    """The kernels' block quantisation of Q, K and V in PyTorch ops, then exact fp32 attention (P not
    quantised): the named CPU fallback of ``joint_attention_fp8``. Same arguments and result."""
    block_m, block_n = TILES[tile][:2]
    keep_a = mask_a.bool()
    zero = keep_a[:, :, None, None].to(k_a.dtype)
    k = torch.cat([k_a * zero, k_b], 1)
    v = torch.cat([v_a * zero, v_b], 1)
    keep = torch.cat([keep_a, torch.ones(k_b.shape[:2], dtype=torch.bool, device=q.device)], 1)
    qf, kf, vf = _qdq_blocks(q, block_m), _qdq_blocks(k, block_n), _qdq_blocks(v, block_n)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vf).to(q.dtype).contiguous()
