"""The glue between FLUX.1-dev's bf16 GEMMs, alone: a tanh GELU after a biased GEMM, as a separate pass
against ``prx_compile::linear_gelu`` (cuBLASLt's bias + GELU epilogue), and a GEMM over a two-part
concatenation against ``prx_compile::linear_cat`` (two GEMMs over the weight's column blocks, the
second accumulating). Writes OUT.json (GPU):

    python benchmarks/probes/gemm_glue.py OUT.json

Shapes of one 1024² step: a double block's image feed-forward (4096 x 3072 -> 12288), a single
block's MLP projection (4608 x 3072 -> 12288) and output projection (4608 x [3072; 12288] -> 3072). Each
timed back to back (50 calls between two CUDA events, the least of 5 runs), with the relative error
against the composition.
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

import prx_compile.ops  # noqa: E402,F401  (registers the ops)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def gelu_case(m: int, k: int, n: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1

    def composed():
        return F.gelu(F.linear(x, w, b), approximate="tanh")

    def fused():
        return torch.ops.prx_compile.linear_gelu(x, w, b)

    return {
        "rows": m,
        "k": k,
        "n": n,
        "composed_ms": kernel_ms(composed),
        "gemm_alone_ms": kernel_ms(lambda: F.linear(x, w, b)),
        "linear_gelu_ms": kernel_ms(fused),
        "rel_err": rel(fused(), composed()),
    }


def cat_case(m: int, ka: int, kb: int, n: int) -> dict:
    a = torch.randn(m, ka, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(m, kb, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, ka + kb, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1

    def composed():
        return F.linear(torch.cat([a, h], -1), w, b)

    def fused():
        return torch.ops.prx_compile.linear_cat(a, h, w, b)

    x = torch.cat([a, h], -1)
    return {
        "rows": m,
        "k": [ka, kb],
        "n": n,
        "composed_ms": kernel_ms(composed),
        "gemm_alone_ms": kernel_ms(lambda: F.linear(x, w, b)),
        "linear_cat_ms": kernel_ms(fused),
        "rel_err": rel(fused(), composed()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    torch.manual_seed(0)
    out: dict = {"what": " ".join(__doc__.split("\n\n")[0].split()), "gpu": torch.cuda.get_device_name()}
    out["double_ff_gelu"] = gelu_case(4096, 3072, 12288)
    out["single_mlp_gelu"] = gelu_case(4608, 3072, 12288)
    out["single_proj_out_cat"] = cat_case(4608, 3072, 12288, 3072)
    for key in ("double_ff_gelu", "single_mlp_gelu", "single_proj_out_cat"):
        print(key, json.dumps(out[key]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
