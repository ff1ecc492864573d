"""Issue 24's attention probe: FP8 joint attention (our Triton kernels) against the bf16 path we ship
(cuDNN dense over the image keys + cuDNN masked over the text keys, merged by log-sum-exp).

    python benchmarks/probes/fp8_attention.py OUT.json

PRX's attention shapes (28 heads of 64, 256 text keys under the pipeline's mask: row 0 keeps 200,
row 1 keeps 40 — and 1 in the single-token check), queries and keys RMS-normalised as PRX's QK norms
leave them, times a sharpness factor on the queries (1: near-uniform softmax, 4: peaked). For each
shape: the bf16 path's ms, the FP8 kernels' ms for several tile / warp / stage choices, each one's
relative error against exact fp32 attention, and the bf16 path's. Then the whole op
(``prx_attention`` vs ``prx_attention_fp8``, norms + RoPE included) and whether the compiled kernel
uses Hopper's FP8 warpgroup MMA (``wgmma ... e4m3`` in its PTX).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from prx_compile.ops import fp8_attention as fa
from prx_compile.ops import library

H, D, T = 28, 64, 256
SHAPES = {"1024² b2": (2, 4096), "1024² b1": (1, 4096), "832x1216 b2": (2, 52 * 76)}
CONFIGS = [  # (block_m, block_n, num_warps, num_stages)
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 4),
    (128, 128, 4, 3),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 3),
]


def ms(fn, iters=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def rms_norm(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def inputs(b, lq, sharp, kept=(200, 40), seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)

    q = rms_norm(r(b, lq, H, D)) * sharp
    k_b, v_b = rms_norm(r(b, lq, H, D)), r(b, lq, H, D)
    k_a, v_a = rms_norm(r(b, T, H, D)), r(b, T, H, D)
    mask = torch.zeros(b, T, dtype=torch.bool, device="cuda")
    for i in range(b):
        mask[i, : kept[i % len(kept)]] = True
    k_a = k_a.masked_fill(~mask[:, :, None, None], 1e4)  # padded keys hold garbage: must not matter
    return q, k_a, v_a, mask, k_b, v_b


def exact(q, k_a, v_a, mask, k_b, v_b, scale):
    keep = torch.cat([mask, torch.ones(k_b.shape[:2], dtype=torch.bool, device="cuda")], 1)
    return library._reference(
        q.float(), torch.cat([k_a, k_b], 1).float(), torch.cat([v_a, v_b], 1).float(), keep, scale
    )


def uses_fp8_wgmma() -> dict:
    _, attention, _ = fa._kernels()
    found = {}
    try:
        for cache in attention.device_caches.values():
            for kernel in cache[0].values():
                ptx = kernel.asm.get("ptx", "")
                found[str(kernel.metadata.num_warps)] = {
                    "wgmma": "wgmma.mma_async" in ptx,
                    "e4m3": "e4m3" in ptx,
                    "shared_bytes": kernel.metadata.shared,
                }
    except Exception as e:  # the probe reports what it could not read
        found["error"] = f"{type(e).__name__}: {e}"
    return found


def main(out: str) -> None:
    scale = D**-0.5
    res = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}, "shapes": {}}
    t0 = time.time()
    for name, (b, lq) in SHAPES.items():
        row = {"bf16_cudnn": {}, "fp8": []}
        for sharp in (1.0, 4.0):
            x = inputs(b, lq, sharp)
            ref = exact(*x, scale)
            bf = library._joint(*x, scale)
            row["bf16_cudnn"][f"rel_err_sharp{sharp:g}"] = rel(bf, ref)
            if sharp == 1.0:
                row["bf16_cudnn"]["ms"] = ms(lambda x=x: library._joint(*x, scale))
                twin = fa.joint_attention_fp8_torch(*x, scale)
                row["twin_rel_err_sharp1"] = rel(twin, ref)
            for bm, bn, w, st in CONFIGS:
                kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                try:
                    o = fa.joint_attention_fp8(*x, scale, **kw)
                    rec = {**kw, "sharp": sharp, "rel_err": rel(o, ref), "nan": bool(o.isnan().any())}
                    if sharp == 1.0:
                        rec["ms"] = ms(lambda x=x, kw=kw: fa.joint_attention_fp8(*x, scale, **kw))
                        if (bm, bn) == (fa.BLOCK_M, fa.BLOCK_N):
                            rec["rel_err_vs_twin"] = rel(o, twin)
                except Exception as e:
                    rec = {**kw, "sharp": sharp, "error": f"{type(e).__name__}: {e}"[:300]}
                row["fp8"].append(rec)
                print(name, rec, flush=True)
            del ref
        # one valid text token in every row, and a garbage-free copy: padded keys must not matter
        x = inputs(b, lq, 1.0, kept=(1,))
        clean = list(x)
        clean[1] = x[1].masked_fill(~x[3][:, :, None, None], 0.0)
        o1, o2 = fa.joint_attention_fp8(*x, scale), fa.joint_attention_fp8(*clean, scale)
        row["single_token"] = {"rel_err": rel(o1, exact(*x, scale)), "padding_changes_output": rel(o1, o2)}
        res["shapes"][name] = row
        print(name, "bf16", row["bf16_cudnn"], "single", row["single_token"], f"{time.time() - t0:.0f} s")
    res["ptx"] = uses_fp8_wgmma()
    # the whole op at 1024² b2: norms + RoPE + attention
    b, lq = SHAPES["1024² b2"]
    g = torch.Generator(device="cuda").manual_seed(1)
    img_qkv = torch.randn(b, lq, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
    txt_kv = torch.randn(b, T, 2 * H * D, device="cuda", generator=g).to(torch.bfloat16)
    mask = torch.zeros(b, T, dtype=torch.bool, device="cuda")
    mask[0, :200], mask[1, :40] = True, True
    ang = torch.rand(b, 1, lq, D // 2, device="cuda", generator=g) * 6.28
    rope = torch.stack([torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang)], -1)
    rope = rope.view(b, 1, lq, D // 2, 2, 2)
    w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    args = (img_qkv, txt_kv, mask, rope, w, w, w, H, 1e-6, scale)
    a16 = torch.ops.prx_compile.prx_attention(*args)
    a8 = torch.ops.prx_compile.prx_attention_fp8(*args)
    res["op_1024_b2"] = {
        "prx_attention_ms": ms(lambda: torch.ops.prx_compile.prx_attention(*args)),
        "prx_attention_fp8_ms": ms(lambda: torch.ops.prx_compile.prx_attention_fp8(*args)),
        "rel_err_fp8_vs_bf16": rel(a8, a16),
    }
    print(res["op_1024_b2"], res["ptx"], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
