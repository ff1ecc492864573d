"""Issue 24's measurement: compile_prx against the strongest peers, in one process and one run.

    python benchmarks/peers.py OUT.json --parts bf16 fp8 [--shapes 3]

Full-size PRX (1.17 B, bf16, non-degenerate weights), the pipeline's text mask, at 1024² b2,
1024² b1 and 832x1216 b2 (``--shapes 1``: the first only). Every path is built on the first shape;
its first call at each shape is recorded (``build_s``, then ``extra.first_call_s``), then warm
ms/step and the error against bf16 eager. Parts (each path appended in this order):
  bf16   eager; torch.compile regional (each ``PRXBlock`` ``.compile(dynamic=False)``, diffusers'
         regional compilation); compile_prx default (``attention_kernel: auto``: one FlashAttention-4
         call per attention where flash-attn-4 is installed, else one cuDNN call; ``fuse_mlp_gate``:
         the MLP gate as one cuDNN GEMM with GELU * up in its epilogue); the same without the fused
         gate; the same with ``attention_kernel: cudnn`` and without the fused gate (0.14's default)
  fp8    torch.compile regional + torchao float8 (``Float8DynamicActivationFloat8WeightConfig(PerRow())``
         on the block linears that ``precision: fp8`` quantises, then the blocks compiled); the
         ``prx-1024-fp8`` preset; the same with ``fp8_attention: false`` (bf16 attention, by
         ``attention_kernel: auto``: FlashAttention-4 where installed)
  whole  ``torch.compile(model)``
  profile  the kernels of one step at 1024² b2 by category (CUDA graphs off, torch.profiler) for
         the compile_prx variants of the parts asked for -> OUT.json's ``profiles``
Needs torchao importable for ``fp8``. -> OUT.json in the benchmark layout (``bench.run_bench``).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from prx_compile.quant.fp8 import TARGETS
from prx_compile.tools.bench import Case, compile_path, run_bench, table
from prx_compile.tools.testing import FULL_PRX, make_prx

SHAPES = [Case((1024, 1024), 2), Case((1024, 1024), 1), Case((832, 1216), 2)]


def regional(model):
    """diffusers' regional compilation: each transformer block compiled on its own, static shapes."""
    model = copy.deepcopy(model)
    for block in model.blocks:
        block.compile(dynamic=False)
    return model


def regional_torchao(model):
    """torchao float8 (row-wise dynamic activation scales, per-channel weights) on the block linears,
    then regional compilation: the strongest FP8 peer measured on PRX."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    model = copy.deepcopy(model)
    quantize_(
        model,
        Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and bool(TARGETS.match(fqn)),
    )
    for block in model.blocks:
        block.compile(dynamic=False)
    return model


regional_torchao.dtype = "fp8"


def paths(parts: list[str]) -> dict:
    out: dict = {"eager": lambda m: m}
    if "bf16" in parts:
        out["torch.compile regional"] = regional
        out["compile_prx"] = compile_path()
        out["compile_prx[fuse_mlp_gate: false]"] = compile_path(fuse_mlp_gate=False)
        out["compile_prx[attention_kernel: cudnn, fuse_mlp_gate: false]"] = compile_path(
            attention_kernel="cudnn", fuse_mlp_gate=False
        )
    if "fp8" in parts:
        out["torch.compile regional+torchao"] = regional_torchao
        out["compile_prx[prx-1024-fp8]"] = compile_path("prx-1024-fp8")
        out["compile_prx[prx-1024-fp8, fp8_attention: false]"] = compile_path(
            "prx-1024-fp8", fp8_attention=False
        )
    if "whole" in parts:
        out["torch.compile"] = lambda m: torch.compile(m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument(
        "--parts", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "whole", "profile"]
    )
    ap.add_argument("--shapes", type=int, default=3, choices=[1, 2, 3])
    args = ap.parse_args()
    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    res = run_bench(SHAPES[: args.shapes], paths(args.parts), model=model, out_json=args.out)
    res["parts"] = args.parts
    print(table(res), flush=True)
    if "profile" in args.parts:
        res["profiles"] = profiles(model, args.parts)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


def profiles(model, parts: list[str]) -> dict:
    """Kernels of one 1024² b2 step by category, for the compile_prx variants of ``parts`` (CUDA
    graphs off)."""
    from run_device import kernel_profile  # benchmarks/, beside this script

    from prx_compile import compile_prx

    kw = SHAPES[0].inputs(model.config, torch.bfloat16, "cuda")
    out = {}
    static = dict(static=True, specialize=[[1024, 1024, 2]])
    variants = {}
    if "bf16" in parts:
        variants["compile_prx"] = dict(config="prx-1024-bf16-static")
        variants["compile_prx[attention_kernel: cudnn, fuse_mlp_gate: false]"] = dict(
            config="prx-1024-bf16-static", attention_kernel="cudnn", fuse_mlp_gate=False
        )
    if "fp8" in parts:
        variants["compile_prx[prx-1024-fp8]"] = dict(config="prx-1024-fp8", **static)
        variants["compile_prx[prx-1024-fp8, fp8_attention: false]"] = dict(
            config="prx-1024-fp8", fp8_attention=False, **static
        )
    for label, kwargs in variants.items():
        m = copy.deepcopy(model) if "fp8" in label else model
        try:
            ct = compile_prx(m, cuda_graphs=False, **kwargs)
            ct(**kw, return_dict=False)
            out[label] = kernel_profile(ct, kw)
            print(label, out[label]["ms_per_step_without_graphs"], out[label]["by_category"], flush=True)
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {e}"[:500]}
        del m
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
