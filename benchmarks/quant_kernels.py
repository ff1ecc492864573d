"""The FP8 step's quantisation kernels alone: how near memory bandwidth they run, by launch width.

    python benchmarks/quant_kernels.py OUT.json

At the shapes the 7B PRX (1024² b2: 8704 rows; hidden 3072, MLP 12288) and FLUX.1-dev (1024² b1:
4608 rows; hidden 3072, single-block MLP input 15360) run them: ``row_quant_fp8`` (a row of bf16 ->
e4m3 and its scale) and ``gelu_mul_quant_fp8`` (GELU(gate) * up -> e4m3), each with the warps the
library launches and with the others, timed back to back (50 launches between two CUDA events, the
least of 5 such runs): ms per call and GB/s of the bytes each must move (read once, write once).
The shipped call's output is compared with the torch composition (``scale_err``: the scales' largest
relative difference; ``codes_differ``: the share of e4m3 codes that differ).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prx_compile.ops import kernels  # noqa: E402

SHAPES = {  # (rows, columns) each kernel meets in a step
    "pixel7b_row_3072": ("row", 8704, 3072),
    "pixel7b_gelu_12288": ("gelu", 8704, 12288),
    "flux_row_3072": ("row", 4608, 3072),
    "flux_row_15360": ("row", 4608, 15360),
    "flux_gelu_12288": ("gelu", 4608, 12288),
}


def back_to_back(fn, calls: int = 50, runs: int = 5) -> float:
    """The least over ``runs`` of the mean ms per call of ``calls`` launches queued back to back."""
    best = float("inf")
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    row_quant, gelu_mul_quant, triton = kernels._row_quant_kernel()
    out: dict = {"what": " ".join(__doc__.split("\n\n")[2].split()), "shapes": {}}
    torch.manual_seed(0)
    for name, (kind, m, k) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        u = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(m, k, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(m, 1, device="cuda", dtype=torch.float32)
        bk = triton.next_power_of_2(k)
        if kind == "row":
            ref_q, ref_s = kernels.row_quant_fp8_torch(x)
            moved = m * k * 2 + m * k + m * 4

            def launch(w, x=x, q=q, s=s, m=m, k=k, bk=bk):
                row_quant[(m,)](x, q, s, k, x.stride(0), BK=bk, num_warps=w)

            shipped = kernels.row_quant_fp8(x)
        else:
            ref_q, ref_s = kernels.gelu_mul_quant_fp8_torch(x, u)
            moved = 2 * m * k * 2 + m * k + m * 4

            def launch(w, x=x, u=u, q=q, s=s, m=m, k=k, bk=bk):
                gelu_mul_quant[(m,)](x, u, q, s, k, x.stride(0), u.stride(0), BK=bk, num_warps=w)

            shipped = kernels.gelu_mul_quant_fp8(x, u)
        row = {"rows": m, "cols": k, "mb_moved": round(moved / 1e6, 1), "warps": {}}
        row["scale_err"] = float(((shipped[1] - ref_s).abs() / ref_s).max())
        row["codes_differ"] = float((shipped[0].float() != ref_q.float()).float().mean())
        for w in (2, 4, 8, 16, 32):
            try:
                launch(w)
                ms = back_to_back(lambda w=w: launch(w))
            except Exception as e:  # noqa: BLE001 - a width the kernel cannot take (registers)
                row["warps"][w] = str(e)[:120]
                continue
            row["warps"][w] = {"ms": round(ms, 4), "gb_s": round(moved / ms / 1e6, 1)}
        out["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
