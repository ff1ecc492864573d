"""Custom operators that lowering rules emit and that stay in PyTorch, between TensorRT engines.

* ``torch.ops.prx_compile.joint_attention`` — PRX's attention: queries over [masked text keys;
  image keys]. A dense kernel over the image keys plus a small masked kernel over the text keys,
  merged exactly by log-sum-exp.
* ``torch.ops.prx_compile.flash_attention`` — attention under any (B, Lk) key mask.
* ``torch.ops.prx_compile.prx_attention`` — PRX's whole attention core from the two projections'
  outputs: QK RMSNorm, RoPE and the joint attention (``CompileConfig.attention = "fused"``).
* ``torch.ops.prx_compile.prx_attention_fp8`` — the same with the attention on FP8 tensor cores
  (``precision: fp8``, rule ``lowering.fp8_attention``).
* ``torch.ops.prx_compile.prx_attention_cudnn`` — the same with the joint attention as one cuDNN
  call under a key-padding mask (``attention_kernel``, rule ``lowering.padded_attention``).
* ``torch.ops.prx_compile.prx_attention_flash4`` — the same layout with the joint attention as one
  FlashAttention-4 call (``attention_kernel: flash4``, rule ``lowering.padded_attention``).
* ``torch.ops.prx_compile.prx_attention_cudnn_fp8`` — the same layout in e4m3 with the joint
  attention as one cuDNN FP8 SDPA call (``precision: fp8``, rule ``lowering.padded_attention``);
  ``prx_attention_cudnn_fp8_linear`` the same with the FP8 output projection that follows it.
* ``torch.ops.prx_compile.fp8_linear`` — ``x @ W.T (+ bias)`` as an FP8 GEMM (``precision: fp8``):
  activations quantised per row at run time, W stored FP8 with per-output-channel scales.
* ``torch.ops.prx_compile.fp8_linears`` — the FP8 linears that read one input, the input quantised
  once, with the concatenation and tanh GELUs that make it fused into that pass (FLUX.1's q/k/v
  projections, its MLP's second linear, its single blocks' output projection; rule
  ``lowering.fp8_inputs``).
* ``torch.ops.prx_compile.fp8_gated_mlp`` — PRX's MLP ``down(gelu_tanh(gate(x)) * up(x))`` as three
  FP8 GEMMs with the quantisations fused (rule ``lowering.fp8_mlp``).
* ``torch.ops.prx_compile.linear`` — ``F.linear`` run by PyTorch (cuBLAS) between engines (rule
  ``lowering.linear``, in range engine sets: ``CompileConfig.range_linears``).
* ``torch.ops.prx_compile.attention`` — dense attention in (B, L, H, D) on a named kernel (FLUX's
  attention, ``FusedFluxAttnProcessor``; rule ``lowering.dense_attention`` names the kernel).
* ``torch.ops.prx_compile.flux_attention`` — FLUX's whole attention core from its projections'
  outputs: QK RMSNorm, text first, RoPE, dense attention on a named kernel (``FusedFluxAttnProcessor``).
* ``torch.ops.prx_compile.linear_gelu`` — ``gelu_tanh(F.linear(x, W, b))`` as one GEMM with the
  GELU in its epilogue; ``linear_cat`` — ``F.linear(cat([a, b], -1), W, b)`` as two GEMMs over W's
  column blocks, the concatenation never written (FLUX.1's feed-forward and single-block output
  projection where linears run in cuBLAS; rule ``lowering.linear_glue``).
* ``torch.ops.prx_compile.gelu_gate`` — PRX's MLP gate ``gelu_tanh(x @ Wg.T) * up`` as one cuDNN GEMM
  with the activation in its epilogue (rule ``lowering.gelu_gate``, ``CompileConfig.fuse_mlp_gate``).

Each is declared in ``registry`` with the role that decides when it stays in PyTorch. The attention
ops take and return (B, L, H, D) tensors. On CUDA with fp16/bf16 they run PyTorch's flash/cuDNN
kernels; elsewhere they run PyTorch's exact math SDPA (a named CPU fallback, used by CI).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .registry import declare

_LIB = "prx_compile"
aten = torch.ops.aten


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Exact PyTorch attention in (B, L, H, D) layout; a row with every key masked gives 0."""
    mask = None
    if key_mask is not None:
        mask = key_mask[:, None, None, :]
        if mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    if key_mask is not None and key_mask.dtype != torch.bool:
        # An additive mask of -inf everywhere: PyTorch gives 0 on some kernels, NaN on others.
        dead = torch.isneginf(key_mask).all(dim=-1)[:, None, None, None]
        out = out.masked_fill(dead, 0.0)
    return out.transpose(1, 2)


def _expect(ok: bool, message: str) -> None:
    """Shape checks at the ops' boundary: kernels below index by these shapes (a Program loaded from
    disk can call the ops, so nothing is assumed)."""
    if not ok:
        raise ValueError(f"prx_compile op: {message}")


def _bld(name: str, t: torch.Tensor, b: int, h: int, d: int) -> int:
    """Check a (B, L, H, D) tensor; returns L."""
    _expect(
        t.dim() == 4 and t.shape[0] == b and t.shape[2] == h and t.shape[3] == d,
        f"{name} has shape {tuple(t.shape)}, expected ({b}, L, {h}, {d})",
    )
    return t.shape[1]


def _key_mask(name: str, mask: torch.Tensor | None, b: int, lk: int) -> None:
    if mask is not None:
        _expect(tuple(mask.shape) == (b, lk), f"{name} has shape {tuple(mask.shape)}, expected {(b, lk)}")


def _flash_supported(q: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    )


def _lse_bhq(lse: torch.Tensor, b: int, h: int, lq: int) -> torch.Tensor:
    """A kernel's log-sum-exp in any of its layouts -> (B, H, Lq) fp32."""
    if lse.dim() == 2:  # varlen flash: (H, B*Lq)
        return lse.view(h, b, lq).transpose(0, 1)
    if lse.dim() == 4:  # cuDNN: (B, H, Lq, 1)
        lse = lse[..., 0]
    return lse[:, :, :lq]  # memory-efficient kernel pads Lq to a multiple of 32


def _varlen_keys_first(q, k, v, mask, scale):
    """Varlen flash attention with each row's kept keys packed first; padded keys are never read.

    Attention is invariant under a permutation of its keys: a stable argsort puts the kept keys first
    (one row gather, no host sync) and ``seqused_k`` tells the kernel how many each row has. A row
    with no kept key gets 0 from the kernel (checked on the H200). Returns (out, lse (B, H, Lq)).
    """
    b, lq, h, d = q.shape
    lk = k.shape[1]
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    flat = (order + torch.arange(b, device=q.device)[:, None] * lk).reshape(-1)
    cu_q = torch.arange(0, (b + 1) * lq, lq, device=q.device, dtype=torch.int32)
    cu_k = torch.arange(0, (b + 1) * lk, lk, device=q.device, dtype=torch.int32)
    out, lse = aten._flash_attention_forward(
        q.reshape(b * lq, h, d),
        k.reshape(b * lk, h, d).index_select(0, flat),
        v.reshape(b * lk, h, d).index_select(0, flat),
        cu_q,
        cu_k,
        lq,
        lk,
        0.0,
        False,
        False,
        scale=scale,
        seqused_k=mask.sum(1, dtype=torch.int32),
    )[:2]
    return out.view(b, lq, h, d), _lse_bhq(lse, b, h, lq)


def _dense_part(q, k, v, scale):
    """Unmasked attention in cuDNN: (out (B, Lq, H, D), lse (B, H, Lq)).

    cuDNN ran 4096x4096 tokens 1.6x faster than FA2 on the H200 (attention_kernels_h200.json)."""
    t = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out, lse = aten._scaled_dot_product_cudnn_attention(*t, None, True, 0.0, False, False, scale=scale)[:2]
    return out.transpose(1, 2), _lse_bhq(lse, q.shape[0], q.shape[2], q.shape[1])


def _masked_part(q, k, v, mask, scale):
    """Attention over the keys ``mask`` (B, Lk) keeps, in cuDNN with a -inf bias (the fastest of
    the kernels measured for PRX's small text part): (out (B, Lq, H, D), lse (B, H, Lq))."""
    b, lq, h, _ = q.shape
    lk = k.shape[1]
    bias = torch.zeros(b, 1, 1, lk, device=q.device, dtype=q.dtype).masked_fill(
        ~mask[:, None, None, :], float("-inf")
    )
    t = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias.expand(b, h, lq, lk))
    out, lse = aten._scaled_dot_product_cudnn_attention(*t, True, 0.0, False, False, scale=scale)[:2]
    return out.transpose(1, 2), _lse_bhq(lse, b, h, lq)


@torch.library.custom_op(f"{_LIB}::flash_attention", mutates_args=())
def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention with an optional key-padding mask, in (B, L, H, D) layout.

    Args:
        q: (B, Lq, H, D) queries. k, v: (B, Lk, H, D); Lk may differ from Lq.
        key_mask: None, (B, Lk) bool (True = attend), or (B, Lk) float added to the scores.
        scale: softmax scale (1/sqrt(D) for SDPA's default).

    Returns:
        (B, Lq, H, D). CUDA fp16/bf16: boolean masks through varlen flash attention (exact), no mask
        through SDPA's fastest kernel. Otherwise (CPU, additive masks): PyTorch's SDPA.
    """
    _expect(q.dim() == 4, f"q has shape {tuple(q.shape)}, expected (B, L, H, D)")
    b, _, h, d = q.shape
    lk = _bld("k", k, b, h, d)
    _expect(_bld("v", v, b, h, d) == lk, "k and v have different lengths")
    _key_mask("key_mask", key_mask, b, lk)
    if _flash_supported(q):
        if key_mask is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
            )
            return out.transpose(1, 2).contiguous()
        if key_mask.dtype == torch.bool:
            return _varlen_keys_first(q.contiguous(), k.contiguous(), v.contiguous(), key_mask, scale)[0]
    return _reference(q, k, v, key_mask, scale).contiguous()


@flash_attention.register_fake
def _(q, k, v, key_mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_LIB}::joint_attention", mutates_args=())
def joint_attention(
    q: torch.Tensor,
    k_a: torch.Tensor,
    v_a: torch.Tensor,
    mask_a: torch.Tensor,
    k_b: torch.Tensor,
    v_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention over two key sets, the first under a key mask, the second always attended.

    PRX's joint attention: image queries over [text keys (padded, masked); image keys]. On CUDA the
    unmasked part runs a dense cuDNN kernel, the small masked part its own, and the two are merged
    exactly by their log-sum-exp (attention is a softmax-weighted sum: splitting the keys and
    re-weighting changes only rounding). Elsewhere: SDPA over the concatenated keys.

    Args:
        q: (B, Lq, H, D). k_a, v_a: (B, La, H, D); mask_a: (B, La) bool, True = attend.
        k_b, v_b: (B, Lb, H, D). scale: softmax scale.

    Returns:
        (B, Lq, H, D) contiguous.
    """
    _expect(q.dim() == 4, f"q has shape {tuple(q.shape)}, expected (B, L, H, D)")
    b, _, h, d = q.shape
    la, lb = _bld("k_a", k_a, b, h, d), _bld("k_b", k_b, b, h, d)
    _expect(
        _bld("v_a", v_a, b, h, d) == la and _bld("v_b", v_b, b, h, d) == lb,
        "keys and values differ in length",
    )
    _key_mask("mask_a", mask_a, b, la)
    return _joint(q, k_a, v_a, mask_a, k_b, v_b, scale)


def _joint(q, k_a, v_a, mask_a, k_b, v_b, scale):
    if not _flash_supported(q):
        keep_b = torch.ones(k_b.shape[:2], dtype=torch.bool, device=q.device)
        return _reference(
            q, torch.cat([k_a, k_b], 1), torch.cat([v_a, v_b], 1), torch.cat([mask_a, keep_b], 1), scale
        ).contiguous()
    from . import kernels

    q = q.contiguous()
    o_b, lse_b = _dense_part(q, k_b, v_b, scale)
    o_a, lse_a = _masked_part(q, k_a.contiguous(), v_a.contiguous(), mask_a, scale)
    return kernels.merge(o_b, lse_b, o_a, lse_a)


@joint_attention.register_fake
def _(q, k_a, v_a, mask_a, k_b, v_b, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def qk_norm_rope_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rope: torch.Tensor | None = None
) -> torch.Tensor:
    """diffusers' ``RMSNorm`` then ``apply_rope`` in PyTorch ops, in (B, L, H, D) layout.

    x: (B, L, H, D); weight: (D,); rope: None or (B, L, D/2, 2, 2) fp32. Returns (B, L, H, D).
    The same operations in the same order as diffusers, so it matches the model exactly.
    """
    var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(var + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    y = y * weight
    return y if rope is None else _rope_torch(y, rope)


def _rope_torch(y: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``y`` (B, L, H, D) rotated by ``rope`` (B or 1, L, D/2, 2, 2) fp32, in fp32, rounded to y's
    dtype: out[2i + j] = rope[i, j, 0] y[2i] + rope[i, j, 1] y[2i + 1] (the Triton kernel's order)."""
    pairs = y.float().reshape(*y.shape[:-1], -1, 1, 2)
    f = rope[:, :, None].to(pairs.dtype)  # (B, L, 1, D/2, 2, 2): broadcast over heads
    out = f[..., 0] * pairs[..., 0] + f[..., 1] * pairs[..., 1]
    return out.reshape(*y.shape).type_as(y)


def _norm_rope(x, weight, eps, rope, v):
    """(normalised x, contiguous v): the Triton kernel where it applies, else PyTorch ops."""
    from . import kernels

    if kernels.norm_rope_supported(x) and weight.dtype == x.dtype:
        return kernels.qk_norm_rope(x, weight, eps, rope, v)
    return qk_norm_rope_torch(x, weight, eps, rope), (v.contiguous() if v is not None else None)


def _prx_attention(
    img_qkv,
    txt_kv,
    text_mask,
    rope,
    q_weight,
    k_weight,
    text_k_weight,
    heads,
    eps,
    scale,
    fp8=None,
    padded=None,
    proj=None,
):
    """``prx_attention``'s body; ``fp8`` (None, or a tile index into ``fp8_attention.TILES``) picks
    ``_joint_fp8`` for the attention itself, ``padded`` ("flash4", "cudnn" or "cudnn_fp8") the
    one-call attention of ``prx_attention_flash4`` / ``prx_attention_cudnn`` /
    ``prx_attention_cudnn_fp8`` where it runs. ``proj`` (with "cudnn_fp8" only): (weight_fp8,
    weight_scale, bias) of an FP8 output projection, whose result is returned instead (B, L, N)."""
    d = q_weight.shape[0] if q_weight.dim() == 1 else -1
    _expect(
        heads > 0 and d > 0 and d % 2 == 0, f"heads={heads} and norm weights of shape {tuple(q_weight.shape)}"
    )
    for name, w in (("k_weight", k_weight), ("text_k_weight", text_k_weight)):
        _expect(
            tuple(w.shape) == (d,) and w.dtype == q_weight.dtype, f"{name} must be ({d},) {q_weight.dtype}"
        )
    _expect(
        img_qkv.dim() == 3 and img_qkv.shape[2] == 3 * heads * d, f"img_qkv has shape {tuple(img_qkv.shape)}"
    )
    b, seq, _ = img_qkv.shape
    _expect(
        txt_kv.dim() == 3 and txt_kv.shape[0] == b and txt_kv.shape[2] == 2 * heads * d,
        f"txt_kv has shape {tuple(txt_kv.shape)}",
    )
    t = txt_kv.shape[1]
    _key_mask("text_mask", text_mask, b, t)
    if rope is not None:
        _expect(tuple(rope.shape) == (b, 1, seq, d // 2, 2, 2), f"rope has shape {tuple(rope.shape)}")
    qkv = img_qkv.reshape(b, seq, 3, heads, d)
    kv = txt_kv.reshape(b, t, 2, heads, d)
    if rope is not None:
        rope = rope[:, 0]  # (B, L, D/2, 2, 2)
    if text_mask is None:
        text_mask = torch.ones(b, t, dtype=torch.bool, device=img_qkv.device)
    attention = _padded_kernel(padded, qkv, q_weight, t) if padded else None
    if attention is not None:
        out = _padded(
            qkv,
            kv,
            text_mask.bool().contiguous(),
            rope,
            q_weight,
            k_weight,
            text_k_weight,
            eps,
            scale,
            attention,
            fp8=padded == "cudnn_fp8",
        )
        if padded == "cudnn_fp8":
            from .kernels import DESCALE_V, dequant_fp8

            out8, scalars = out
            if proj is not None:  # the e4m3 output is the GEMM's input: one scale for all its rows
                x = out8.view(b * seq, heads * d)
                s = scalars[DESCALE_V, :1].view(1, 1).expand(b * seq, 1).contiguous()
                n = proj[0].shape[0]
                return _fp8_gemm(x, s, proj[0], proj[1], img_qkv.dtype, proj[2]).view(b, seq, n)
            out = dequant_fp8(out8, scalars, img_qkv.dtype)
        return out.reshape(b, seq, heads * d)
    q, _ = _norm_rope(qkv[:, :, 0], q_weight, eps, rope, None)
    k, v = _norm_rope(qkv[:, :, 1], k_weight, eps, rope, qkv[:, :, 2])
    tk, tv = _norm_rope(kv[:, :, 0], text_k_weight, eps, None, kv[:, :, 1])
    if padded == "cudnn_fp8":
        from .kernels import fp8_attention_scales_torch

        scalars = fp8_attention_scales_torch(
            kv[:, :, 1], text_mask.bool(), qkv[:, :, 2], q_weight, k_weight, text_k_weight
        )
        out = _joint_fp8_tensor(q, tk, tv, text_mask.bool(), k, v, scale, scalars)
    elif fp8 is not None:
        out = _joint_fp8(q, tk, tv, text_mask.bool(), k, v, scale, fp8)
    else:
        out = _joint(q, tk, tv, text_mask.bool(), k, v, scale)
    out = out.reshape(b, seq, heads * d)
    return out if proj is None else _fp8_linear(out, *proj)


def _padded_kernel(kind: str, qkv: torch.Tensor, q_weight: torch.Tensor, t: int):
    """The module (``flash4_attention`` or ``cudnn_attention``) that runs the one-call attention
    ``kind`` asks for on these inputs, or None (the split path; for "cudnn_fp8" its PyTorch
    emulation). "flash4" falls back to cuDNN where FlashAttention-4 cannot run. All need at least one
    text token, the norm weights in the activations' dtype and the norm/RoPE kernel's domain (it
    writes their key-padding layout); "cudnn_fp8" cuDNN's FP8 SDPA as well."""
    from . import cudnn_attention, flash4_attention, kernels

    x = qkv[:, :, 0]
    if not (t > 0 and q_weight.dtype == x.dtype and kernels.norm_rope_supported(x)):
        return None
    if kind == "cudnn_fp8":
        return cudnn_attention if cudnn_attention.fp8_supported(x) and kernels.triton_available() else None
    order = (flash4_attention, cudnn_attention) if kind == "flash4" else (cudnn_attention,)
    return next((m for m in order if m.supported(x)), None)


def _padded(qkv, kv, mask, rope, q_weight, k_weight, text_k_weight, eps, scale, attention, fp8=False):
    """The norms and RoPE written straight into [image keys; kept text keys; zeros] buffers, then
    one attention call under the padding mask (``attention.padded_attention``). qkv: (B, L, 3, H,
    D), kv: (B, T, 2, H, D), mask (B, T) bool contiguous, rope None or (B, L, D/2, 2, 2). Returns
    (B, L, H, D) in qkv's dtype.

    ``fp8``: the buffers are e4m3 with per-tensor scales (``kernels.fp8_attention_scales``: Q and K
    bounded by their norm weights, V by its largest magnitude), the attention is cuDNN's FP8 SDPA
    (``attention.padded_attention_fp8``), and the result is its (B, L, H, D) e4m3 output with the
    (``kernels.FP8_SCALARS``, 4) scalars (the output times ``scalars[DESCALE_V, 0]`` is attention)."""
    from . import cudnn_attention, kernels

    b, seq, _, h, d = qkv.shape
    t = kv.shape[1]
    dtype = torch.float8_e4m3fn if fp8 else qkv.dtype
    weights = (q_weight, k_weight, text_k_weight)
    scalars = kernels.fp8_attention_scales(kv[:, :, 1], mask, qkv[:, :, 2], *weights) if fp8 else None
    mult = scalars[kernels.MULT] if fp8 else None  # (4,): Q's, K's and V's multipliers
    q = torch.empty(b, seq, h, d, device=qkv.device, dtype=dtype)
    keys = torch.empty(b, seq + t, h, d, device=qkv.device, dtype=dtype)
    values = torch.empty_like(keys)
    lengths = cudnn_attention.seq_buffer(b, qkv.device)
    kernels.qk_norm_rope_into(qkv[:, :, 0], q_weight, eps, rope, None, q, None, 0, mult=mult)
    mult = mult[1:] if fp8 else None
    kernels.qk_norm_rope_into(qkv[:, :, 1], k_weight, eps, rope, qkv[:, :, 2], keys, values, 0, mult=mult)
    kernels.qk_norm_rope_into(
        kv[:, :, 0], text_k_weight, eps, None, kv[:, :, 1], keys, values, seq, mask, lengths, seq, mult=mult
    )
    if not fp8:
        return attention.padded_attention(q, keys, values, lengths, scale)
    return attention.padded_attention_fp8(q, keys, values, lengths, scale, scalars), scalars


@torch.library.custom_op(f"{_LIB}::prx_attention", mutates_args=())
def prx_attention(
    img_qkv: torch.Tensor,
    txt_kv: torch.Tensor,
    text_mask: torch.Tensor | None,
    rope: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    text_k_weight: torch.Tensor,
    heads: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """PRX's attention between its projections: what ``PRXAttnProcessor2_0`` computes after
    ``img_qkv_proj`` / ``txt_kv_proj`` and before ``to_out``, as one op.

    Image queries and keys get RMSNorm and RoPE, text keys RMSNorm; then the image queries attend
    over [text keys under the mask; image keys] (``joint_attention``). On CUDA with fp16/bf16 one
    Triton kernel per operand does the norm, the RoPE and the layout change in a single pass
    (TensorRT-RTX runs this chain as several slow fused kernels); elsewhere PyTorch ops run
    diffusers' arithmetic (a named CPU fallback).

    Args:
        img_qkv: (B, L, 3*H*D) output of ``img_qkv_proj``. txt_kv: (B, T, 2*H*D) of ``txt_kv_proj``.
        text_mask: (B, T) bool, True = attend; None = every text token.
        rope: None or (B, 1, L, D/2, 2, 2) fp32, PRX's ``image_rotary_emb``.
        q_weight, k_weight, text_k_weight: (D,) weights of ``norm_q``, ``norm_k``, ``norm_added_k``.
        heads: H. eps: the RMSNorm epsilon. scale: softmax scale.

    Returns:
        (B, L, H*D), the input of ``to_out``.
    """
    return _prx_attention(
        img_qkv, txt_kv, text_mask, rope, q_weight, k_weight, text_k_weight, heads, eps, scale, fp8=None
    )


def _prx_attention_fake(
    img_qkv, txt_kv, text_mask, rope, q_weight, k_weight, text_k_weight, heads, eps, scale
):
    """The shape every ``prx_attention`` variant returns: (B, L, H*D)."""
    b, seq, _ = img_qkv.shape
    return img_qkv.new_empty((b, seq, heads * q_weight.shape[0]))


prx_attention.register_fake(_prx_attention_fake)


@torch.library.custom_op(f"{_LIB}::prx_attention_fp8", mutates_args=())
def prx_attention_fp8(
    img_qkv: torch.Tensor,
    txt_kv: torch.Tensor,
    text_mask: torch.Tensor | None,
    rope: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    text_k_weight: torch.Tensor,
    heads: int,
    eps: float,
    scale: float,
    tile: int = 0,
) -> torch.Tensor:
    """``prx_attention`` with the joint attention in FP8 (``precision: fp8``, ``fp8_attention``).

    Same arguments and result shape, and ``tile``: the kernels' tiling, an index into
    ``fp8_attention.TILES`` (the engine set's measurement chose it: ``ops.choice``). The
    norms and RoPE run as in ``prx_attention``; then queries, keys and values are quantised to e4m3
    with one scale per block of tokens (the tile's) and head, computed on the device, and attention
    runs on FP8 tensor cores (``fp8_attention.joint_attention_fp8``; padded text keys contribute
    nothing). Elsewhere (CPU, or a GPU or head dim the kernels do not take) the named fallback
    ``fp8_attention.joint_attention_fp8_torch`` runs the same quantisation in PyTorch ops with exact
    attention after it.
    """
    from .fp8_attention import TILES

    _expect(0 <= tile < len(TILES), f"tile={tile} is not an index into fp8_attention.TILES")
    return _prx_attention(
        img_qkv, txt_kv, text_mask, rope, q_weight, k_weight, text_k_weight, heads, eps, scale, fp8=tile
    )


@prx_attention_fp8.register_fake
def _(img_qkv, txt_kv, text_mask, rope, q_weight, k_weight, text_k_weight, heads, eps, scale, tile=0):
    return _prx_attention_fake(
        img_qkv, txt_kv, text_mask, rope, q_weight, k_weight, text_k_weight, heads, eps, scale
    )


@torch.library.custom_op(f"{_LIB}::prx_attention_cudnn", mutates_args=())
def prx_attention_cudnn(
    img_qkv: torch.Tensor,
    txt_kv: torch.Tensor,
    text_mask: torch.Tensor | None,
    rope: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    text_k_weight: torch.Tensor,
    heads: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """``prx_attention`` with the joint attention as one cuDNN call (``attention_kernel: cudnn``,
    rule ``lowering.padded_attention``).

    Same arguments and result. The norm/RoPE kernels write the keys and values as [image keys;
    the kept text keys, in order; zeros] and cuDNN's frontend runs one attention under a key-padding
    mask (``ops.cudnn_attention``): exact, as the split path, without its second kernel, bias and
    merge. Where the frontend is not installed or not loadable, or off CUDA, this runs
    ``prx_attention``'s own path (the named fallback).
    """
    return _prx_attention(
        img_qkv,
        txt_kv,
        text_mask,
        rope,
        q_weight,
        k_weight,
        text_k_weight,
        heads,
        eps,
        scale,
        fp8=None,
        padded="cudnn",
    )


prx_attention_cudnn.register_fake(_prx_attention_fake)


@torch.library.custom_op(f"{_LIB}::prx_attention_flash4", mutates_args=())
def prx_attention_flash4(
    img_qkv: torch.Tensor,
    txt_kv: torch.Tensor,
    text_mask: torch.Tensor | None,
    rope: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    text_k_weight: torch.Tensor,
    heads: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """``prx_attention_cudnn``'s layout with the joint attention as one FlashAttention-4 call
    (``attention_kernel: flash4``, rule ``lowering.padded_attention``; ``ops.flash4_attention``).

    Same arguments and result, exact. Where FlashAttention-4 cannot run (not installed, not a
    Hopper GPU, off CUDA) this runs ``prx_attention_cudnn``'s path, itself falling back to
    ``prx_attention``'s (the named fallbacks).
    """
    return _prx_attention(
        img_qkv,
        txt_kv,
        text_mask,
        rope,
        q_weight,
        k_weight,
        text_k_weight,
        heads,
        eps,
        scale,
        fp8=None,
        padded="flash4",
    )


prx_attention_flash4.register_fake(_prx_attention_fake)


@torch.library.custom_op(f"{_LIB}::prx_attention_cudnn_fp8", mutates_args=())
def prx_attention_cudnn_fp8(
    img_qkv: torch.Tensor,
    txt_kv: torch.Tensor,
    text_mask: torch.Tensor | None,
    rope: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    text_k_weight: torch.Tensor,
    heads: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """``prx_attention_cudnn``'s layout in e4m3, with the joint attention as one cuDNN FP8 SDPA call
    (``precision: fp8``, attention candidate "cudnn_fp8", rule ``lowering.padded_attention``).

    Same arguments and result. The norm/RoPE kernels write Q, K and V in e4m3 with one scale per
    tensor, computed on the device: Q and K from their norm weights (an RMS-normalised element is at
    most sqrt(D) x the weight's largest magnitude), V from its largest magnitude (one extra read of
    V). cuDNN's FP8 SDPA on Hopper writes e4m3, scaled by 448 / amax(V) (an output row is a
    softmax-weighted mean of V's rows, so it cannot overflow); one pass scales it back. Padded text
    keys contribute nothing (cuDNN's padding mask). Where cuDNN's FP8 SDPA cannot run (no frontend,
    not Hopper, off CUDA) the same quantisation runs in PyTorch ops with exact attention between (the
    named fallback, ``_joint_fp8_tensor``).
    """
    return _prx_attention(
        img_qkv,
        txt_kv,
        text_mask,
        rope,
        q_weight,
        k_weight,
        text_k_weight,
        heads,
        eps,
        scale,
        fp8=None,
        padded="cudnn_fp8",
    )


prx_attention_cudnn_fp8.register_fake(_prx_attention_fake)


@torch.library.custom_op(f"{_LIB}::prx_attention_cudnn_fp8_linear", mutates_args=())
def prx_attention_cudnn_fp8_linear(
    img_qkv: torch.Tensor,
    txt_kv: torch.Tensor,
    text_mask: torch.Tensor | None,
    rope: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    text_k_weight: torch.Tensor,
    heads: int,
    eps: float,
    scale: float,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``fp8_linear(prx_attention_cudnn_fp8(...), weight_fp8, weight_scale, bias)``: PRX's attention
    and its output projection, (B, L, 3*H*D) ... -> (B, L, N) (rule ``lowering.padded_attention``).

    cuDNN's FP8 SDPA writes the attention in e4m3 with one scale; that tensor is the projection's
    FP8 GEMM input as it is, its scale repeated per row. So the output is not scaled back to bf16 and
    quantised again per row (two passes over it fewer, one rounding fewer). Where cuDNN's FP8 SDPA
    cannot run, it is the composition of the two ops (their fallbacks).
    """
    proj = (weight_fp8, weight_scale, bias)
    n = _check_fp8_weight("weight_fp8", weight_fp8, weight_scale, heads * q_weight.shape[0])
    _expect(bias is None or tuple(bias.shape) == (n,), f"bias must have shape ({n},)")
    return _prx_attention(
        img_qkv,
        txt_kv,
        text_mask,
        rope,
        q_weight,
        k_weight,
        text_k_weight,
        heads,
        eps,
        scale,
        padded="cudnn_fp8",
        proj=proj,
    )


@prx_attention_cudnn_fp8_linear.register_fake
def _(img_qkv, txt_kv, text_mask, rope, q_weight, k_weight, text_k_weight, heads, eps, scale, weight_fp8, *_):
    b, seq, _ = img_qkv.shape
    return img_qkv.new_empty((b, seq, weight_fp8.shape[0]))


def _joint_fp8_tensor(q, k_a, v_a, mask_a, k_b, v_b, scale, scalars):
    """cuDNN's FP8 SDPA as ``prx_attention_cudnn_fp8`` runs it, in PyTorch ops (its named fallback):
    Q, K, V to e4m3 by the per-tensor multipliers of ``scalars`` (``kernels.fp8_attention_scales``),
    exact fp32 attention over [k_a under mask_a; k_b] with P through e4m3 (x448), the output through
    e4m3 (x 448 / amax(V)). Shapes as ``joint_attention``; returns q's dtype."""
    from .kernels import DESCALE_K, DESCALE_Q, DESCALE_V, MULT

    def e4m3(x, mult):
        return (x.float() * mult).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()

    keep = torch.cat([mask_a, torch.ones(k_b.shape[:2], dtype=torch.bool, device=q.device)], 1)
    k = torch.cat([k_a, k_b], 1)
    v = torch.cat([v_a, v_b], 1)
    qf = e4m3(q, scalars[MULT, 0]) * scalars[DESCALE_Q, 0]
    kf = e4m3(k, scalars[MULT, 1]) * scalars[DESCALE_K, 0]
    vf = e4m3(v, scalars[MULT, 2]) * scalars[DESCALE_V, 0]
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    p = torch.softmax(scores.masked_fill(~keep[:, None, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    p = e4m3(p, 448.0) / 448.0
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return (e4m3(out, scalars[MULT, 2]) * scalars[DESCALE_V, 0]).to(q.dtype).contiguous()


def _joint_fp8(q, k_a, v_a, mask_a, k_b, v_b, scale, tile=0):
    from . import fp8_attention as fa

    if fa.supported(q):
        return fa.joint_attention_fp8(q, k_a, v_a, mask_a, k_b, v_b, scale, tile)
    return fa.joint_attention_fp8_torch(q, k_a, v_a, mask_a, k_b, v_b, scale, tile)


def _check_fp8_weight(name: str, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, k: int) -> int:
    _expect(weight_fp8.dim() == 2, f"{name} must be 2-D")
    n, wk = weight_fp8.shape
    _expect(wk == k, f"the input has {k} features, {name} {wk}")
    _expect(weight_fp8.dtype == torch.float8_e4m3fn, f"{name} is {weight_fp8.dtype}, not float8_e4m3fn")
    _expect(tuple(weight_scale.shape) == (n,), f"{name}'s scale is {tuple(weight_scale.shape)}, not ({n},)")
    return n


def _fp8_gemm(
    q: torch.Tensor,
    s: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(M, K) e4m3 with (M, 1) scales @ (N, K).T e4m3 with (N,) scales (+ (N,) bias) -> (M, N) in ``dtype``.

    ``use_fast_accum`` as torchao's float8 inference does (CUDA's row-wise kernel; ignored on a CPU).
    On CUDA the bias is added to the fp32 accumulator in the GEMM's epilogue (one rounding, no
    separate pass: FLUX's 418 biased FP8 linears spent 17.6 ms a step in that add,
    ``flux_v21_fp8_h200.json``); on a CPU after the GEMM, in ``dtype``."""
    n = weight_fp8.shape[0]
    out_dtype = torch.bfloat16 if q.is_cuda else dtype  # CUDA's row-wise kernel writes bf16
    out = torch._scaled_mm(
        q,
        weight_fp8.t(),
        scale_a=s,
        scale_b=weight_scale.float().view(1, n),
        bias=bias.to(out_dtype) if bias is not None and q.is_cuda else None,
        out_dtype=out_dtype,
        use_fast_accum=True,
    )
    out = out.to(dtype)
    return out + bias.to(dtype) if bias is not None and not q.is_cuda else out


@torch.library.custom_op(f"{_LIB}::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """(..., K) @ (N, K).T -> (..., N) in x's dtype, as ``torch._scaled_mm`` over float8_e4m3fn.

    ``weight_fp8`` (N, K) float8_e4m3fn and ``weight_scale`` (N,) fp32 (``quant.fp8.quantize_weight``);
    each row of ``x`` gets its own scale (``kernels.row_quant_fp8``, one Triton pass on CUDA); the
    bias is added in the GEMM's epilogue on CUDA. On a CPU the same quantisation runs with torch ops
    and PyTorch's CPU ``_scaled_mm``, and the bias is added after it.
    """
    return _fp8_linear(x, weight_fp8, weight_scale, bias)


def _fp8_linear(x, weight_fp8, weight_scale, bias):
    from .kernels import row_quant_fp8

    _expect(x.dim() >= 1, "fp8_linear needs x (..., K)")
    k = x.shape[-1]
    n = _check_fp8_weight("weight_fp8", weight_fp8, weight_scale, k)
    _expect(bias is None or tuple(bias.shape) == (n,), f"bias must have shape ({n},)")
    q, s = row_quant_fp8(x.reshape(-1, k).contiguous())
    return _fp8_gemm(q, s, weight_fp8, weight_scale, x.dtype, bias).view(*x.shape[:-1], n)


@fp8_linear.register_fake
def _(x, weight_fp8, weight_scale, bias):
    return x.new_empty((*x.shape[:-1], weight_fp8.shape[0]))


def _norm(
    x: torch.Tensor, mult: torch.Tensor | None, shift: torch.Tensor | None, eps: float | None
) -> tuple | None:
    """The ``kernels.Norm`` of an op's optional ``norm_mult``, ``norm_shift``, ``norm_eps`` for x (B, L, K):
    all three or none; mult and shift broadcast to (B, 1, K) in x's dtype and device."""
    given = [a is not None for a in (mult, shift, eps)]
    if not any(given):
        return None
    _expect(all(given), "norm_mult, norm_shift and norm_eps come together")
    _expect(x.dim() == 3, f"a norm needs x (B, L, K), got {tuple(x.shape)}")
    b, _, k = x.shape
    for name, t in (("norm_mult", mult), ("norm_shift", shift)):
        _expect(
            t.dtype == x.dtype and t.device == x.device and t.dim() <= 3,
            f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}, x {x.dtype} on {x.device}",
        )
        try:
            fits = torch.broadcast_shapes(t.shape, (b, 1, k)) == (b, 1, k)
        except RuntimeError:
            fits = False
        _expect(fits, f"{name} {tuple(t.shape)} does not broadcast to ({b}, 1, {k})")
    _expect(math.isfinite(eps) and eps >= 0, f"norm_eps must be finite and >= 0, got {eps}")
    return (mult.expand(b, 1, k).reshape(b, k), shift.expand(b, 1, k).reshape(b, k), float(eps))


@torch.library.custom_op(f"{_LIB}::fp8_linears", mutates_args=())
def fp8_linears(
    parts: list[torch.Tensor],
    gelu: list[bool],
    weights_fp8: list[torch.Tensor],
    weight_scales: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    norm_mult: torch.Tensor | None = None,
    norm_shift: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> list[torch.Tensor]:
    """``[fp8_linear(x, W_j, S_j, b_j) for each j]`` with ``x = cat([gelu_tanh(p) if g else p for p,
    g in zip(parts, gelu)], -1)``, x quantised once; with ``norm_*``, ``x = layer_norm(p, eps=norm_eps)
    * norm_mult + norm_shift`` of one part p (B, L, K) instead (diffusers' modulated norm).

    parts: (..., K_i) of one dtype and leading shape; weights_fp8 (N_j, sum K_i) float8_e4m3fn with
    (N_j,) fp32 scales and (N_j,) biases or None; norm_mult, norm_shift: broadcast to (B, 1, K).
    Returns one (..., N_j) per weight, in the parts' dtype. On CUDA one Triton pass makes x's e4m3
    rows and scales from one or two parts (``kernels.rows_quant_fp8``: neither the GELU, the
    concatenation nor the modulated norm is written in bf16); each GEMM is ``fp8_linear``'s. On a
    CPU it is that composition exactly.
    """
    from .kernels import rows_quant_fp8

    _expect(len(parts) >= 1 and len(gelu) == len(parts), "fp8_linears needs one gelu flag per part")
    _expect(
        len(weights_fp8) >= 1 and len(weight_scales) == len(biases) == len(weights_fp8),
        "fp8_linears needs one scale and one bias (or None) per weight",
    )
    lead, dtype, device = tuple(parts[0].shape[:-1]), parts[0].dtype, parts[0].device
    _expect(dtype in (torch.bfloat16, torch.float16, torch.float32), f"fp8_linears takes no {dtype} input")
    for i, p in enumerate(parts):
        _expect(
            p.dim() >= 1 and tuple(p.shape[:-1]) == lead and p.shape[-1] > 0 and p.dtype == dtype,
            f"part {i} is {tuple(p.shape)} {p.dtype}, not (*{lead}, K > 0) {dtype}",
        )
        _expect(p.device == device, f"part {i} is on {p.device}, part 0 on {device}")
    k = sum(p.shape[-1] for p in parts)
    outs = []
    for j, (w, sc, b) in enumerate(zip(weights_fp8, weight_scales, biases, strict=True)):
        n = _check_fp8_weight(f"weights_fp8[{j}]", w, sc, k)
        _expect(b is None or tuple(b.shape) == (n,), f"biases[{j}] must have shape ({n},)")
        outs.append(n)
    norm = _norm(parts[0], norm_mult, norm_shift, norm_eps)
    _expect(norm is None or (len(parts) == 1 and not gelu[0]), "a norm takes one part without GELU")
    rows = [p.reshape(math.prod(lead), p.shape[-1]).contiguous() for p in parts]
    q, s = rows_quant_fp8(rows, list(gelu), norm)
    return [
        _fp8_gemm(q, s, w, sc, dtype, b).view(*lead, n)
        for w, sc, b, n in zip(weights_fp8, weight_scales, biases, outs, strict=True)
    ]


@fp8_linears.register_fake
def _(parts, gelu, weights_fp8, weight_scales, biases, norm_mult=None, norm_shift=None, norm_eps=None):
    return [parts[0].new_empty((*parts[0].shape[:-1], w.shape[0])) for w in weights_fp8]


@torch.library.custom_op(f"{_LIB}::fp8_gated_mlp", mutates_args=())
def fp8_gated_mlp(
    x: torch.Tensor,
    gate_fp8: torch.Tensor,
    gate_scale: torch.Tensor,
    up_fp8: torch.Tensor,
    up_scale: torch.Tensor,
    down_fp8: torch.Tensor,
    down_scale: torch.Tensor,
    norm_mult: torch.Tensor | None = None,
    norm_shift: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """``down(gelu(gate(x), approximate="tanh") * up(x))`` with three FP8 GEMMs, (..., K) -> (..., K');
    with ``norm_*``, of ``layer_norm(x, eps=norm_eps) * norm_mult + norm_shift`` (x (B, L, K); mult
    and shift broadcast to (B, 1, K)) instead.

    Each GEMM is ``fp8_linear``'s (bias-free), so the result is that composition, with passes
    fewer: ``x`` (its norm included) is quantised once for gate and up, and the GELU, the product
    and the quantisation for down are one Triton pass on CUDA (``kernels.gelu_mul_quant_fp8``).
    Weights (N, K), (N, K), (K', N) float8_e4m3fn with (N,), (N,), (K',) fp32 scales.
    """
    from .kernels import gelu_mul_quant_fp8, rows_quant_fp8

    _expect(x.dim() >= 1, "fp8_gated_mlp needs x (..., K)")
    k = x.shape[-1]
    n = _check_fp8_weight("gate_fp8", gate_fp8, gate_scale, k)
    _expect(_check_fp8_weight("up_fp8", up_fp8, up_scale, k) == n, "gate and up have different widths")
    out_n = _check_fp8_weight("down_fp8", down_fp8, down_scale, n)
    norm = _norm(x, norm_mult, norm_shift, norm_eps)
    q, s = rows_quant_fp8([x.reshape(-1, k).contiguous()], [False], norm)
    gate = _fp8_gemm(q, s, gate_fp8, gate_scale, x.dtype)
    up = _fp8_gemm(q, s, up_fp8, up_scale, x.dtype)
    hq, hs = gelu_mul_quant_fp8(gate, up)
    return _fp8_gemm(hq, hs, down_fp8, down_scale, x.dtype).view(*x.shape[:-1], out_n)


@fp8_gated_mlp.register_fake
def _(
    x,
    gate_fp8,
    gate_scale,
    up_fp8,
    up_scale,
    down_fp8,
    down_scale,
    norm_mult=None,
    norm_shift=None,
    norm_eps=None,
):
    return x.new_empty((*x.shape[:-1], down_fp8.shape[0]))


@torch.library.custom_op(f"{_LIB}::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: (..., K) @ (N, K).T (+ (N,)) -> (..., N), as an op TensorRT does
    not take, so that it runs in PyTorch (cuBLAS) between engines. Exactly ``aten.linear``."""
    _expect(x.dim() >= 1 and weight.dim() == 2, "linear needs x (..., K) and weight (N, K)")
    n, k = weight.shape
    _expect(x.shape[-1] == k, f"linear: x has {x.shape[-1]} features, weight {k}")
    _expect(bias is None or tuple(bias.shape) == (n,), f"bias must have shape ({n},)")
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{_LIB}::gelu_gate", mutates_args=())
def gelu_gate(x: torch.Tensor, gate_weight: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(F.linear(x, gate_weight), approximate="tanh") * up``: (..., K), (N, K), (..., N) -> (..., N).

    On CUDA with cuDNN's frontend, one GEMM whose epilogue applies the GELU to the fp32 accumulator
    and multiplies by ``up`` (``ops.cudnn_gemm``; the gate is not rounded to the dtype before the
    GELU, so results differ from the composition by the last bit or so). Elsewhere (a CPU, no
    frontend) the composition in PyTorch ops: the named fallback.
    """
    _expect(x.dim() >= 1 and gate_weight.dim() == 2, "gelu_gate needs x (..., K) and gate_weight (N, K)")
    n, k = gate_weight.shape
    _expect(x.shape[-1] == k, f"gelu_gate: x has {x.shape[-1]} features, gate_weight {k}")
    _expect(tuple(up.shape) == (*x.shape[:-1], n), f"gelu_gate: up has shape {tuple(up.shape)}")
    from . import cudnn_gemm

    if x.numel() and cudnn_gemm.supported(x, gate_weight) and up.dtype == x.dtype:
        out = cudnn_gemm.gelu_gate(x.reshape(-1, k).contiguous(), gate_weight, up.reshape(-1, n).contiguous())
        return out.view(*x.shape[:-1], n)
    return F.gelu(F.linear(x, gate_weight), approximate="tanh") * up


@gelu_gate.register_fake
def _(x, gate_weight, up):
    return up.new_empty(up.shape)


def _check_linear(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int) -> int:
    _expect(x.dim() >= 1 and weight.dim() == 2, f"{name} needs x (..., K) and weight (N, K)")
    same = weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    _expect(x.dtype in floats and same, f"{name}: x, weight and bias must share one of {floats}")
    devices = {x.device, weight.device} | ({bias.device} if bias is not None else set())
    _expect(
        len(devices) == 1, f"{name}: x, weight and bias are on {sorted(map(str, devices))}, not one device"
    )
    n, wk = weight.shape
    _expect(wk == k, f"{name}: the input has {k} features, weight {wk}")
    _expect(bias is None or tuple(bias.shape) == (n,), f"{name}: bias must have shape ({n},)")
    return n


@torch.library.custom_op(f"{_LIB}::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gelu(F.linear(x, weight, bias), approximate="tanh")``: (..., K) @ (N, K).T -> (..., N).

    On CUDA with a bias, ``torch._addmm_activation(..., use_gelu=True)``, PyTorch's one call of
    cuBLASLt's bias + GELU epilogue: tanh GELU on the fp32 accumulator, the GELU's input never written
    (results differ from the composition by the last bit or so). Where cuBLASLt cannot take it (a
    non-contiguous bias, ``DISABLE_ADDMM_CUDA_LT=1``) PyTorch runs the GEMM and then a tanh GELU pass,
    the composition. Elsewhere the composition (a CPU's ``_addmm_activation`` computes erf GELU, so
    it is not used there).
    """
    n = _check_linear("linear_gelu", x, weight, bias, x.shape[-1] if x.dim() else 0)
    if x.is_cuda and bias is not None and x.numel():
        out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], n)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


@linear_gelu.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{_LIB}::linear_cat", mutates_args=())
def linear_cat(
    a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(torch.cat([a, b], -1), weight, bias)``: (..., Ka), (..., Kb), (N, Ka + Kb) -> (..., N).

    On CUDA two GEMMs, the second accumulating into the first's output (``addmm_`` over the weight's
    two column blocks, read in place): the (..., Ka + Kb) concatenation is never written. The first
    output is rounded to the dtype before the second adds to it (one rounding more than the
    composition). Elsewhere the composition.
    """
    same = a.dim() >= 1 and b.dim() == a.dim() and a.shape[:-1] == b.shape[:-1]
    _expect(same, f"linear_cat: a {tuple(a.shape)} and b {tuple(b.shape)} differ before their last dim")
    _expect(b.dtype == a.dtype, f"linear_cat: a is {a.dtype}, b {b.dtype}")
    _expect(b.device == a.device, f"linear_cat: a is on {a.device}, b on {b.device}")
    ka, kb = a.shape[-1], b.shape[-1]
    n = _check_linear("linear_cat", a, weight, bias, ka + kb)
    if not (a.is_cuda and b.is_cuda and a.numel() and ka and kb):
        return F.linear(torch.cat([a, b], -1), weight, bias)
    a2, b2 = a.reshape(-1, ka), b.reshape(-1, kb)
    out = F.linear(a2, weight[:, :ka], bias)
    out.addmm_(b2, weight[:, ka:].t())
    return out.view(*a.shape[:-1], n)


@linear_cat.register_fake
def _(a, b, weight, bias):
    return a.new_empty((*a.shape[:-1], weight.shape[0]))


ATTENTION_KERNELS = ("sdpa", "cudnn", "flash4")


@torch.library.custom_op(f"{_LIB}::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernel: str) -> torch.Tensor:
    """Dense attention (no mask) in (B, L, H, D) layout, on the kernel ``kernel`` names: "sdpa"
    (PyTorch's choice), "cudnn" (cuDNN's fused attention) or "flash4" (FlashAttention-4, Hopper).

    Args:
        q: (B, Lq, H, D). k, v: (B, Lk, H, D). scale: softmax scale. kernel: as above; a kernel that
            cannot run here (no CUDA, no package, another dtype) runs the next one down ("flash4" ->
            "cudnn" -> "sdpa"), the named fallbacks; on a CPU that is PyTorch's exact SDPA.

    Returns:
        (B, Lq, H, D) contiguous.
    """
    _expect(q.dim() == 4, f"q has shape {tuple(q.shape)}, expected (B, L, H, D)")
    _expect(kernel in ATTENTION_KERNELS, f"kernel {kernel[:20]!r} is not one of {ATTENTION_KERNELS}")
    b, _, h, d = q.shape
    lk = _bld("k", k, b, h, d)
    _expect(_bld("v", v, b, h, d) == lk, "k and v have different lengths")
    if _flash_supported(q):
        if kernel == "flash4":
            from . import flash4_attention

            if flash4_attention.supported(q):
                out = flash4_attention.kernel()(
                    q.contiguous(), k.contiguous(), v.contiguous(), softmax_scale=scale
                )
                return (out[0] if isinstance(out, tuple) else out).contiguous()
        if kernel in ("flash4", "cudnn"):
            return _dense_part(q, k, v, scale)[0].contiguous()
    return _reference(q, k, v, None, scale).contiguous()


@attention.register_fake
def _(q, k, v, scale, kernel):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def flux_rope(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """FLUX's rotary embedding as rotations: ``cos``, ``sin`` (S, D), each value repeated for its
    pair as diffusers' ``FluxPosEmbed`` makes them -> (1, S, D/2, 2, 2) fp32 ``f`` with
    f[i] = [[cos[2i], -sin[2i]], [sin[2i+1], cos[2i+1]]], so that ``_rope_torch`` and the Triton
    kernel compute diffusers' ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)`` product for product."""
    s, d = cos.shape
    c, n = cos.float().reshape(s, d // 2, 2), sin.float().reshape(s, d // 2, 2)
    even = torch.stack([c[..., 0], -n[..., 0]], -1)
    odd = torch.stack([n[..., 1], c[..., 1]], -1)
    return torch.stack([even, odd], -2)[None]


@torch.library.custom_op(f"{_LIB}::flux_attention", mutates_args=())
def flux_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    text_query: torch.Tensor | None,
    text_key: torch.Tensor | None,
    text_value: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    text_q_weight: torch.Tensor | None,
    text_k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    heads: int,
    eps: float,
    scale: float,
    kernel: str,
) -> torch.Tensor:
    """FLUX's attention between its projections, as one op: what ``FluxAttnProcessor`` computes
    after ``to_q``/``to_k``/``to_v`` (and ``add_*_proj``) and before ``to_out``.

    Queries and keys get ``torch.nn.RMSNorm`` (text ones their own weights), text tokens go first,
    RoPE rotates the whole sequence, then dense attention runs on ``kernel`` (as ``attention``). On
    CUDA with fp16/bf16 one Triton pass per operand normalises, rotates and writes it straight into
    the (B, T + L, H, D) buffer attention reads (TensorRT-RTX ran this chain at a tenth of memory
    bandwidth: ``flux_profile_v18_h200.json``); elsewhere PyTorch ops do it (a named CPU fallback).

    Args:
        query, key, value: (B, L, H*D) image tokens (single blocks: every token).
        text_query, text_key, text_value: (B, T, H*D) text tokens, or all None (single blocks).
        q_weight, k_weight: (D,) ``norm_q``/``norm_k`` weights; text_q_weight, text_k_weight: (D,)
            ``norm_added_q``/``norm_added_k``'s, or None without text.
        cos, sin: (T + L, D) FLUX's ``image_rotary_emb``, or both None.
        heads: H. eps: the norms' epsilon. scale: softmax scale. kernel: "sdpa", "cudnn", "flash4".

    Returns:
        (B, T + L, H*D): text tokens first.
    """
    _expect(
        query.dim() == 3 and heads > 0 and query.shape[2] > 0 and query.shape[2] % heads == 0,
        f"query has shape {tuple(query.shape)}: it must be (B, L, H*D) for heads={heads}",
    )
    b, seq, width = query.shape
    d = width // heads
    text = (text_query, text_key, text_value)
    _expect(all(x is None for x in text) or all(x is not None for x in text), "text q, k, v: all or none")
    t = text_query.shape[1] if text_query is not None else 0
    operands = [("key", key, seq), ("value", value, seq)]
    if text_query is not None:
        operands += [("text_query", text_query, t), ("text_key", text_key, t), ("text_value", text_value, t)]
    for name, x, n in operands:
        want = (b, n, width)
        _expect(tuple(x.shape) == want, f"{name} has shape {tuple(x.shape)}, expected {want}")
    weights = [("q_weight", q_weight), ("k_weight", k_weight)]
    if text_query is not None:
        weights += [("text_q_weight", text_q_weight), ("text_k_weight", text_k_weight)]
    for name, w in weights:
        _expect(w is not None and tuple(w.shape) == (d,), f"{name} must be ({d},)")
    rope = None
    if cos is not None or sin is not None:
        _expect(
            cos is not None and sin is not None and tuple(cos.shape) == tuple(sin.shape) == (t + seq, d),
            f"cos and sin must both be ({t + seq}, {d})",
        )
        _expect(d % 2 == 0, f"RoPE rotates pairs: the head dim {d} must be even")
        rope = flux_rope(cos, sin)
    parts = []  # (q, k, v, q weight, k weight, first row): text first, as FLUX concatenates
    if text_query is not None:
        parts.append((text_query, text_key, text_value, text_q_weight, text_k_weight, 0))
    parts.append((query, key, value, q_weight, k_weight, t))
    from . import kernels

    def heads_of(x):
        return x.reshape(b, x.shape[1], heads, d)

    fused = kernels.norm_rope_supported(heads_of(query)) and all(w.dtype == query.dtype for _, w in weights)
    if fused:  # written where attention reads them: no concatenation
        q = torch.empty(b, t + seq, heads, d, device=query.device, dtype=query.dtype)
        k, v = torch.empty_like(q), torch.empty_like(q)
        for xq, xk, xv, wq, wk, at in parts:
            r = rope[:, at : at + xq.shape[1]] if rope is not None else None
            kernels.qk_norm_rope_into(heads_of(xq), wq, eps, r, None, q, None, at, round_twice=False)
            kernels.qk_norm_rope_into(heads_of(xk), wk, eps, r, heads_of(xv), k, v, at, round_twice=False)
    else:
        qs, ks, vs = [], [], []
        for xq, xk, xv, wq, wk, at in parts:
            r = rope[:, at : at + xq.shape[1]] if rope is not None else None
            for out, x, w in ((qs, xq, wq), (ks, xk, wk)):
                y = F.rms_norm(heads_of(x), (d,), w, eps)
                out.append(_rope_torch(y, r) if r is not None else y)
            vs.append(heads_of(xv))
        q, k, v = (torch.cat(x, 1) for x in (qs, ks, vs))
    return attention(q, k, v, scale, kernel).reshape(b, t + seq, width)


@flux_attention.register_fake
def _(query, key, value, text_query, text_key, text_value, *rest):
    t = text_query.shape[1] if text_query is not None else 0
    return query.new_empty((query.shape[0], t + query.shape[1], query.shape[2]))


# -- the registry: every op above, and when TensorRT leaves it to PyTorch ------------------------
FLASH_ATTENTION = declare(flash_attention, "attention")
JOINT_ATTENTION = declare(joint_attention, "attention")
PRX_ATTENTION = declare(prx_attention, "attention")
PRX_ATTENTION_CUDNN = declare(prx_attention_cudnn, "attention")
PRX_ATTENTION_FLASH4 = declare(prx_attention_flash4, "attention")
PRX_ATTENTION_CUDNN_FP8 = declare(prx_attention_cudnn_fp8, "attention")
PRX_ATTENTION_CUDNN_FP8_LINEAR = declare(prx_attention_cudnn_fp8_linear, "attention")
PRX_ATTENTION_FP8 = declare(prx_attention_fp8, "attention")
ATTENTION = declare(attention, "attention")
FLUX_ATTENTION = declare(flux_attention, "attention")
FP8_LINEAR = declare(fp8_linear, "fp8")
FP8_LINEARS = declare(fp8_linears, "fp8")
FP8_GATED_MLP = declare(fp8_gated_mlp, "fp8")
LINEAR = declare(linear, "linear")
GELU_GATE = declare(gelu_gate, "linear")
LINEAR_GELU = declare(linear_gelu, "linear")
LINEAR_CAT = declare(linear_cat, "linear")
