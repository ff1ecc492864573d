"""The FP8 levers one at a time, on one PRX block's GEMMs at full width (hidden 1792, MLP 7168, batch 2 x
4096 image tokens = 8192 rows), bf16, on the GPU. Median of CUDA-event timings.

    python benchmarks/probes/fp8_levers.py OUT.json

Rows: each GEMM in bf16 and as torch._scaled_mm with and without ``use_fast_accum``; the two Triton
quantisers; the MLP as three ``fp8_linear`` ops with GELU * up in PyTorch between them, and as the one
``fp8_gated_mlp`` op (what the ``fp8_mlp`` rule emits).
"""

import json
import sys

import torch
import torch.nn.functional as F

from prx_compile.ops.kernels import gelu_mul_quant_fp8, row_quant_fp8
from prx_compile.quant import fp8
from prx_compile.tools.bench import environment, rel_err, time_cuda

M, HIDDEN, MLP = 8192, 1792, 7168


def timed(fn) -> float:
    """Median ms of 50 synchronised calls after 5 warm-ups."""
    return time_cuda(fn, warmup=5, iters=50)["ms"]


def main(out: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s, std=1.0: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16) * std  # noqa: E731
    x, h = rand(M, HIDDEN), rand(M, MLP)
    rows = []
    for name, n, k, inp in (
        ("qkv", 3 * HIDDEN, HIDDEN, x),
        ("gate", MLP, HIDDEN, x),
        ("down", HIDDEN, MLP, h),
    ):
        w = rand(n, k, std=0.02)
        w8, ws = fp8.quantize_weight(w)
        q, s = row_quant_fp8(inp)
        sb = ws.view(1, n)
        for label, fn in (
            ("bf16", lambda w=w, inp=inp: F.linear(inp, w)),
            (
                "fp8",
                lambda q=q, s=s, w8=w8, sb=sb: torch._scaled_mm(q, w8.t(), s, sb, out_dtype=torch.bfloat16),
            ),
            (
                "fp8_fast_accum",
                lambda q=q, s=s, w8=w8, sb=sb: torch._scaled_mm(
                    q, w8.t(), s, sb, out_dtype=torch.bfloat16, use_fast_accum=True
                ),
            ),
        ):
            rows.append({"what": f"gemm_{name}", "variant": label, "shape": [M, k, n], "ms": timed(fn)})
    rows.append(
        {
            "what": "row_quant",
            "variant": "triton",
            "shape": [M, HIDDEN],
            "ms": timed(lambda: row_quant_fp8(x)),
        }
    )
    gate, up = rand(M, MLP), rand(M, MLP)
    rows.append(
        {
            "what": "gelu_mul_quant",
            "variant": "triton (one pass)",
            "shape": [M, MLP],
            "ms": timed(lambda: gelu_mul_quant_fp8(gate, up)),
        }
    )
    rows.append(
        {
            "what": "gelu_mul_quant",
            "variant": "torch gelu * up, then triton row_quant",
            "shape": [M, MLP],
            "ms": timed(lambda: row_quant_fp8(F.gelu(gate, approximate="tanh") * up)),
        }
    )
    (g8, gs), (u8, us), (d8, ds) = (
        fp8.quantize_weight(rand(n, k, std=0.02)) for n, k in ((MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP))
    )
    xb = x.view(2, M // 2, HIDDEN)
    lin = torch.ops.prx_compile.fp8_linear

    def three():
        return lin(F.gelu(lin(xb, g8, gs, None), approximate="tanh") * lin(xb, u8, us, None), d8, ds, None)

    def fused():
        return torch.ops.prx_compile.fp8_gated_mlp(xb, g8, gs, u8, us, d8, ds)

    rows.append({"what": "mlp", "variant": "3 fp8_linear + torch gelu*up", "ms": timed(three)})
    rows.append(
        {
            "what": "mlp",
            "variant": "fp8_gated_mlp",
            "ms": timed(fused),
            "rel_err_vs_3": rel_err(fused(), three()),
        }
    )
    for r in rows:
        print(r, flush=True)
    with open(out, "w") as f:
        json.dump({"env": environment(), "records": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
