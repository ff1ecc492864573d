"""The FP8 step's quantisation kernels alone: how near memory bandwidth they run, by launch width.

    python benchmarks/quant_kernels.py OUT.json

At the shapes the 7B PRX (1024² b2: 8192 image rows; hidden 3072, MLP 10752) and FLUX.1-dev
(1024² b1: 4096 image rows, 4608 in the single blocks; hidden 3072, single-block output input
15360) run them: ``row_quant_fp8`` (a row of bf16 ->
e4m3 and its scale), ``rows_quant_fp8`` with GELUs and a concatenation in the same pass (0.30: FLUX's
feed-forward input GELU(h) and its single blocks' [attention; GELU(mlp)], read from the producers'
outputs; 0.31: a block's modulated layer norm, ``norm``) and ``gelu_mul_quant_fp8`` (GELU(gate) * up
-> e4m3), each with the warps the library
launches and with the others, timed back to back (50 launches between two CUDA events, the
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

from common import kernel_ms  # noqa: E402

from prx_compile.ops import kernels  # noqa: E402

SHAPES = {  # (kind, rows, the parts' columns, GELU per part, batch) each kernel meets in a step
    "pixel7b_row_3072": ("row", 8192, (3072,), (False,), 1),  # the attention output's projection
    "pixel7b_norm_3072": ("norm", 8192, (3072,), (False,), 2),  # 0.31: q/k/v's and the MLP's input
    "pixel7b_gelu_10752": ("gelu_mul", 8192, (10752,), (True,), 1),
    "flux_row_3072": ("row", 4096, (3072,), (False,), 1),  # a double block's attention output
    "flux_norm_3072": ("norm", 4096, (3072,), (False,), 1),  # 0.31: a double block's image norms
    "flux_row_15360": ("row", 4608, (15360,), (False,), 1),  # 0.29's single-block proj_out input
    "flux_rows_3072_gelu_12288": ("row", 4608, (3072, 12288), (False, True), 1),  # 0.30's
    "flux_row_gelu_12288": ("row", 4096, (12288,), (True,), 1),  # 0.30's feed-forward ff.net.2 input
    "flux_gelu_12288": ("gelu_mul", 4608, (12288,), (True,), 1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    row_quant, gelu_mul_quant, triton = kernels._row_quant_kernel()
    out: dict = {"what": " ".join(__doc__.split("\n\n")[2].split()), "shapes": {}}
    torch.manual_seed(0)
    for name, (kind, m, widths, gelu, batch) in SHAPES.items():
        k = sum(widths)
        parts = [torch.randn(m, w, device="cuda", dtype=torch.bfloat16) for w in widths]
        u = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(m, k, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(m, 1, device="cuda", dtype=torch.float32)
        if kind in ("row", "norm"):
            norm = None
            if kind == "norm":  # 1 + scale and shift, one row per batch
                mult, shift = (torch.randn(batch, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                norm = (1 + mult, shift, 1e-6)
            ref_q, ref_s = kernels.rows_quant_fp8_torch(parts, list(gelu), norm)
            moved = m * k * 2 + m * k + m * 4
            a, b = parts[0], parts[-1]
            kb = widths[1] if len(widths) == 2 else 0
            bka, bkb = triton.next_power_of_2(widths[0]), triton.next_power_of_2(kb) if kb else 0
            mm, ms_, eps = norm if norm is not None else (a, a, 0.0)

            def launch(
                w,
                a=a,
                b=b,
                q=q,
                s=s,
                m=m,
                kb=kb,
                bka=bka,
                bkb=bkb,
                gelu=gelu,
                n=(mm, ms_, eps, batch, norm is not None),
            ):
                row_quant[(m,)](
                    a, b, q, s, n[0], n[1], a.shape[1], kb, a.stride(0), b.stride(0), m // n[3], n[2],
                    gelu[0], gelu[-1], n[4], BKA=bka, BKB=bkb, num_warps=w,
                )  # fmt: skip

            shipped = kernels.rows_quant_fp8(parts, list(gelu), norm)
        else:
            x, bk = parts[0], triton.next_power_of_2(k)
            ref_q, ref_s = kernels.gelu_mul_quant_fp8_torch(x, u)
            moved = 2 * m * k * 2 + m * k + m * 4

            def launch(w, x=x, u=u, q=q, s=s, m=m, k=k, bk=bk):
                gelu_mul_quant[(m,)](x, u, q, s, k, x.stride(0), u.stride(0), BK=bk, num_warps=w)

            shipped = kernels.gelu_mul_quant_fp8(x, u)
        row = {"rows": m, "cols": list(widths), "gelu": list(gelu), "mb_moved": round(moved / 1e6, 1)}
        row["warps"] = {}
        row["scale_err"] = float(((shipped[1] - ref_s).abs() / ref_s).max())
        row["codes_differ"] = float((shipped[0].float() != ref_q.float()).float().mean())
        for w in (2, 4, 8, 16, 32):
            try:
                launch(w)
                ms = kernel_ms(lambda w=w: launch(w))
            except Exception as e:  # noqa: BLE001 - a width the kernel cannot take (registers)
                row["warps"][w] = str(e)[:120]
                continue
            row["warps"][w] = {"ms": round(ms, 4), "gb_s": round(moved / ms / 1e6, 1)}
        out["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
