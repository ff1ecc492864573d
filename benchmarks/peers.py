"""PRX against the strongest peers, in one process and one run.

    python benchmarks/peers.py OUT.json --parts bf16 fp8 [--shapes 3] [--ablations] [--model pixel]

Full-size PRX (1.17 B, bf16, non-degenerate weights; ``--model pixel``: the 7B-sized PRXPixel, pixel
space, made on the GPU), the pipeline's text mask, at 1024² b2, 1024² b1 and 832x1216 b2 (``--shapes
1``: the first only). ms/step is timed back to back (as a pipeline runs its steps); the per-call
synchronised median, min and max are beside it (``extra``). Every path is built on the first shape;
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

from prx_compile.models import SPECS
from prx_compile.tools.bench import Case, compile_path, run_bench, table
from prx_compile.tools.testing import FULL_PRX, PIXEL_PRX, make_prx

SHAPES = [Case((1024, 1024), 2), Case((1024, 1024), 1), Case((832, 1216), 2)]
PIXEL_SHAPES = [Case((1024, 1024), 2, vae_scale_factor=1), Case((1024, 1024), 1, vae_scale_factor=1)]
TARGETS = SPECS["prx"].block_linears


def pixel_model():
    """The 7B-sized PRXPixel with random non-degenerate weights, made on the GPU (no CPU copy)."""
    from common import init_random_

    spec = SPECS["prx"]
    model = spec.construct(PIXEL_PRX).to_empty(device="cuda")
    init_random_(model, seed=0)
    spec.nondegenerate_(model)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


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


def paths(parts: list[str], ablations: bool, pixel: bool = False) -> dict:
    out: dict = {"eager": lambda m: m}
    bf16, fp8 = ("prx-pixel-1024-bf16", "prx-pixel-1024-fp8") if pixel else (None, "prx-1024-fp8")
    if "bf16" in parts:
        out["torch.compile regional"] = regional
        out["compile_prx" + (f"[{bf16}]" if bf16 else "")] = compile_path(bf16)
        if not pixel:
            out["compile_prx[checked before the replay]"] = checked_first(compile_path())
        if ablations:
            out["compile_prx[fuse_mlp_gate: false]"] = compile_path(fuse_mlp_gate=False)
            out["compile_prx[attention_kernel: cudnn, fuse_mlp_gate: false]"] = compile_path(
                attention_kernel="cudnn", fuse_mlp_gate=False
            )
    if "fp8" in parts:
        out["torch.compile regional+torchao"] = regional_torchao
        out[f"compile_prx[{fp8}]"] = compile_path(fp8)
        if ablations:
            out[f"compile_prx[{fp8}, fp8_attention: true]"] = compile_path(fp8, fp8_attention=True)
            out[f"compile_prx[{fp8}, fp8_attention: false]"] = compile_path(fp8, fp8_attention=False)
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
    ap.add_argument("--model", choices=["prx", "pixel"], default="prx")
    args = ap.parse_args()
    pixel = args.model == "pixel"
    model = pixel_model() if pixel else make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    shapes = (PIXEL_SHAPES if pixel else SHAPES)[: args.shapes]
    res = run_bench(shapes, paths(args.parts, args.ablations, pixel), model=model, out_json=args.out)
    res["model"] = args.model
    res["parts"] = args.parts
    print(table(res), flush=True)
    if "profile" in args.parts:
        res["profiles"] = profiles(model, args.parts, args.ablations, shapes[0], pixel)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


def profiles(model, parts: list[str], ablations: bool, case: Case, pixel: bool) -> dict:
    """Kernels of one step at ``case`` by category, for eager and the compile_prx variants of
    ``parts`` (CUDA graphs off)."""
    from common import kernel_profile  # benchmarks/, beside this script

    from prx_compile import compile_prx

    kw = case.inputs(model, torch.bfloat16, "cuda")
    out = {"eager": kernel_profile(model, kw)}
    static = dict(static=True, specialize=[[1024, 1024, case.batch]])
    bf16, fp8 = ("prx-pixel-1024-bf16", "prx-pixel-1024-fp8") if pixel else ("prx-1024-bf16", "prx-1024-fp8")
    variants = {}
    if "bf16" in parts:
        variants[f"compile_prx[{bf16}]"] = dict(config=bf16, **static)
        if ablations:
            variants[f"compile_prx[{bf16}, attention_kernel: cudnn]"] = dict(
                config=bf16, attention_kernel="cudnn", **static
            )
    if "fp8" in parts:
        variants[f"compile_prx[{fp8}]"] = dict(config=fp8, **static)
        if ablations:
            variants[f"compile_prx[{fp8}, fp8_attention: true]"] = dict(
                config=fp8, fp8_attention=True, **static
            )
            variants[f"compile_prx[{fp8}, fp8_attention: false]"] = dict(
                config=fp8, fp8_attention=False, **static
            )
    for label, kwargs in variants.items():
        m = copy.deepcopy(model) if "fp8" in label else model
        try:
            ct = compile_prx(m, cuda_graphs=False, **kwargs)
            ct(**kw, return_dict=False)
            out[label] = kernel_profile(ct, kw)
            out[label]["kernels"] = ct.report()["kernels"]
            print(label, out[label]["ms_per_step_without_graphs"], out[label]["by_category"], flush=True)
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {e}"[:500]}
        del m
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
