"""Device probe: exact ways to run PRX joint attention (masked text keys + image keys) fast.

python benchmarks/probe_attention.py --out $OUT   (writes attention.json)
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

from prx_compile.bench import rel_err, time_cuda
from prx_compile.ops import _reference

aten = torch.ops.aten


def main(out_dir: str) -> dict:
    torch.manual_seed(0)
    b, lq, lt, h, d = 2, 4096, 256, 28, 64
    scale = d**-0.5
    q = torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(b, lt, h, d, device="cuda", dtype=torch.bfloat16)
    vt = torch.randn(b, lt, h, d, device="cuda", dtype=torch.bfloat16)
    ki = torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16)
    vi = torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16)
    mt = torch.ones(b, lt, dtype=torch.bool, device="cuda")
    mt[1, 56:] = False
    mt[1, 7] = False
    k, v = torch.cat([kt, ki], 1), torch.cat([vt, vi], 1)
    full_mask = torch.cat([mt, torch.ones(b, lq, dtype=torch.bool, device="cuda")], 1)
    ref = _reference(q.float(), k.float(), v.float(), full_mask, scale)
    T = lambda x: x.transpose(1, 2)  # noqa: E731
    res: dict = {}

    def rec(name, fn, check=True):
        try:
            out = fn()
            r = {"ms": time_cuda(fn, iters=30)["ms"]}
            if check:
                r["rel_err"] = rel_err(out, ref)
            res[name] = r
        except Exception as e:
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(name, res[name], flush=True)

    # pieces ------------------------------------------------------------------
    rec(
        "img_fa2_dense",
        lambda: aten._scaled_dot_product_flash_attention(T(q), T(ki), T(vi), scale=scale)[0],
        False,
    )
    rec(
        "img_cudnn_dense",
        lambda: aten._scaled_dot_product_cudnn_attention(
            T(q), T(ki), T(vi), None, True, 0.0, False, False, scale=scale
        )[0],
        False,
    )
    rec(
        "joint_fa2_dense_nomask_inexact",
        lambda: aten._scaled_dot_product_flash_attention(T(q), T(k), T(v), scale=scale)[0],
        False,
    )
    rec(
        "joint_cudnn_dense_nomask_inexact",
        lambda: aten._scaled_dot_product_cudnn_attention(
            T(q), T(k), T(v), None, True, 0.0, False, False, scale=scale
        )[0],
        False,
    )
    try:
        o, lse = aten._scaled_dot_product_cudnn_attention(
            T(q), T(ki), T(vi), None, True, 0.0, False, False, scale=scale
        )[:2]
        res["cudnn_shapes"] = {
            "out": list(o.shape),
            "out_stride": list(o.stride()),
            "lse": list(lse.shape),
            "lse_stride": list(lse.stride()),
            "lse_dtype": str(lse.dtype),
        }
        o, lse = aten._scaled_dot_product_flash_attention(T(q), T(ki), T(vi), scale=scale)[:2]
        res["fa2_shapes"] = {
            "out": list(o.shape),
            "out_stride": list(o.stride()),
            "lse": list(lse.shape),
            "lse_stride": list(lse.stride()),
        }
    except Exception as e:
        res["shapes_error"] = str(e)[:300]

    n = mt.sum(1, dtype=torch.int32)
    cu_q = torch.arange(0, (b + 1) * lq, lq, device="cuda", dtype=torch.int32)
    cu_t = torch.arange(0, (b + 1) * lt, lt, device="cuda", dtype=torch.int32)

    def text_varlen():
        order = torch.argsort((~mt).to(torch.int8), dim=1, stable=True)
        flat = (order + torch.arange(b, device="cuda")[:, None] * lt).reshape(-1)
        kp = kt.reshape(b * lt, h, d).index_select(0, flat)
        vp = vt.reshape(b * lt, h, d).index_select(0, flat)
        return aten._flash_attention_forward(
            q.reshape(b * lq, h, d), kp, vp, cu_q, cu_t, lq, lt, 0.0, False, False, scale=scale, seqused_k=n
        )

    rec("txt_fa2_varlen_compact", lambda: text_varlen()[0], False)
    try:
        o, lse = text_varlen()[:2]
        res["varlen_shapes"] = {
            "out": list(o.shape),
            "lse": list(lse.shape),
            "lse_stride": list(lse.stride()),
        }
        zero = aten._flash_attention_forward(
            q.reshape(b * lq, h, d),
            kt.reshape(b * lt, h, d),
            vt.reshape(b * lt, h, d),
            cu_q,
            cu_t,
            lq,
            lt,
            0.0,
            False,
            False,
            scale=scale,
            seqused_k=torch.zeros(b, dtype=torch.int32, device="cuda"),
        )
        res["varlen_seqused0"] = {
            "out_all_zero": bool((zero[0] == 0).all()),
            "lse_sample": float(zero[1].flatten()[0]),
            "finite": bool(torch.isfinite(zero[0]).all()),
        }
    except Exception as e:
        res["varlen_error"] = str(e)[:300]
    bias = torch.zeros(b, 1, 1, lt, device="cuda", dtype=q.dtype).masked_fill(
        ~mt[:, None, None, :], float("-inf")
    )
    rec(
        "txt_efficient_bias",
        lambda: aten._scaled_dot_product_efficient_attention(
            T(q), T(kt), T(vt), bias.expand(b, h, lq, lt), True, scale=scale
        )[0],
        False,
    )
    rec(
        "txt_cudnn_bias",
        lambda: aten._scaled_dot_product_cudnn_attention(
            T(q), T(kt), T(vt), bias.expand(b, h, lq, lt), True, 0.0, False, False, scale=scale
        )[0],
        False,
    )

    # merge -------------------------------------------------------------------
    from prx_compile import _kernels

    o1, l1 = aten._scaled_dot_product_flash_attention(T(q), T(ki), T(vi), scale=scale)[:2]
    o2, l2 = aten._scaled_dot_product_efficient_attention(
        T(q), T(kt), T(vt), bias.expand(b, h, lq, lt), True, scale=scale
    )[:2]
    l2 = l2[:, :, :lq]
    rec("merge_torch", lambda: _kernels.merge_torch(T(o1), l1, T(o2), l2), False)
    rec("merge_triton", lambda: _kernels.merge(T(o1), l1, T(o2), l2), False)
    res["merge_triton_vs_torch"] = rel_err(
        _kernels.merge(T(o1), l1, T(o2), l2), _kernels.merge_torch(T(o1), l1, T(o2), l2)
    )
    res["merge_rel_err_vs_ref"] = rel_err(_kernels.merge(T(o1), l1, T(o2), l2), ref)

    # the op candidates end to end --------------------------------------------
    from prx_compile.ops import joint_attention

    for impl in ("cudnn+cudnn", "cudnn+varlen"):
        rec(f"joint_op[{impl}]", lambda impl=impl: joint_attention(q, kt, vt, mt, ki, vi, scale, impl))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og = joint_attention(q, kt, vt, mt, ki, vi, scale, "auto")
    g.replay()
    torch.cuda.synchronize()
    res["joint_graph_capture_rel_err"] = rel_err(og, ref)
    dead = torch.zeros_like(mt)
    res["all_text_masked_rel_err"] = rel_err(
        joint_attention(q, kt, vt, dead, ki, vi, scale, "auto"),
        _reference(q.float(), k.float(), v.float(), torch.cat([dead, full_mask[:, lt:]], 1), scale),
    )
    with open(f"{out_dir}/attention.json", "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    print(json.dumps(main(ap.parse_args().out), indent=1))
