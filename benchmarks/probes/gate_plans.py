"""The fused MLP gate's first call, plan by plan: where its seconds go, and whether a kernel cache
shared between shapes cuts them. Writes OUT.json (GPU, the ``cudnn`` extra):

    python benchmarks/probes/gate_plans.py OUT.json

``ops.cudnn_gemm.gelu_gate`` builds its cuDNN graph at a shape's first call, then builds and times
the heuristics' first ``CANDIDATES`` plans (``_fastest``). An engine set's measurement makes that
call before the export, so it adds to the set's first call: ``kernels_s`` took 2.8-3.2 s of a 1.17 B
set's 8.2-14.1 s (``peers_v21_prx_bf16_h200.json``) and 1.05-6.3 s at 7B
(``peers_v21_pixel_h200.json``, ``compile_time_v22_h200.json``).

For the 1.17 B and the 7B PRX's gates (x (M, K) by the gate's weight (N, K), M at 1024² b2, 1024² b1
and 832x1216 b2, in the order a process meets its engine sets), each mode in a new process:
  per_shape      what ``cudnn_gemm`` does: one graph per shape
  dynamic        the same graphs with ``is_dynamic_shape_enabled=True``, sharing one
                 ``cudnn.create_kernel_cache()`` (the frontend takes a kernel cache only so)
Per shape: the graph's seconds (validate to check_support), the plan count, and per plan index its
build seconds and ms per call (20 calls between two CUDA events, the least of 3); the plan
``_fastest`` would pick, plan 0's time over it, and the picked plan's relative error against the
fp32 composition ``gelu_tanh(x @ W.T) * up``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import kernel_ms  # noqa: E402  (benchmarks/common.py)

MODES = ("per_shape", "dynamic")
SIZES = {"prx_1.17b": (1792, 6272), "pixel_7b": (3072, 10752)}  # (K: hidden, N: the MLP's width)
ROWS = {"1024x1024_b2": 8192, "1024x1024_b1": 4096, "832x1216_b2": 7904}  # image tokens a step


def plan_ms(g, handle, buffers, uids, index: int) -> float:
    """ms per call of the built plan ``index`` (after one call): ``common.kernel_ms``, 20 calls, 3 runs."""
    ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(index)), dtype=torch.uint8, device="cuda")

    def run():
        g.execute_plan_at_index(buffers, ws, index=index, handle=handle, tensor_uids=uids)

    run()
    return kernel_ms(run, calls=20, runs=3)


def shape_row(cudnn, handle, options: dict, m: int, k: int, n: int) -> dict:
    """One shape's graph and plans, as ``cudnn_gemm`` would meet them."""
    from prx_compile.ops import cudnn_gemm

    g0 = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16, generator=g0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g0) / k**0.5
    up = torch.randn(1, m, n, device="cuda", dtype=torch.bfloat16, generator=g0)
    out = torch.empty(1, m, n, device="cuda", dtype=torch.bfloat16)
    wv = w.t().unsqueeze(0)
    row: dict = {"rows": m, "k": k, "n": n}
    t0 = time.perf_counter()
    try:
        g, uids = cudnn_gemm._graph(cudnn, handle, x, wv, up, **options)
    except Exception as e:  # noqa: BLE001 (recorded: a mode this cuDNN does not take)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return row
    row["graph_s"] = round(time.perf_counter() - t0, 3)
    row["plan_count"] = g.get_execution_plan_count()
    buffers, plans = [x, wv, up, out], {}
    for i in range(min(cudnn_gemm.CANDIDATES, row["plan_count"])):
        t = time.perf_counter()
        try:
            g.build_plan_at_index(i)
            built = time.perf_counter() - t
            plans[str(i)] = {"build_s": round(built, 3), "ms": round(plan_ms(g, handle, buffers, uids, i), 4)}
        except Exception as e:  # noqa: BLE001 (a plan that does not build or run: recorded, as _fastest skips it)
            plans[str(i)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    row["plans"] = plans
    row["total_s"] = round(time.perf_counter() - t0, 3)
    timed = {i: p["ms"] for i, p in plans.items() if "ms" in p}
    if timed:
        best = min(timed, key=timed.get)
        row["fastest_plan"] = int(best)
        if "0" in timed:
            row["plan0_over_fastest"] = round(timed["0"] / timed[best], 3)
        i = int(best)
        g.build_plan_at_index(i)
        ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
        g.execute_plan_at_index(buffers, ws, index=i, handle=handle, tensor_uids=uids)
        ref = F.gelu(x[0].float() @ w.float().T, approximate="tanh") * up[0].float()
        row["rel_err"] = float(f"{float((out[0].float() - ref).norm() / ref.norm()):.3g}")
    return row


def child(mode: str, size: str) -> dict:
    """One mode and model size, in this (new) process."""
    from prx_compile.ops import cudnn_attention, cudnn_gemm

    t0 = time.perf_counter()
    cudnn = cudnn_attention.frontend()
    if cudnn is None:
        return {"error": "the cuDNN frontend did not load"}
    handle = cudnn_gemm._handle(cudnn, torch.device("cuda"))
    result: dict = {"cudnn": cudnn.backend_version(), "import_s": round(time.perf_counter() - t0, 3)}
    options: dict = {}
    try:
        if mode == "dynamic":
            options.update(kernel_cache=cudnn.create_kernel_cache(), is_dynamic_shape_enabled=True)
    except Exception as e:  # noqa: BLE001 (recorded: a frontend without kernel caches)
        return {**result, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    k, n = SIZES[size]
    result["shapes"] = {label: shape_row(cudnn, handle, options, m, k, n) for label, m in ROWS.items()}
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    if not args.out:
        ap.error("OUT.json is required")
    what = " ".join(__doc__.split("\n\n")[1].split())
    result: dict = {"what": what, "device": torch.cuda.get_device_name(), "runs": {}}
    for size in SIZES:
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, size]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
                lines = done.stdout.strip().splitlines()
                rec = json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}
            except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
                rec = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            result["runs"][f"{size}/{mode}"] = rec
            Path(args.out).write_text(json.dumps(result, indent=1))
            for label, row in rec.get("shapes", {}).items():
                print(
                    f"{size:10s} {mode:13s} {label:13s} graph {row.get('graph_s')} s,"
                    f" total {row.get('total_s')} s,"
                    f" fastest plan {row.get('fastest_plan')}, plan 0 x{row.get('plan0_over_fastest')},"
                    f" error {row.get('rel_err')}" + (f"  ERROR {row['error']}" if "error" in row else ""),
                    flush=True,
                )
            if "error" in rec:
                print(f"{size} {mode}: ERROR {rec['error']}", flush=True)


if __name__ == "__main__":
    main()
