"""Issue 24's measurement: compile_prx against the strongest peers, in one process and one run.

    python benchmarks/peers.py OUT.json --parts bf16 fp8 [--shapes 3] [--ablations]

Full-size PRX (1.17 B, bf16, non-degenerate weights), the pipeline's text mask, at 1024² b2,
1024² b1 and 832x1216 b2 (``--shapes 1``: the first only). Every path is built on the first shape;
its first call at each shape is recorded (``build_s``, then ``extra.first_call_s``), then warm
ms/step and the error against bf16 eager. Parts (each path appended in this order):
  bf16   eager; torch.compile regional (each ``PRXBlock`` ``.compile(dynamic=False)``, diffusers'
         regional compilation); compile_prx default (``attention_kernel: auto``: one FlashAttention-4
         call per attention where flash-attn-4 is installed, else one cuDNN call; ``fuse_mlp_gate``:
         the MLP gate as one cuDNN GEMM with GELU * up in its epilogue; the step replayed before the
         change check); the same with the change check before the CUDA-graph replay (0.15's order);
         with ``--ablations`` also: without the fused gate; with ``attention_kernel: cudnn`` and
         without the fused gate (0.14's default)
  fp8    torch.compile regional + torchao float8 (``Float8DynamicActivationFloat8WeightConfig(PerRow())``
         on the block linears that ``precision: fp8`` quantises, then the blocks compiled); the
         ``prx-1024-fp8`` preset (``fp8_attention: auto``: bf16 attention on FlashAttention-4 where
         installed, else FP8 attention); the preset with the change check before the replay; with
         ``--ablations`` also the preset with ``fp8_attention: true`` (FP8 attention, cuDNN)
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


def checked_first(factory):
    """The same compile_prx path with the change check before the CUDA-graph replay, as up to 0.15
    (``_ahead`` off: the ablation of replaying ahead)."""

    def make(model):
        compiled = factory(model)
        compiled._ahead = False
        return compiled

    make.config, make.weights, make.dtype = factory.config, factory.weights, factory.dtype
    return make


def paths(parts: list[str], ablations: bool) -> dict:
    out: dict = {"eager": lambda m: m}
    if "bf16" in parts:
        out["torch.compile regional"] = regional
        out["compile_prx"] = compile_path()
        out["compile_prx[checked before the replay]"] = checked_first(compile_path())
        if ablations:
            out["compile_prx[fuse_mlp_gate: false]"] = compile_path(fuse_mlp_gate=False)
            out["compile_prx[attention_kernel: cudnn, fuse_mlp_gate: false]"] = compile_path(
                attention_kernel="cudnn", fuse_mlp_gate=False
            )
    if "fp8" in parts:
        out["torch.compile regional+torchao"] = regional_torchao
        out["compile_prx[prx-1024-fp8]"] = compile_path("prx-1024-fp8")
        fp8_preset = compile_path("prx-1024-fp8")
        out["compile_prx[prx-1024-fp8, checked before the replay]"] = checked_first(fp8_preset)
        if ablations:
            fp8_attention = compile_path("prx-1024-fp8", fp8_attention=True)
            out["compile_prx[prx-1024-fp8, fp8_attention: true]"] = fp8_attention
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
    ap.add_argument("--ablations", action="store_true", help="also the rows of 0.15's levers (see below)")
    args = ap.parse_args()
    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    res = run_bench(SHAPES[: args.shapes], paths(args.parts, args.ablations), model=model, out_json=args.out)
    res["parts"] = args.parts
    print(table(res), flush=True)
    if "profile" in args.parts:
        res["profiles"] = profiles(model, args.parts, args.ablations)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


def profiles(model, parts: list[str], ablations: bool) -> dict:
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
        if ablations:
            variants["compile_prx[attention_kernel: cudnn, fuse_mlp_gate: false]"] = dict(
                config="prx-1024-bf16-static", attention_kernel="cudnn", fuse_mlp_gate=False
            )
    if "fp8" in parts:
        variants["compile_prx[prx-1024-fp8]"] = dict(config="prx-1024-fp8", **static)
        if ablations:
            variants["compile_prx[prx-1024-fp8, fp8_attention: true]"] = dict(
                config="prx-1024-fp8", fp8_attention=True, **static
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
