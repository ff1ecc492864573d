"""Why the modulated-norm quantiser's FP8 codes differ from torch's composition (0.32's GPU tests:
3.8 % of codes, ``gpu_tests_v31_h100.txt``). Writes OUT.json (GPU, Triton):

    python benchmarks/probes/norm_rounding.py OUT.json

Both sides compute ``q, scale = row_quant(bf16(bf16(bf16(layer_norm(x)) * m) + shift))`` with the same
three roundings to bf16. Here each stage is held to the same stage computed in float64 and rounded
once to bf16 (the correctly rounded value): torch's ``F.layer_norm`` output, the product, the sum,
and the e4m3 codes of torch's composition and of ``rows_quant_fp8`` (the Triton kernel). Per
(K, batch): the fraction of elements that differ from the correctly rounded value at each stage,
and each side's relative error against the unrounded float64 modulated norm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prx_compile.ops import kernels  # noqa: E402
from prx_compile.ops.kernels import row_quant_fp8_torch, rows_quant_fp8, rows_quant_fp8_torch  # noqa: E402

#: a CPU runs it as a dry run: ``rows_quant_fp8`` is the torch composition there
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _differ(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of elements whose bits differ (a, b of one dtype: bf16 or e4m3)."""
    bits = torch.uint8 if a.element_size() == 1 else torch.int16
    return round((a.view(bits) != b.view(bits)).float().mean().item(), 5)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 rounded once, to nearest even (``.bfloat16()`` goes through fp32: twice)."""
    mant, exp = torch.frexp(t)
    return torch.ldexp(torch.round(mant * 256), exp - 8).bfloat16()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float(f"{((a.double() - ref).norm() / ref.norm()).item():.4g}")


def one(k: int, batch: int, seed: int) -> dict:
    g = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(batch * 150, k, device=DEVICE, generator=g).bfloat16() * 3 + 1
    mult = 1 + torch.randn(batch, k, device=DEVICE, generator=g).bfloat16()
    shift = torch.randn(batch, k, device=DEVICE, generator=g).bfloat16()
    rows = x.shape[0] // batch
    m, sh = mult.repeat_interleave(rows, 0), shift.repeat_interleave(rows, 0)
    # float64, rounded once per stage (what both sides mean to compute)
    ln64 = F.layer_norm(x.double(), (k,), eps=1e-6)
    ln = _bf16(ln64)
    prod = _bf16(ln.double() * m.double())
    v = _bf16(prod.double() + sh.double())
    exact = ln64 * m.double() + sh.double()  # no rounding at all
    q_ref, s_ref = row_quant_fp8_torch(v)
    # torch's composition, stage by stage
    ln_t = F.layer_norm(x, (k,), eps=1e-6)
    prod_t = ln_t * m
    v_t = prod_t + sh
    q_t, s_t = rows_quant_fp8_torch([x], [False], (mult, shift, 1e-6))
    q_k, s_k = rows_quant_fp8([x], [False], (mult, shift, 1e-6))
    # the kernel's stages: the norm alone (mult 1, shift 0), then with the product (shift 0)
    one, zero = torch.ones_like(mult), torch.zeros_like(shift)
    stages = {}
    for label, (mm, ss, ref_v) in {
        "norm": (one, zero, ln),
        "norm_product": (mult, zero, prod),
    }.items():
        q_s, _ = rows_quant_fp8([x], [False], (mm, ss, 1e-6))
        stages[f"triton_codes_vs_reference_{label}"] = _differ(q_s, row_quant_fp8_torch(ref_v)[0])
        q_s, _ = rows_quant_fp8_torch([x], [False], (mm, ss, 1e-6))
        stages[f"torch_codes_vs_reference_{label}"] = _differ(q_s, row_quant_fp8_torch(ref_v)[0])
    return {
        "k": k,
        "batch": batch,
        "triton_ran": kernels._use_triton(x),
        **stages,
        "torch_layer_norm_vs_rounded_f64": _differ(ln_t, ln),
        "torch_product_vs_rounded_f64_of_its_input": _differ(prod_t, (ln_t.double() * m.double()).bfloat16()),
        "torch_sum_vs_rounded_f64_of_its_input": _differ(v_t, (prod_t.double() + sh.double()).bfloat16()),
        "torch_codes_vs_reference": _differ(q_t, q_ref),
        "triton_codes_vs_reference": _differ(q_k, q_ref),
        "triton_codes_vs_torch": _differ(q_k, q_t),
        "scales_max_rel_diff_triton_torch": float((s_k / s_t - 1).abs().max()),
        # a row whose largest element rounds otherwise has another scale: most of its codes may move
        "rows_with_another_scale_triton_torch": round((s_k != s_t).float().mean().item(), 5),
        "rows_with_another_scale_torch_reference": round((s_t != s_ref).float().mean().item(), 5),
        "rows_with_another_scale_triton_reference": round((s_k != s_ref).float().mean().item(), 5),
        "rel_err_vs_f64_torch": _rel(q_t.float() * s_t, exact),
        "rel_err_vs_f64_triton": _rel(q_k.float() * s_k, exact),
        "rel_err_vs_f64_reference": _rel(q_ref.float() * s_ref, exact),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    rows = [one(k, b, seed) for seed, (k, b) in enumerate(((3072, 2), (1792, 1), (64, 3), (3072, 1)))]
    for r in rows:
        print(r, flush=True)
    what = "python benchmarks/probes/norm_rounding.py OUT.json"
    out = {"what": what, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
