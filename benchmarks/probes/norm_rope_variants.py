"""A candidate for the Triton Q/K RMSNorm + RoPE kernel, against the shipped one (``_kernels.qk_norm_rope``).

    python benchmarks/probes/norm_rope_variants.py OUT.json      # on a GPU: equality and timings
    TRITON_INTERPRET=1 python benchmarks/probes/norm_rope_variants.py --check   # CPU: equality only

Why: in the FP8 step's profile (``results/fp8_profile_h200.json``) the shipped kernel takes 2.95 ms
for 48 calls at 1024² batch 2, where its memory traffic (read q or k, write it, copy v) needs well
under 1 ms. The shipped kernel reads every row twice, once in order and once through the permuted
index ``e ^ 1`` (each element's RoPE partner), and reads the rotation table the same way; neither
permuted read can be vectorised. The candidate reads each row and its rotations once, contiguously,
and pairs elements in registers (``tl.reshape`` + ``tl.split`` / ``tl.join``).

Written on a CPU and checked there in Triton's interpreter against the shipped kernel; not yet run on
a GPU. Adopt it in ``_kernels`` only after this probe shows it equal and faster on the device.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from prx_compile import _kernels
from prx_compile.bench import time_cuda


@triton.jit
def _norm_rope_v2(
    x, sxb, sxl, sxh, w, f, sfb, sfl, out, v, svb, svl, svh, vout, n_rows, L, H, eps,
    D: tl.constexpr, BR: tl.constexpr, HAS_ROPE: tl.constexpr, COPY_V: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = (r < n_rows)[:, None]
    h = r % H
    t = r // H
    tok = t % L
    b = t // L
    e = tl.arange(0, D)
    xv = tl.load(x + (b * sxb + tok * sxl + h * sxh)[:, None] + e[None, :], mask=rm, other=0.0)
    xf = xv.to(tl.float32)
    rs = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 1) / D + eps)
    y = (xf * rs[:, None]).to(xv.dtype).to(tl.float32)  # diffusers' RMSNorm rounds before the weight
    y = (y * tl.load(w + e).to(tl.float32)[None, :]).to(xv.dtype).to(tl.float32)
    if HAS_ROPE:
        # f[b, l] is (D/2, 2, 2): out[2i + j] = f[i, j, 0] x[2i] + f[i, j, 1] x[2i + 1]
        ye, yo = tl.split(tl.reshape(y, (BR, D // 2, 2)))
        q = tl.arange(0, 2 * D)  # the (D/2, 2, 2) table of one token, flat
        fr = tl.load(f + (b * sfb + tok * sfl)[:, None] + q[None, :], mask=rm, other=0.0)
        f_k0, f_k1 = tl.split(tl.reshape(fr, (BR, D // 2, 2, 2)))  # f[i, j, 0] and f[i, j, 1]
        f00, f10 = tl.split(f_k0)
        f01, f11 = tl.split(f_k1)
        y = tl.reshape(tl.join(f00 * ye + f01 * yo, f10 * ye + f11 * yo), (BR, D))
    dst = (r * D)[:, None] + e[None, :]
    tl.store(out + dst, y.to(out.dtype.element_ty), mask=rm)
    if COPY_V:
        val = tl.load(v + (b * svb + tok * svl + h * svh)[:, None] + e[None, :], mask=rm, other=0.0)
        tl.store(vout + dst, val, mask=rm)


def qk_norm_rope_v2(x, weight, eps, rope=None, v=None, br=64, num_warps=4):
    """Same contract as ``_kernels.qk_norm_rope``."""
    b, seq, h, d = x.shape
    out = torch.empty((b, seq, h, d), device=x.device, dtype=x.dtype)
    vout = torch.empty_like(out) if v is not None else out
    if rope is not None:
        rope = rope.expand(b, seq, d // 2, 2, 2)
        if rope.stride()[2:] != (4, 2, 1):
            rope = rope.contiguous()
    n_rows = b * seq * h
    _norm_rope_v2[(triton.cdiv(n_rows, br),)](
        x, x.stride(0), x.stride(1), x.stride(2), weight.contiguous(),
        rope if rope is not None else x,
        rope.stride(0) if rope is not None else 0, rope.stride(1) if rope is not None else 0,
        out, v if v is not None else x,
        v.stride(0) if v is not None else 0, v.stride(1) if v is not None else 0,
        v.stride(2) if v is not None else 0,
        vout, n_rows, seq, h, eps,
        D=d, BR=br, HAS_ROPE=rope is not None, COPY_V=v is not None, num_warps=num_warps,
    )  # fmt: skip
    return out, (vout if v is not None else None)


def operands(b, seq, heads, d, device):
    """PRX's q/k/v as slices of one fused projection, and its rotations."""
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(b, seq, 3, heads, d, generator=g, device=device).to(torch.bfloat16) * 3
    w = (1 + 0.1 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16)
    ang = torch.rand(b, seq, d // 2, generator=g, device=device) * 6.3
    c, s = ang.cos(), ang.sin()
    rope = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)  # (B, L, D/2, 2, 2)
    return qkv[:, :, 1], w, rope, qkv[:, :, 2]


def check(device: str, b=2, seq=24, heads=3, d=32) -> dict:
    k, w, rope, v = operands(b, seq, heads, d, device)
    (a, av), (c, cv) = _kernels.qk_norm_rope(k, w, 1e-6, rope, v), qk_norm_rope_v2(k, w, 1e-6, rope, v)
    ref = _kernels_ref(k, w, rope)
    return {
        "max_abs_vs_shipped": (a.float() - c.float()).abs().max().item(),
        "v_equal": bool(torch.equal(av, cv)),
        "max_abs_vs_torch": (c.float() - ref.float()).abs().max().item(),
        "shipped_max_abs_vs_torch": (a.float() - ref.float()).abs().max().item(),
    }


def _kernels_ref(k, w, rope):
    from prx_compile.ops import qk_norm_rope_torch

    return qk_norm_rope_torch(k, w, 1e-6, rope)


def main() -> None:
    if "--check" in sys.argv:  # CPU: TRITON_INTERPRET=1 (launches below run through the interpreter)
        assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
        print(check("cpu"))
        return
    out = sys.argv[1]
    rows = {"check": check("cuda")}
    k, w, rope, v = operands(2, 4096, 14, 128, "cuda")  # PRX at 1024² batch 2: 14 heads of 128
    for name, fn in (
        ("shipped", lambda: _kernels.qk_norm_rope(k, w, 1e-6, rope, v)),
        *(
            (f"v2 br={br} warps={nw}", lambda br=br, nw=nw: qk_norm_rope_v2(k, w, 1e-6, rope, v, br, nw))
            for br in (16, 32, 64)
            for nw in (4, 8)
        ),
    ):
        rows[name] = time_cuda(fn, warmup=5, iters=50)["ms"]
        print(name, rows[name], flush=True)
    with open(out, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
