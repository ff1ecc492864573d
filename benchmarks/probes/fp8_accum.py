"""FP8 GEMMs with and without fast accumulation, at the step's shapes: what each costs and how far it
lands from exact arithmetic. Writes OUT.json (GPU):

    python benchmarks/probes/fp8_accum.py OUT.json

``fp8_linear`` calls ``torch._scaled_mm(..., use_fast_accum=True)``, as torchao's float8 inference
does: on Hopper the FP8 tensor cores then keep their partial sums at reduced precision for the whole
K; without it cuBLASLt adds them into fp32 along the way. For each shape (row-wise e4m3 activations
and per-channel e4m3 weights, as ``fp8_linear`` makes them): ms per GEMM (50 calls between two CUDA
events, the least of 5 runs) and the relative L2 error against the same e4m3 values multiplied in
fp32 (the accumulation's own error) and against the bf16 GEMM of the unquantised inputs (the whole
FP8 error). Shapes: FLUX.1-dev 1024² (a double block's 4096 image rows, K 3072 and 12288; a single
block's 4608 rows, K 15360) and the 7B PRX 1024² b2 (8192 rows; K 3072, 10752).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import kernel_ms  # noqa: E402  (benchmarks/common.py)

from prx_compile.ops.kernels import row_quant_fp8_torch  # noqa: E402
from prx_compile.tools.bench import rel_err  # noqa: E402

CASES = {  # rows, K, N
    "flux_qkv_3072": (4096, 3072, 3072),
    "flux_ff_out_12288": (4096, 12288, 3072),
    "flux_single_out_15360": (4608, 15360, 3072),
    "pixel7b_qkv_3072": (8192, 3072, 9216),
    "pixel7b_down_10752": (8192, 10752, 3072),
}


def measure(m: int, k: int, n: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    xq, xs = row_quant_fp8_torch(x)
    wq, ws = row_quant_fp8_torch(w)
    exact = (xq.float() * xs) @ (wq.float() * ws).T  # the e4m3 values, multiplied in fp32
    bf16 = x @ w.T
    row: dict = {"rows": m, "k": k, "n": n}
    for fast in (True, False):

        def gemm(fast=fast):
            return torch._scaled_mm(
                xq, wq.t(), scale_a=xs, scale_b=ws.view(1, n), out_dtype=torch.bfloat16, use_fast_accum=fast
            )

        out = gemm()
        row["fast" if fast else "split"] = {
            "ms": kernel_ms(gemm),
            "err_vs_exact_fp8_values": rel_err(out, exact),
            "err_vs_bf16_gemm": rel_err(out, bf16),
        }
    row["split_over_fast"] = round(row["split"]["ms"] / row["fast"]["ms"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    out: dict = {"what": " ".join(__doc__.split("\n\n")[0].split()), "torch": torch.__version__}
    out["gpu"] = torch.cuda.get_device_name()
    out["cases"] = {}
    for name, (m, k, n) in CASES.items():
        out["cases"][name] = measure(m, k, n)
        print(name, json.dumps(out["cases"][name]), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
