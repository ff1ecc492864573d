"""Levers left in the bf16 step (issue 24), measured in plain PyTorch + cuDNN's frontend (no TensorRT).

    CUDNN_FE_PATH=DIR python benchmarks/probes/step_levers.py OUT [--parts attention gemm fused sweep flash4]

DIR holds nvidia-cudnn-frontend (``pip install --no-deps --target DIR``); ``flash4`` also needs
flash-attn-4 with nvidia-cutlass-dsl (libs-base, libs-core, libs-cu13), quack-kernels,
apache-tvm-ffi and torch-c-dlpack-ext importable (``DIR`` and ``DIR/nvidia_cutlass_dsl/dsl_packages``
on PYTHONPATH). Parts (each caught on its own; OUT/step_levers.json is rewritten after each):
  attention  PRX's joint attention as the one cuDNN call of 0.14 (``ops.cudnn_attention``: image
             queries over [image keys; kept text keys; padding] under a padding mask, B/L/H/D views
             of (B, L, H, D) tensors), at 1024² b2, 1024² b1 and 832x1216 b2: every execution plan
             cuDNN's heuristics (modes A, B, fallback) offer, built and timed one by one (median of
             CUDA-event timings, back-to-back), its name, engine and knobs, and its largest
             difference to the heuristic's first plan; the engines and their knobs the graph has;
             the same with (B, H, L, D)-contiguous tensors; PyTorch's SDPA backends (flash,
             cuDNN, efficient) on the unmasked image-only attention of the same size for scale.
  gemm       the block's GEMMs at 1024² b2 (8192 image tokens, 512 text tokens) through
             ``F.linear`` as ``prx_compile.linear`` runs them: each GEMM's kernels and memsets
             (torch.profiler), and ms for the 16 blocks' GEMMs replayed from one CUDA graph, with
             torch's default BLAS, ``preferred_blas_library("cublaslt")`` and, in child processes,
             ``CUBLAS_WORKSPACE_CONFIG=:0:0`` / ``TORCH_BLAS_PREFER_CUBLASLT=1``.
  fused      the MLP's gate GEMM with gelu_tanh(gate) * up as a cuDNN matmul epilogue (the
             heuristics' plans, then every KERNEL_CFG of their engines), against cuBLAS's gate GEMM
             + the pointwise kernels.
  sweep      every KERNEL_CFG (0-36) of the four SDPA engines (8-11) on the attention graph, built
             with ``create_execution_plan`` and timed back-to-back (a 200 s budget).
  flash4_tiles  FlashAttention-4's forward at 15 tile shapes / flags (``step_levers_tiles_h200.json``).
  flash4     FlashAttention-4's Hopper forward (``flash_attn.cute.flash_attn_varlen_func`` with
             ``seqused_k``) on the same padded layout, against the cuDNN plan: import and first-call
             (JIT) seconds, error against exact fp32 attention, ms and TFLOP/s, CUDA-graph replay.
Results: ``step_levers_h200.json`` (attention gemm fused), ``step_levers_sweep_h200.json`` (sweep
fused, compacted), ``step_levers_flash4_h200.json`` (flash4), in ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

H, D, T = 28, 64, 256
HIDDEN, MLP = 1792, 6272
SHAPES = {"1024² b2": (2, 4096, (1, 40)), "1024² b1": (1, 4096, (40,)), "832x1216 b2": (2, 52 * 76, (1, 40))}
SCALE = D**-0.5


def events_ms(fn, iters=30, warmup=5) -> dict:
    """Median ms of one synchronised call, and the back-to-back average."""
    for _ in range(warmup):
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
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return {"ms": statistics.median(times), "loop_ms": start.elapsed_time(end) / iters}


def attention_inputs(b, lq, kept, layout):
    """q (B, Lq, H, D), k/v (B, Lq + T, H, D) as the norm/RoPE kernel writes them ([image; kept
    text; garbage]), seq (2, 4) int32; ``layout`` "bshd" (ours) or "bhsd" (contiguous per head)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)

    s = lq + T
    q, k, v = r(b, lq, H, D), r(b, s, H, D), r(b, s, H, D)
    seq = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    seq[0, :b] = lq
    for i, n in enumerate(kept):
        seq[1, i] = lq + n
        k[i, lq + n :] = 1e4  # padding: never read
        v[i, lq + n :] = 1e4
    if layout == "bhsd":
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    return q, k, v, seq


def build_sdpa_graph(cudnn, handle, q, k, v, heuristics):
    """The graph ``torch.ops.cudnn.sdpa_fwd`` builds for our call, with plans from ``heuristics``."""
    b, lq = q.shape[:2]
    s = k.shape[1]
    bf16 = cudnn.data_type.BFLOAT16
    qv, kv, vv = (x.transpose(1, 2) for x in (q, k, v))
    g = cudnn.pygraph(
        handle=handle,
        io_data_type=bf16,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    qt = g.tensor(name="q", dim=[b, H, lq, D], stride=list(qv.stride()), data_type=bf16, uid=1)
    kt = g.tensor(name="k", dim=[b, H, s, D], stride=list(kv.stride()), data_type=bf16, uid=2)
    vt = g.tensor(name="v", dim=[b, H, s, D], stride=list(vv.stride()), data_type=bf16, uid=3)
    i32 = cudnn.data_type.INT32
    sq = g.tensor(name="seq_len_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32, uid=5)
    skv = g.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32, uid=6)
    o, _ = g.sdpa(
        name="sdpa_fwd",
        q=qt,
        k=kt,
        v=vt,
        generate_stats=False,
        attn_scale=SCALE,
        use_padding_mask=True,
        seq_len_q=sq,
        seq_len_kv=skv,
    )
    ostride = list(torch.empty(b, lq, H, D, device="meta").transpose(1, 2).stride())
    if q.transpose(1, 2).is_contiguous():
        ostride = list(torch.empty(b, H, lq, D, device="meta").stride())
    o.set_uid(100).set_output(True).set_dim([b, H, lq, D]).set_stride(ostride).set_data_type(bf16)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans(heuristics)
    g.check_support()
    return g, ostride


def attention_part(cudnn) -> dict:
    out: dict = {}
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    modes = [("A", "B", "FALLBACK"), ("A", "FALLBACK")]
    for label, (b, lq, kept) in SHAPES.items():
        for layout in ("bshd", "bhsd"):
            rec: dict = {}
            out[f"{label} {layout}"] = rec
            try:
                q, k, v, seq = attention_inputs(b, lq, kept, layout)
                g = None
                for names in modes:
                    try:
                        g, ostride = build_sdpa_graph(
                            cudnn, handle, q, k, v, [getattr(cudnn.heur_mode, n) for n in names]
                        )
                        rec["heuristics"] = names
                        break
                    except Exception as e:
                        rec.setdefault("heuristic_errors", []).append(
                            f"{names}: {type(e).__name__}: {e}"[:300]
                        )
                if g is None:
                    continue
                o = torch.empty_strided((b, H, lq, D), ostride, dtype=torch.bfloat16, device="cuda")
                lens = (seq[0, :b].reshape(b, 1, 1, 1), seq[1, :b].reshape(b, 1, 1, 1))
                bufs = [q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o, *lens]
                uids = (1, 2, 3, 100, 5, 6)
                n = g.get_execution_plan_count()
                rec["plan_count"] = n
                n = min(n, 24)
                built = []
                for i in range(n):
                    try:
                        g.build_plan_at_index(i)
                        built.append(i)
                    except Exception as e:
                        rec.setdefault("build_errors", {})[i] = f"{type(e).__name__}: {e}"[:200]
                ws = torch.empty(
                    max([1] + [g.get_workspace_size_plan_at_index(i) for i in built]),
                    dtype=torch.uint8,
                    device="cuda",
                )
                flops = 4 * H * D * lq * sum(lq + n for n in kept)
                plans, first = [], None
                for i in built:
                    p: dict = {"index": i}
                    try:
                        p["name"] = g.get_plan_name_at_index(i)
                        try:
                            eng, knobs = g.get_engine_and_knobs_at_index(i)
                            p["engine"], p["knobs"] = eng, {str(kk): vv for kk, vv in knobs.items()}
                        except Exception as e:
                            p["engine"] = f"{type(e).__name__}: {e}"[:200]

                        def run(i=i, g=g, bufs=bufs, ws=ws, uids=uids):
                            g.execute_plan_at_index(bufs, ws, index=i, handle=handle, tensor_uids=uids)

                        o.fill_(float("nan"))
                        run()
                        torch.cuda.synchronize()
                        res = o.clone()
                        if first is None:
                            first = res
                        p["max_diff_to_plan0"] = float((res.float() - first.float()).abs().max())
                        p["nan"] = bool(res.isnan().any())
                        p.update(events_ms(run))
                        p["tflops"] = flops / p["loop_ms"] / 1e9
                    except Exception as e:
                        p["error"] = f"{type(e).__name__}: {e}"[:300]
                    plans.append(p)
                rec["plans"] = plans
                try:
                    rec["engine_count"] = g.get_engine_count()
                    rec["engine_knobs"] = {}
                    for e in range(min(rec["engine_count"], 64)):
                        try:
                            rec["engine_knobs"][e] = repr(g.get_knobs_for_engine(e))[:1500]
                        except Exception as ex:
                            rec["engine_knobs"][e] = f"{type(ex).__name__}: {ex}"[:200]
                except Exception as e:
                    rec["engine_count"] = f"{type(e).__name__}: {e}"[:300]
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
                rec["traceback"] = traceback.format_exc()[-1500:]
            print(label, layout, json.dumps(rec.get("plans", rec))[:1500], flush=True)
        # PyTorch's SDPA backends on the unmasked image-only problem of this size, for scale
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q, k, v, _ = attention_inputs(b, lq, kept, "bhsd")
            qh, kh, vh = (x.transpose(1, 2)[:, :, : lq + 40] for x in (q, k, v))
            qh = q.transpose(1, 2)
            sd = {}
            for be in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                try:
                    with sdpa_kernel(getattr(SDPBackend, be)):
                        sd[be] = events_ms(
                            lambda qh=qh, kh=kh, vh=vh: F.scaled_dot_product_attention(qh, kh, vh)
                        )
                        sd[be]["tflops"] = 4 * H * D * lq * (lq + 40) * b / sd[be]["loop_ms"] / 1e9
                except Exception as e:
                    sd[be] = f"{type(e).__name__}: {e}"[:200]
            out[f"{label} torch sdpa, no mask"] = sd
        except Exception as e:
            out[f"{label} torch sdpa, no mask"] = f"{type(e).__name__}: {e}"[:300]
    return out


GEMMS = {  # name: (tokens, N, K) at 1024² b2
    "img_qkv": (8192, 3 * HIDDEN, HIDDEN),
    "txt_kv": (512, 2 * HIDDEN, HIDDEN),
    "out": (8192, HIDDEN, HIDDEN),
    "gate": (8192, MLP, HIDDEN),
    "up": (8192, MLP, HIDDEN),
    "down": (8192, HIDDEN, MLP),
}


def gemm_part(child: bool = False) -> dict:
    out: dict = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = {
        n: torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) for n, (m, _, k) in GEMMS.items()
    }
    ws = {
        n: (torch.randn(nn, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
        for n, (_, nn, k) in GEMMS.items()
    }
    libs = ["default"] if child else ["default", "cublaslt", "cublas"]
    for lib in libs:
        rec: dict = {}
        out[lib] = rec
        try:
            if lib != "default":
                torch.backends.cuda.preferred_blas_library(lib)
            rec["preferred"] = str(torch.backends.cuda.preferred_blas_library())
            per = {}
            for n in GEMMS:
                t = events_ms(lambda n=n: F.linear(xs[n], ws[n]))
                m, nn, k = GEMMS[n]
                t["tflops"] = 2 * m * nn * k / t["loop_ms"] / 1e9
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        F.linear(xs[n], ws[n])
                    torch.cuda.synchronize()
                names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                t["kernels"] = sorted(set(names))[:6]
                t["memsets_per_call"] = sum("memset" in x.lower() for x in names) / 3
                per[n] = t
            rec["gemms"] = per

            def step():
                for _ in range(16):
                    for n in GEMMS:
                        F.linear(xs[n], ws[n])

            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            rec["16_blocks_graph"] = events_ms(graph.replay, iters=20)
            rec["16_blocks_eager"] = events_ms(step, iters=20)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        print("gemm", lib, json.dumps(rec)[:2500], flush=True)
    torch.backends.cuda.preferred_blas_library("default")
    if not child:
        for env in ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, {"TORCH_BLAS_PREFER_CUBLASLT": "1"}):
            key = " ".join(f"{k}={v}" for k, v in env.items())
            try:
                r = subprocess.run(
                    [sys.executable, __file__, "--gemm-child"],
                    env={**os.environ, **env},
                    capture_output=True,
                    text=True,
                    timeout=240,
                )
                out[key] = (
                    json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else r.stderr[-1500:]
                )
            except Exception as e:
                out[key] = f"{type(e).__name__}: {e}"[:300]
    return out


def fused_part(cudnn) -> dict:
    """gelu_tanh(x @ Wg.T) * up as a cuDNN matmul with a pointwise epilogue."""
    out: dict = {}
    m, n, k = 8192, MLP, HIDDEN
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    wg = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    up = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    ref = F.gelu(F.linear(x, wg).float(), approximate="tanh") * up.float()
    out["cublas_gemm_plus_pointwise"] = events_ms(lambda: F.gelu(F.linear(x, wg), approximate="tanh") * up)
    out["cublas_gemm_alone"] = events_ms(lambda: F.linear(x, wg))
    try:
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
        g = cudnn.pygraph(handle=handle, io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32)
        xv, wv, uv = x.unsqueeze(0), wg.t().unsqueeze(0), up.unsqueeze(0)
        X = g.tensor(name="x", dim=[1, m, k], stride=list(xv.stride()), data_type=bf16)
        W = g.tensor(name="w", dim=[1, k, n], stride=list(wv.stride()), data_type=bf16)
        U = g.tensor(name="u", dim=[1, m, n], stride=list(uv.stride()), data_type=bf16)
        gate = g.matmul(name="gate", A=X, B=W, compute_data_type=f32)
        act = g.gelu_approx_tanh(input=gate, compute_data_type=f32)
        h = g.mul(a=act, b=U, compute_data_type=f32)
        h.set_output(True).set_data_type(bf16)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        hb = torch.empty(1, m, n, dtype=torch.bfloat16, device="cuda")
        bufs, uids = [xv, wv, uv, hb], tuple(t.get_uid() for t in (X, W, U, h))
        cnt = g.get_execution_plan_count()
        out["plan_count"] = cnt
        plans = []
        for i in range(min(cnt, 8)):
            p: dict = {"index": i}
            try:
                p["name"] = g.get_plan_name_at_index(i)
                g.build_plan_at_index(i)
                wsb = torch.empty(
                    max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda"
                )

                def run(i=i, wsb=wsb):
                    g.execute_plan_at_index(bufs, wsb, index=i, handle=handle, tensor_uids=uids)

                run()
                torch.cuda.synchronize()
                p["rel_err"] = float((hb[0].float() - ref).norm() / ref.norm())
                p.update(events_ms(run))
            except Exception as e:
                p["error"] = f"{type(e).__name__}: {e}"[:300]
            plans.append(p)
        out["cudnn_plans"] = plans
        # every KERNEL_CFG of the engines the heuristics named
        import time

        t_end = time.perf_counter() + 120
        kt = cudnn.knob_type.KERNEL_CFG
        engines = sorted({int(p["name"].split("_")[0][3:]) for p in plans if "name" in p})
        sweep = []
        for eng in engines:
            try:
                top = max(int(kn["max_value"]) for kn in json.loads(repr(g.get_knobs_for_engine(eng))))
            except Exception as e:
                sweep.append({"engine": eng, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            for cfg in range(min(top, 80) + 1):
                if time.perf_counter() > t_end:
                    break
                p = {"engine": eng, "cfg": cfg}
                try:
                    g.create_execution_plan(eng, {kt: cfg})
                    i = g.get_execution_plan_count() - 1
                    g.build_plan_at_index(i)
                    wsb = torch.empty(
                        max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda"
                    )

                    def run(i=i, wsb=wsb):
                        g.execute_plan_at_index(bufs, wsb, index=i, handle=handle, tensor_uids=uids)

                    run()
                    torch.cuda.synchronize()
                    p["rel_err"] = float((hb[0].float() - ref).norm() / ref.norm())
                    p.update(events_ms(run, iters=10, warmup=2))
                except Exception as e:
                    p["error"] = f"{type(e).__name__}: {e}"[:120]
                sweep.append(p)
        out["cudnn_sweep"] = sweep
        ok = sorted((p for p in sweep if "loop_ms" in p), key=lambda p: p["loop_ms"])
        print("fused sweep", [(p["engine"], p["cfg"], round(p["loop_ms"], 4)) for p in ok[:8]], flush=True)
    except Exception as e:
        out["cudnn_error"] = f"{type(e).__name__}: {e}"[:500]
        out["traceback"] = traceback.format_exc()[-1500:]
    print("fused", json.dumps(out)[:2500], flush=True)
    return out


def sweep_part(cudnn, budget_s: float = 200.0) -> dict:
    """Every KERNEL_CFG of the SDPA engines (8-11) on our attention graph, and every knob value of
    the fused gate GEMM's engines, built with ``create_execution_plan`` and timed back-to-back."""
    import time

    out: dict = {}
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    kt = cudnn.knob_type.KERNEL_CFG
    t_end = time.perf_counter() + budget_s
    for label, (b, lq, kept) in SHAPES.items():
        rec: dict = {"plans": []}
        out[label] = rec
        try:
            q, k, v, seq = attention_inputs(b, lq, kept, "bshd")
            g, ostride = build_sdpa_graph(
                cudnn, handle, q, k, v, [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
            )
            o = torch.empty_strided((b, H, lq, D), ostride, dtype=torch.bfloat16, device="cuda")
            lens = (seq[0, :b].reshape(b, 1, 1, 1), seq[1, :b].reshape(b, 1, 1, 1))
            bufs = [q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o, *lens]
            uids = (1, 2, 3, 100, 5, 6)
            g.build_plan_at_index(0)
            ws = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")
            g.execute_plan_at_index(bufs, ws, index=0, handle=handle, tensor_uids=uids)
            torch.cuda.synchronize()
            ref = o.clone()
            flops = 4 * H * D * lq * sum(lq + n for n in kept)
            for eng in (9, 8, 10, 11):
                for cfg in range(37):
                    if time.perf_counter() > t_end:
                        rec["cut"] = "time budget"
                        break
                    p: dict = {"engine": eng, "cfg": cfg}
                    try:
                        g.create_execution_plan(eng, {kt: cfg})
                        i = g.get_execution_plan_count() - 1
                        g.build_plan_at_index(i)
                        p["name"] = g.get_plan_name_at_index(i)
                        if g.get_workspace_size_plan_at_index(i) > ws.numel():
                            raise RuntimeError("workspace over 64 MiB")

                        def run(i=i, g=g, bufs=bufs, ws=ws, uids=uids):
                            g.execute_plan_at_index(bufs, ws, index=i, handle=handle, tensor_uids=uids)

                        o.fill_(float("nan"))
                        run()
                        torch.cuda.synchronize()
                        p["max_diff"] = float((o.float() - ref.float()).abs().max())
                        p.update(events_ms(run, iters=10, warmup=2))
                        p["tflops"] = flops / p["loop_ms"] / 1e9
                    except Exception as e:
                        p["error"] = f"{type(e).__name__}: {e}"[:120]
                    rec["plans"].append(p)
            ok = sorted((p for p in rec["plans"] if "loop_ms" in p), key=lambda p: p["loop_ms"])
            print(
                label,
                [(p["engine"], p["cfg"], round(p["loop_ms"], 4), p["max_diff"]) for p in ok[:8]],
                flush=True,
            )
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
            rec["traceback"] = traceback.format_exc()[-1500:]
    return out


def flash4_part(cudnn) -> dict:
    """FlashAttention-4's Hopper forward (``flash-attn-4``, CuTe DSL) on our padded layout:
    ``flash_attn_varlen_func(q, k, v, seqused_k=image + kept)`` against the cuDNN plan we ship;
    its first call (the JIT compile) timed apart; CUDA-graph capture and replay."""
    import time

    out: dict = {}
    t0 = time.perf_counter()
    from flash_attn.cute import flash_attn_varlen_func

    out["import_s"] = time.perf_counter() - t0
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    for label, (b, lq, kept) in SHAPES.items():
        rec: dict = {}
        out[label] = rec
        try:
            q, k, v, seq = attention_inputs(b, lq, kept, "bshd")
            used = seq[1, :b].contiguous()
            g, ostride = build_sdpa_graph(
                cudnn, handle, q, k, v, [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
            )
            g.build_plan_at_index(0)
            o = torch.empty_strided((b, H, lq, D), ostride, dtype=torch.bfloat16, device="cuda")
            lens = (seq[0, :b].reshape(b, 1, 1, 1), seq[1, :b].reshape(b, 1, 1, 1))
            bufs = [q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o, *lens]
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(0)), dtype=torch.uint8, device="cuda")

            def cudnn_run(g=g, bufs=bufs, ws=ws):
                g.execute_plan_at_index(bufs, ws, index=0, handle=handle, tensor_uids=(1, 2, 3, 100, 5, 6))

            cudnn_run()
            ref = o.transpose(1, 2).float()

            def fa4(q=q, k=k, v=v, used=used):
                return flash_attn_varlen_func(q, k, v, seqused_k=used, softmax_scale=SCALE)

            t0 = time.perf_counter()
            res = fa4()
            res = res[0] if isinstance(res, tuple) else res
            torch.cuda.synchronize()
            rec["first_call_s"] = time.perf_counter() - t0
            rec["out_shape"] = list(res.shape)
            rec["max_diff_to_cudnn"] = float((res.float() - ref).abs().max())
            exact = torch.empty_like(ref)
            for i, n in enumerate(kept):
                kk, vv = k[i, : lq + n].float(), v[i, : lq + n].float()
                att = torch.einsum("qhd,khd->hqk", q[i].float(), kk) * SCALE
                exact[i] = torch.einsum("hqk,khd->qhd", att.softmax(-1), vv)
            rec["rel_err_fa4"] = float((res.float() - exact).norm() / exact.norm())
            rec["rel_err_cudnn"] = float((ref - exact).norm() / exact.norm())
            flops = 4 * H * D * lq * sum(lq + n for n in kept)
            rec["cudnn"] = events_ms(cudnn_run)
            rec["fa4"] = events_ms(fa4)
            for key in ("cudnn", "fa4"):
                rec[key]["tflops"] = flops / rec[key]["loop_ms"] / 1e9
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                gres = fa4()
            gres = gres[0] if isinstance(gres, tuple) else gres
            graph.replay()
            torch.cuda.synchronize()
            rec["graph_bitwise_equal"] = bool(torch.equal(gres, res))
            rec["fa4_graph"] = events_ms(graph.replay)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:800]
            rec["traceback"] = traceback.format_exc()[-2500:]
        print("flash4", label, json.dumps(rec)[:1200], flush=True)
    return out


FLASH4_TILES = [
    ((192, 128), True, True),  # the package's choice for head dim <= 64 on SM90
    ((192, 192), True, True),
    ((192, 160), True, True),
    ((192, 176), True, True),
    ((192, 144), True, True),
    ((192, 112), True, True),
    ((192, 96), True, True),
    ((128, 128), True, True),
    ((128, 160), True, True),
    ((128, 192), True, True),
    ((128, 256), True, True),
    ((192, 128), False, True),
    ((192, 192), False, True),
    ((192, 128), True, False),
    ((128, 128), False, True),
]


def flash4_tiles_part() -> dict:
    """FlashAttention-4's Hopper forward at other tile shapes (``_flash_attn_fwd``'s ``tile_mn``,
    ``mma_pv_is_rs``, ``intra_wg_overlap``) on our padded layout at the three shapes: compile
    seconds, ms (back-to-back average), TFLOP/s, largest difference to the package's default
    choice; and ``python -X importtime`` of ``flash_attn.cute`` (its 25 slowest imports)."""
    import time

    from flash_attn.cute.interface import _flash_attn_fwd

    out: dict = {"configs": {}}
    inputs = {label: attention_inputs(b, lq, kept, "bshd") for label, (b, lq, kept) in SHAPES.items()}
    refs = {}
    for tile, rs, ol in FLASH4_TILES:
        name = f"{tile[0]}x{tile[1]} rs={int(rs)} ol={int(ol)}"
        rec: dict = {}
        out["configs"][name] = rec
        for label, (q, k, v, seq) in inputs.items():
            b, lq = q.shape[:2]
            used = seq[1, :b].contiguous()

            def run(q=q, k=k, v=v, used=used, tile=tile, rs=rs, ol=ol):
                return _flash_attn_fwd(
                    q,
                    k,
                    v,
                    seqused_k=used,
                    softmax_scale=SCALE,
                    tile_mn=tile,
                    mma_pv_is_rs=rs,
                    intra_wg_overlap=ol,
                )[0]

            try:
                t0 = time.perf_counter()
                res = run()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                refs.setdefault(label, res.clone())
                kept = SHAPES[label][2]
                flops = 4 * H * D * lq * sum(lq + n for n in kept)
                timing = events_ms(run)
                rec[label] = {
                    "first_call_s": first,
                    "ms": timing["loop_ms"],
                    "tflops": flops / timing["loop_ms"] / 1e9,
                    "max_diff_to_default": float((res.float() - refs[label].float()).abs().max()),
                }
            except Exception as e:
                rec[label] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print("flash4_tiles", name, json.dumps(rec), flush=True)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import flash_attn.cute"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0].split(":")[1]), parts[2].rstrip()))
    rows.sort(reverse=True)
    out["importtime_top"] = [
        {"cumulative_s": c / 1e6, "self_s": s / 1e6, "module": m} for c, s, m in rows[:25]
    ]
    out["importtime_self_total_s"] = sum(r[1] for r in rows) / 1e6
    return out


def main() -> None:
    if "--gemm-child" in sys.argv:
        print(json.dumps(gemm_part(child=True)))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--parts", nargs="+", default=["attention", "gemm", "fused"])
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "step_levers.json"
    res: dict = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}}
    cudnn = None
    if {"attention", "fused", "sweep", "flash4"} & set(args.parts):
        from cudnn_fp8_attention import load_cudnn_frontend

        cudnn, info = load_cudnn_frontend()
        res["env"]["cudnn"] = info
    for part in args.parts:
        try:
            res[part] = {
                "attention": lambda: attention_part(cudnn),
                "gemm": gemm_part,
                "fused": lambda: fused_part(cudnn),
                "sweep": lambda: sweep_part(cudnn),
                "flash4": lambda: flash4_part(cudnn),
                "flash4_tiles": flash4_tiles_part,
            }[part]()
        except Exception as e:
            res[part] = {
                "error": f"{type(e).__name__}: {e}"[:500],
                "traceback": traceback.format_exc()[-2000:],
            }
        path.write_text(json.dumps(res, indent=1, default=str))
    print("written", path)


if __name__ == "__main__":
    main()
