"""Device probe: the facts the design depends on, measured in one call (results -> $OUT/probe.json).

Run on the GPU machine with the device kit:  python benchmarks/probe_device.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
import traceback

import torch

from prx_compile import compile_prx
from prx_compile.bench import rel_err, time_cuda
from prx_compile.export import example_inputs
from prx_compile.ops import _reference, flash_attention
from prx_compile.testing import make_prx

RESULTS: dict = {}
T0 = time.time()


def section(name):
    def deco(fn):
        @functools.wraps(fn)
        def run(*a, **k):
            print(f"\n=== {name} (t={time.time() - T0:.0f}s)", flush=True)
            try:
                RESULTS[name] = fn(*a, **k)
            except Exception as e:  # keep going: one call must return every fact it can
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(RESULTS[name], indent=1, default=str)[:3000], flush=True)

        return run

    return deco


@section("env")
def env():
    import diffusers
    import tensorrt
    import torch_tensorrt

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torch_tensorrt": torch_tensorrt.__version__,
        "tensorrt": tensorrt.__version__,
        "diffusers": diffusers.__version__,
        "flash_schema": str(torch.ops.aten._flash_attention_forward.default._schema),
    }


@section("flash_op")
def flash_op():
    torch.manual_seed(0)
    b, lq, lt, h, d = 3, 4096, 256, 28, 64
    lk = lq + lt
    q = torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, lk, h, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, lk, h, d, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(b, lk, dtype=torch.bool, device="cuda")
    mask[1, 40:lt] = False  # some text padded
    mask[2, :lt] = False  # every text token hidden
    mask[1, 7] = False  # a hole in the middle, not only right padding
    scale = d**-0.5
    out = flash_attention(q, k, v, mask, scale)
    ref = _reference(q.float(), k.float(), v.float(), mask, scale)
    res = {"rel_err_vs_fp32": rel_err(out, ref), "finite": bool(torch.isfinite(out).all())}
    dead = torch.zeros(1, 64, h, d, device="cuda", dtype=torch.bfloat16)
    none = torch.zeros(1, 64, dtype=torch.bool, device="cuda")
    res["all_keys_masked_is_zero"] = bool((flash_attention(dead, dead, dead, none, scale) == 0).all())
    q2, k2, v2, m2 = q[:2], k[:2], v[:2], mask[:2]
    res["ms_flash_op_masked"] = time_cuda(lambda: flash_attention(q2, k2, v2, m2, scale))["ms"]
    tq, tk, tv = (x.transpose(1, 2) for x in (q2, k2, v2))
    res["ms_sdpa_nomask"] = time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv))[
        "ms"
    ]
    bm = m2[:, None, None, :]
    res["ms_sdpa_boolmask"] = time_cuda(
        lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=bm)
    )["ms"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o = flash_attention(q2, k2, v2, m2, scale)
    g.replay()
    torch.cuda.synchronize()
    res["graph_capture_ok"] = rel_err(o, flash_attention(q2, k2, v2, m2, scale)) == 0.0
    return res


@section("attention_variants")
def attention_variants():
    """Exact ways to run PRX attention under a text key mask; times for B=2, 4096 queries, 256+4096 keys."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    b, lq, lt, h, d = 2, 4096, 256, 28, 64
    lk = lt + lq
    q = torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, lk, h, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, lk, h, d, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(b, lk, dtype=torch.bool, device="cuda")
    mask[1, 56:lt] = False
    scale = d**-0.5
    ref = _reference(q.float(), k.float(), v.float(), mask, scale)
    n = mask.sum(1, dtype=torch.int32)
    cu_q = torch.arange(0, (b + 1) * lq, lq, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(0, (b + 1) * lk, lk, device="cuda", dtype=torch.int32)

    def varlen(kp, vp, used):
        return torch.ops.aten._flash_attention_forward(
            q.reshape(b * lq, h, d),
            kp.reshape(b * lk, h, d),
            vp.reshape(b * lk, h, d),
            cu_q,
            cu_k,
            lq,
            lk,
            0.0,
            False,
            False,
            scale=scale,
            seqused_k=used,
        )[0].view(b, lq, h, d)

    def v_index_select():
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
        flat = (order + torch.arange(b, device="cuda")[:, None] * lk).reshape(-1)
        kp = k.reshape(b * lk, h, d).index_select(0, flat)
        vp = v.reshape(b * lk, h, d).index_select(0, flat)
        return varlen(kp, vp, n)

    def v_split_lse():
        qt = q.transpose(1, 2)
        o1, lse1 = torch.ops.aten._scaled_dot_product_flash_attention(
            qt, k[:, lt:].transpose(1, 2), v[:, lt:].transpose(1, 2), scale=scale
        )[:2]
        bias = torch.zeros(b, 1, lq, lt, device="cuda", dtype=q.dtype).masked_fill(
            ~mask[:, None, None, :lt], float("-inf")
        )
        o2, lse2 = torch.ops.aten._scaled_dot_product_efficient_attention(
            qt,
            k[:, :lt].transpose(1, 2),
            v[:, :lt].transpose(1, 2),
            bias.expand(b, h, lq, lt),
            True,
            scale=scale,
        )[:2]
        lse = torch.logaddexp(lse1, lse2)
        w1 = torch.exp(lse1 - lse)[..., None]
        w2 = torch.nan_to_num(torch.exp(lse2 - lse))[..., None]
        return (o1.float() * w1 + o2.float() * w2).to(q.dtype).transpose(1, 2)

    def v_cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask[:, None, None, :],
                scale=scale,
            ).transpose(1, 2)

    res = {}
    variants = {
        "current_op": lambda: flash_attention(q, k, v, mask, scale),
        "varlen_identity_inexact": lambda: varlen(k, v, n),
        "index_select_varlen": v_index_select,
        "split_lse": v_split_lse,
        "cudnn_boolmask": v_cudnn,
        "dense_flash_nomask_inexact": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
        ),
    }
    for name, fn in variants.items():
        try:
            out = fn()
            res[name] = {"ms": time_cuda(fn, iters=20)["ms"], "rel_err": rel_err(out, ref)}
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return res


SMALL = dict(
    in_channels=16,
    patch_size=2,
    context_in_dim=256,
    hidden_size=512,
    mlp_ratio=3.5,
    num_heads=8,
    depth=2,
    axes_dim=[32, 32],
)


def small_case(form, patchify="reshape", cuda_graphs=True):
    model = make_prx(SMALL, patchify=patchify, dtype=torch.bfloat16, device="cuda")
    kw = example_inputs(model.config, 2, 64, 64, 64, dtype=torch.bfloat16, device="cuda", masked_tokens=40)
    with torch.no_grad():
        ref = model(**kw, return_dict=False)[0]
    ct = compile_prx(
        model,
        attention=form,
        cuda_graphs=cuda_graphs,
        batch=[1, 2],
        resolution=512,
        aspect_bins=[],
        text_len=[8, 64],
    )
    t0 = time.time()
    out = ct(**kw, return_dict=False)[0]
    res = {
        "first_call_s": time.time() - t0,
        "rel_err": rel_err(out, ref),
        "nan": bool(out.isnan().any()),
        **ct.report(),
    }
    res["ms"] = time_cuda(lambda: ct(**kw, return_dict=False))["ms"]
    with torch.no_grad():
        res["ms_eager"] = time_cuda(lambda: model(**kw, return_dict=False))["ms"]
    return model, kw, ct, res


@section("small_flash")
def small_flash():
    model, kw, ct, res = small_case("flash")
    be = ct.backend
    eng = __import__("prx_compile.backends.trt_shim", fromlist=["x"])
    mods = eng.engine_modules(be.mttm.gm)
    wmaps = [eng.weight_name_map(m) for _, m in mods]
    res["weight_map_sample"] = [list(w.items())[:4] for w in wmaps[:2]]
    res["weight_map_sizes"] = [len(w) for w in wmaps]
    res["provenance_size"] = len(be.provenance)
    res["provenance_sample"] = list(be.provenance.items())[:8]
    res["engine_module_types"] = sorted({type(m).__name__ for _, m in mods})
    res["live_engine"] = eng.live_engine(mods[0][1]) is not None
    # refit: perturb every linear of block 0 in place, refit, compare with eager
    names = [n for n, p in model.named_parameters() if n.startswith("blocks.0.") and p.dim() == 2]
    with torch.no_grad():
        for n in names:
            p = dict(model.named_parameters())[n]
            p.add_(torch.randn_like(p) * 0.05)
        ref2 = model(**kw, return_dict=False)[0]
    rep = ct.weights_changed(names)
    out2 = ct(**kw, return_dict=False)[0]
    res["refit"] = {
        **rep,
        "rel_err_after": rel_err(out2, ref2),
        "n_params": len(names),
        "engines_after": ct.report()["engines"],
    }
    # second shape through the same build: batch 1, another aspect
    kw1 = example_inputs(model.config, 1, 48, 80, 64, dtype=torch.bfloat16, device="cuda", masked_tokens=10)
    with torch.no_grad():
        ref3 = model(**kw1, return_dict=False)[0]
    out3 = ct(**kw1, return_dict=False)[0]
    res["other_shape"] = {
        "rel_err": rel_err(out3, ref3),
        "builds": ct.builds,
        "mttm_engines": ct.report()["engines"],
    }
    return res


@section("small_tensorrt_form")
def small_tensorrt():
    return small_case("tensorrt")[3]


@section("small_fold_flash")
def small_fold():
    return small_case("flash", patchify="fold", cuda_graphs=False)[3]


@section("small_plain_mttm")
def small_plain():
    import torch_tensorrt

    model = make_prx(SMALL, dtype=torch.bfloat16, device="cuda")
    kw = example_inputs(model.config, 2, 64, 64, 64, dtype=torch.bfloat16, device="cuda", masked_tokens=40)
    with torch.no_grad():
        ref = model(**kw, return_dict=False)[0]
    m = torch_tensorrt.MutableTorchTensorRTModule(model, strict=False, use_explicit_typing=True)
    out = m(**kw, return_dict=False)[0]
    from prx_compile.backends import trt_shim

    return {
        "rel_err": rel_err(out, ref),
        "nan": bool(out.isnan().any()),
        "engines": len(trt_shim.engine_modules(m.gm)),
        "torch_segments": len(trt_shim.torch_segments(m.gm)),
    }


@section("full_flash_static")
def full_flash():
    if time.time() - T0 > 420:
        return {"skipped": "time budget"}
    model = make_prx({}, dtype=torch.bfloat16, device="cuda")
    kw = example_inputs(
        model.config, 2, 128, 128, 256, dtype=torch.bfloat16, device="cuda", masked_tokens=200
    )
    with torch.no_grad():
        ref = model(**kw, return_dict=False)[0]
        eager_ms = time_cuda(lambda: model(**kw, return_dict=False))["ms"]
    ct = compile_prx(model, attention="flash", static=True, opt_batch=2, text_len=[256, 256], resolution=1024)
    t0 = time.time()
    out = ct(**kw, return_dict=False)[0]
    res = {"build_s": time.time() - t0, "rel_err": rel_err(out, ref), "ms_eager": eager_ms, **ct.report()}
    res["ms_cuda_graphs"] = time_cuda(lambda: ct(**kw, return_dict=False))["ms"]
    ct._graphs = None
    res["ms_no_graphs"] = time_cuda(lambda: ct(**kw, return_dict=False))["ms"]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            ct(**kw, return_dict=False)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            rows.append((e.key[:120], getattr(e, "self_device_time_total", 0) / 3 / 1e3, e.count // 3))
    rows.sort(key=lambda r: -r[1])
    res["kernels_ms_per_step"] = rows[:40]
    res["kernels_total_ms"] = sum(r[1] for r in rows)
    return res


def kernel_profile(fn, steps=3):
    """Per-step GPU time by kernel (top 15) and by category, from the PyTorch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [
        (e.key, getattr(e, "self_device_time_total", 0) / steps / 1e3, e.count // steps)
        for e in prof.key_averages()
        if getattr(e, "self_device_time_total", 0)
    ]
    rows.sort(key=lambda r: -r[1])
    cats: dict = {}
    for name, ms, _ in rows:
        low = name.lower()
        cat = (
            "gemm"
            if "matmul" in low or "gemm" in low or "xmma" in low
            else "attention"
            if "flash" in low or "fmha" in low or "attention" in low or "cudnn" in low
            else "tensorrt_fused"
            if name.startswith("__myl")
            else "other"
        )
        cats[cat] = cats.get(cat, 0.0) + ms
    return {
        "by_category_ms": cats,
        "total_ms": sum(cats.values()),
        "top": [(n[:90], round(ms, 3), c) for n, ms, c in rows[:15]],
    }


def compare_depth4(variants: dict[str, dict]) -> dict:
    """Full-width PRX with 4 blocks, 1024^2 batch 2, static: each variant's CompileConfig overrides
    built in turn, with accuracy, step time with and without CUDA graphs, and a kernel profile."""
    model = make_prx({"depth": 4}, dtype=torch.bfloat16, device="cuda")
    kw = example_inputs(
        model.config, 2, 128, 128, 256, dtype=torch.bfloat16, device="cuda", masked_tokens=200
    )
    with torch.no_grad():
        ref = model(**kw, return_dict=False)[0]
        out = {"eager_ms": time_cuda(lambda: model(**kw, return_dict=False))["ms"]}
    for name, sw in variants.items():
        try:
            ct = compile_prx(model, static=True, opt_batch=2, text_len=[256, 256], resolution=1024, **sw)
            t0 = time.time()
            o = ct(**kw, return_dict=False)[0]
            rep = ct.report()
            r = {"build_s": time.time() - t0, "rel_err": rel_err(o, ref), "engines": rep["engines"]}
            r["torch_segments"] = rep["torch_segments"]
            r["ms_graphs"] = time_cuda(lambda ct=ct: ct(**kw, return_dict=False))["ms"]
            ct._graphs = None
            r["ms_no_graphs"] = time_cuda(lambda ct=ct: ct(**kw, return_dict=False))["ms"]
            r["profile"] = kernel_profile(lambda ct=ct: ct(**kw, return_dict=False))
            out[name] = r
            ct.backend.mttm = None  # free the engines before the next variant
            torch.cuda.empty_cache()
        except Exception as e:
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out


@section("variants_depth4")
def variants_depth4():
    """What each lowering switch buys on the 4-block model."""
    return compare_depth4(
        {
            "generic_flash": dict(joint_attention=False, select_as_slice=False, fused_attention=False),
            "joint": dict(joint_attention=True, select_as_slice=False, fused_attention=False),
            "joint+select_as_slice": dict(joint_attention=True, select_as_slice=True, fused_attention=False),
        }
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("prx_compile").setLevel(logging.INFO)
    sections = (
        env,
        flash_op,
        attention_variants,
        small_flash,
        small_tensorrt,
        small_fold,
        small_plain,
        variants_depth4,
        full_flash,
    )
    for fn in sections:
        if args.only and fn.__name__ not in args.only:
            continue
        fn()
        with open(f"{args.out}/probe.json", "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print(
        "\nSUMMARY",
        json.dumps(
            {k: {kk: vv for kk, vv in v.items() if "sample" not in kk} for k, v in RESULTS.items()},
            default=str,
        )[:6000],
    )
