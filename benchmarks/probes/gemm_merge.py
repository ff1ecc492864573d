"""Whether one GEMM over linears that read one input beats one GEMM per linear, at FLUX.1-dev's and
the 7B PRX's shapes, in bf16 (cuBLAS through ``F.linear``) and FP8 (``torch._scaled_mm``, row-wise
scales, fast accumulation, as ``fp8_linear`` runs it) — the question behind co-locating such
weights in one buffer (not built). Writes OUT.json (GPU):

    python benchmarks/probes/gemm_merge.py OUT.json

Each case times the separate GEMMs back to back against one GEMM whose weight is their rows
stacked (``(sum N, K)``), 50 calls between two CUDA events, the least of 5 runs, and reports the
merged GEMM's output columns read as the separate outputs (``strided``, what a consumer that takes
a row stride would read) and copied out (``contiguous``). FLUX.1: a double block's q/k/v (4096
image rows, 3 x 3072), its text q/k/v (512 rows), a single block's q/k/v and MLP projection (4608
rows, 3 x 3072 + 12288). The 7B PRX's projections are already one GEMM each (img_qkv_proj);
its MLP gate and up (8192 rows, 2 x 10752) are in ``fp8_gated_mlp`` / ``gelu_gate``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import kernel_ms  # noqa: E402  (benchmarks/common.py)

CASES = {  # rows, K, the linears' N
    "flux_double_img_qkv": (4096, 3072, (3072, 3072, 3072)),
    "flux_double_txt_qkv": (512, 3072, (3072, 3072, 3072)),
    "flux_single_qkv_mlp": (4608, 3072, (3072, 3072, 3072, 12288)),
    "pixel7b_gate_up": (8192, 3072, (10752, 10752)),
}


def row_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def measure(m: int, k: int, ns: tuple[int, ...]) -> dict:
    """One case's timings, bf16 and FP8."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in ns]
    merged = torch.cat(ws)
    row: dict = {"rows": m, "k": k, "n": list(ns)}

    def split_out(y):
        return [t.contiguous() for t in y.split(list(ns), -1)]

    row["bf16"] = {
        "separate_ms": kernel_ms(lambda: [F.linear(x, w) for w in ws]),
        "merged_strided_ms": kernel_ms(lambda: F.linear(x, merged)),
        "merged_contiguous_ms": kernel_ms(lambda: split_out(F.linear(x, merged))),
    }
    q, s = row_quant(x)
    w8 = [row_quant(w) for w in ws]
    m8, ms = torch.cat([w for w, _ in w8]), torch.cat([sc for _, sc in w8])

    def mm(w, sc):
        return torch._scaled_mm(
            q, w.t(), scale_a=s, scale_b=sc.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=True
        )

    row["fp8"] = {
        "separate_ms": kernel_ms(lambda: [mm(w, sc) for w, sc in w8]),
        "merged_strided_ms": kernel_ms(lambda: mm(m8, ms)),
        "merged_contiguous_ms": kernel_ms(lambda: split_out(mm(m8, ms))),
    }
    tflop = 2 * m * k * sum(ns) / 1e12
    for kind in ("bf16", "fp8"):
        r = row[kind]
        r["tflops_separate"] = round(tflop / r["separate_ms"] * 1e3, 1)
        r["tflops_merged"] = round(tflop / r["merged_strided_ms"] * 1e3, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    torch.manual_seed(0)
    out: dict = {"what": " ".join(__doc__.split("\n\n")[0].split()), "gpu": torch.cuda.get_device_name()}
    for name, (m, k, ns) in CASES.items():
        out[name] = measure(m, k, ns)
        print(name, json.dumps(out[name]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
