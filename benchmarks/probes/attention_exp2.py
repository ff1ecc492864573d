"""Issue 24's softmax probe: the FP8 attention kernels with part of the softmax's exp2 moved from the
MUFU pipe (16 exp2 per clock per SM on Hopper) to the FMA pipe by a polynomial (``poly`` quarters of
the columns, ``ops.fp8_attention_kernels._exp2``).

    git checkout 5336789 -- prx_compile/ops   # the kernels with ``poly``, removed after this probe
    python benchmarks/probes/attention_exp2.py OUT.json

Result (``attention_exp2_h200.json``): every ``poly`` > 0 ran slower (1024² b2, back-to-back: 0.602 ms
with MUFU only, 0.73 / 0.83 / 1.17 ms with a half / all / a quarter on the FMA pipe), so the kernels
keep ``tl.exp2`` and the parameter was taken out again.

At PRX's joint-attention shapes (inputs of ``fp8_attention.py``'s probe: 28 heads of 64, 256 text keys
under the pipeline's mask, RMS-normalised queries and keys), for each tile choice and ``poly`` in 0, 1,
2, 4: the median ms of one call and the back-to-back average (CUDA events), the relative error against
exact fp32 attention (sharpness 1 and 4) and against ``poly=0``, NaN flags; the bf16 path we ship
(cuDNN) for reference. Then the whole ``prx_attention_fp8`` op at 1024² b2 for each ``poly``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_attention import SHAPES, D, exact, inputs, ms, rel  # noqa: E402

from prx_compile.ops import fp8_attention as fa  # noqa: E402
from prx_compile.ops import library  # noqa: E402

TILES = [(128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3)]  # (block_m, block_n, num_warps, num_stages)
POLYS = (0, 1, 2, 4)


def loop_ms(fn, iters=50) -> float:
    """Back-to-back average ms over ``iters`` calls (launch gaps hidden, as in a CUDA graph)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main(out: str) -> None:
    scale = D**-0.5
    res = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}, "shapes": {}}
    t0 = time.time()
    for name, (b, lq) in SHAPES.items():
        x1, x4 = inputs(b, lq, 1.0), inputs(b, lq, 4.0)
        ref1, ref4 = exact(*x1, scale), exact(*x4, scale)
        row = {
            "bf16_cudnn_ms": ms(lambda x=x1: library._joint(*x, scale)),
            "bf16_cudnn_loop_ms": loop_ms(lambda x=x1: library._joint(*x, scale)),
            "runs": [],
        }
        for bm, bn, w, st in TILES:
            base = None
            for poly in POLYS:
                kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st, poly=poly)
                try:
                    o1 = fa.joint_attention_fp8(*x1, scale, **kw)
                    o4 = fa.joint_attention_fp8(*x4, scale, **kw)
                    base = o1 if poly == 0 else base
                    rec = {
                        **kw,
                        "ms": ms(lambda kw=kw, x=x1: fa.joint_attention_fp8(*x, scale, **kw)),
                        "loop_ms": loop_ms(lambda kw=kw, x=x1: fa.joint_attention_fp8(*x, scale, **kw)),
                        "rel_err_sharp1": rel(o1, ref1),
                        "rel_err_sharp4": rel(o4, ref4),
                        "rel_vs_poly0": rel(o1, base) if base is not None else None,
                        "nan": bool(o1.isnan().any() or o4.isnan().any()),
                    }
                except Exception as e:  # a variant that does not compile is a result too
                    rec = {**kw, "error": f"{type(e).__name__}: {e}"[:300]}
                row["runs"].append(rec)
                print(name, rec, f"{time.time() - t0:.0f} s", flush=True)
        res["shapes"][name] = row
        with open(out, "w") as f:
            json.dump(res, f, separators=(",", ":"))
    # the whole op at 1024² b2 (norms + RoPE + attention), each poly
    b, lq = SHAPES["1024² b2"]
    h = 28
    g = torch.Generator(device="cuda").manual_seed(1)
    img_qkv = torch.randn(b, lq, 3 * h * D, device="cuda", generator=g).to(torch.bfloat16)
    txt_kv = torch.randn(b, 256, 2 * h * D, device="cuda", generator=g).to(torch.bfloat16)
    mask = torch.zeros(b, 256, dtype=torch.bool, device="cuda")
    mask[0, :200], mask[1, :40] = True, True
    ang = torch.rand(b, 1, lq, D // 2, device="cuda", generator=g) * 6.28
    rope = torch.stack([torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang)], -1)
    rope = rope.view(b, 1, lq, D // 2, 2, 2)
    wt = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    args = (img_qkv, txt_kv, mask, rope, wt, wt, wt, h, 1e-6, scale)
    op = {"prx_attention_loop_ms": loop_ms(lambda: torch.ops.prx_compile.prx_attention(*args))}
    default = fa.POLY
    try:
        for poly in POLYS:
            fa.POLY = poly  # the probe's own process: the op reads the module default
            op[f"prx_attention_fp8_poly{poly}_loop_ms"] = loop_ms(
                lambda: torch.ops.prx_compile.prx_attention_fp8(*args)
            )
    finally:
        fa.POLY = default
    res["op_1024_b2"] = op
    print(op, flush=True)
    with open(out, "w") as f:
        json.dump(res, f, separators=(",", ":"))


if __name__ == "__main__":
    main(sys.argv[1])
