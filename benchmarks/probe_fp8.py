"""Can TensorRT-RTX run an FP8 GEMM on this GPU? One PRX-sized GEMM (the QKV projection at 1024²
batch 2: 8192 x 1792 @ 1792 x 5376) built three ways with the TensorRT API: fp16, and FP8 through
explicit Q/DQ layers; plus PyTorch's own FP8 GEMM (``torch._scaled_mm``) as the hardware reference.
Every step records its result or its error; builder messages are kept.

    python benchmarks/probe_fp8.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import numpy as np
import torch

M, K, N = 8192, 1792, 5376


def timed(fn, iters=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def trt_gemm(trt, fp8: bool) -> dict:
    class Log(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.lines = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.WARNING:
                self.lines.append(f"{severity}: {msg}"[:400])

    log = Log()
    builder = trt.Builder(log)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    net = builder.create_network(flags)
    x = net.add_input("x", trt.DataType.HALF, (M, K))
    w = net.add_constant((K, N), trt.Weights((np.random.randn(K, N) * 0.02).astype(np.float16))).get_output(0)
    if fp8:
        scale = net.add_constant((), trt.Weights(np.array(1.0, dtype=np.float16))).get_output(0)

        def qdq(t):
            q = net.add_quantize(t, scale, trt.DataType.FP8).get_output(0)
            return net.add_dequantize(q, scale, trt.DataType.HALF).get_output(0)

        x_in, w = qdq(x), qdq(w)
    else:
        x_in = x
    mm = net.add_matrix_multiply(x_in, trt.MatrixOperation.NONE, w, trt.MatrixOperation.NONE)
    mm.get_output(0).name = "y"
    net.mark_output(mm.get_output(0))
    cfg = builder.create_builder_config()
    cfg.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    ser = builder.build_serialized_network(net, cfg)
    res: dict = {"built": ser is not None, "builder_messages": log.lines[-8:]}
    if ser is None:
        return res
    engine = trt.Runtime(log).deserialize_cuda_engine(ser)
    info = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    res["engine_layers"] = info[:3000]
    ctx = engine.create_execution_context()
    xt = torch.randn(M, K, device="cuda", dtype=torch.float16)
    yt = torch.empty(M, N, device="cuda", dtype=torch.float16)
    ctx.set_tensor_address("x", xt.data_ptr())
    ctx.set_tensor_address("y", yt.data_ptr())
    stream = torch.cuda.current_stream().cuda_stream
    res["ms"] = timed(lambda: ctx.execute_async_v3(stream))
    res["tflops"] = 2 * M * K * N / res["ms"] / 1e9
    return res


def torch_fp8() -> dict:
    a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = timed(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    x, y = (
        torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
        torch.randn(K, N, device="cuda", dtype=torch.bfloat16),
    )
    ms16 = timed(lambda: x @ y)
    return {"fp8_scaled_mm_ms": ms, "bf16_matmul_ms": ms16, "fp8_tflops": 2 * M * K * N / ms / 1e9}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    out = Path(ap.parse_args().out)
    res: dict = {"gpu": torch.cuda.get_device_name(), "shape": [M, K, N]}
    try:
        try:
            import tensorrt_rtx as trt
        except ImportError:
            import tensorrt as trt

        res["tensorrt"] = trt.__version__
        res["has_fp8_dtype"] = hasattr(trt.DataType, "FP8")
    except Exception as e:
        res["tensorrt"] = f"import failed: {e}"
    for name, fn in (
        ("trt_fp16", lambda: trt_gemm(trt, False)),
        ("trt_fp8_qdq", lambda: trt_gemm(trt, True)),
        ("torch", torch_fp8),
    ):
        try:
            res[name] = fn()
        except Exception as e:
            res[name] = {
                "error": f"{type(e).__name__}: {e}"[:800],
                "traceback": traceback.format_exc()[-1200:],
            }
        (out / "probe_fp8_h200.json").write_text(json.dumps(res, indent=1, default=str))
    print(
        json.dumps(
            {
                k: (v if not isinstance(v, dict) else {a: b for a, b in v.items() if a != "engine_layers"})
                for k, v in res.items()
            },
            indent=1,
            default=str,
        )[:6000]
    )
