"""PRX against the strongest peers, in one process and one run.

    python benchmarks/peers.py OUT.json --parts bf16 fp8 [--shapes 3] [--ablations] [--model pixel]

Full-size PRX (1.17 B, bf16, non-degenerate weights; ``--model pixel``: the 7B-sized PRXPixel, pixel
space, made on the GPU), the pipeline's text mask, at 1024² b2, 1024² b1 and 832x1216 b2 (``--shapes
1``: the first only). ms/step is timed back to back (as a pipeline runs its steps); the per-call
synchronised median, min and max are beside it (``extra``). Every path is built on the first shape;
its first call at each shape is recorded (``build_s``, then ``extra.first_call_s``), then warm
ms/step and the error against bf16 eager. Parts (each path appended in this order):
  bf16   eager; torch.compile regional (each ``PRXBlock`` ``.compile(dynamic=False)``, diffusers'
         regional compilation); compile_prx default (each engine set measures its attention kernels
         (FlashAttention-4, cuDNN, the split path: those installed) and the MLP gate fused into one
         cuDNN GEMM or not, and runs the fastest; the step replayed before the change check); with
         ``--ablations`` also: the change check before the CUDA-graph replay (0.15's order); without
         the fused gate; with ``attention_kernel: cudnn`` and without the fused gate (0.14's default)
  fp8    torch.compile regional + torchao float8 (``Float8DynamicActivationFloat8WeightConfig(PerRow())``
         on the block linears that ``precision: fp8`` quantises, then the blocks compiled); the
         ``prx-1024-fp8`` preset (``fp8_attention: auto``: our FP8 attention in each tiling and the
         bf16 kernels measured, the fastest runs); with ``--ablations`` also the preset with
         ``fp8_attention: true`` and with ``false``; with ``--fp8-masters host`` also the preset
         with its exact weights in pinned host memory (device memory in ``extra``); with
         ``--fp8-norm-on`` also the preset with ``fp8_norm: true``
  whole  ``torch.compile(model)``
  profile  the kernels of one step at 1024² b2 by category (CUDA graphs off, torch.profiler) for
         the compile_prx variants of the parts asked for (``profile`` alone: eager's rows only, and
         both presets profiled) -> OUT.json's ``profiles``
  timeline the compile_prx presets of the parts asked for (``timeline`` alone: both) as they run,
         CUDA graphs on, at 1024² b2: per step the span of its kernels, the time some kernel ran, the
         idle rest and its longest gaps (``common.step_timeline``) -> OUT.json's ``timelines``
  pipeline (``--model pixel``) a 28-step ``PRXPixelPipeline`` at 1024² (guidance 4: batch 2; a
         random tiny text encoder, 256 text tokens) with the transformer eager, regionally compiled,
         and compile_prx's bf16 and fp8 presets: seconds per image (the second of two runs) and the
         final image's error against eager -> OUT.json's ``pipeline``
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


def pixel_model(weights: str = "constructed"):
    """The 7B-sized PRXPixel with random non-degenerate weights (``common.WEIGHTS``), made on the GPU
    (no CPU copy)."""
    from common import made_model

    return made_model(SPECS["prx"], PIXEL_PRX, weights, "cuda", torch.bfloat16)


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


def paths(
    parts: list[str],
    ablations: bool,
    pixel: bool = False,
    masters: tuple[str, ...] = (),
    norm_on: bool = False,
) -> dict:
    out: dict = {"eager": lambda m: m}
    bf16, fp8 = ("prx-pixel-1024-bf16", "prx-pixel-1024-fp8") if pixel else (None, "prx-1024-fp8")
    if "bf16" in parts:
        out["torch.compile regional"] = regional
        out["compile_prx" + (f"[{bf16}]" if bf16 else "")] = compile_path(bf16)
        if ablations:
            out["compile_prx[checked before the replay]"] = checked_first(compile_path())
            out["compile_prx[fuse_mlp_gate: false]"] = compile_path(fuse_mlp_gate=False)
            out["compile_prx[attention_kernel: cudnn, fuse_mlp_gate: false]"] = compile_path(
                attention_kernel="cudnn", fuse_mlp_gate=False
            )
    if "fp8" in parts:
        out["torch.compile regional+torchao"] = regional_torchao
        out[f"compile_prx[{fp8}]"] = compile_path(fp8)
        for where in masters:
            out[f"compile_prx[{fp8}, fp8_masters: {where}]"] = compile_path(fp8, fp8_masters=where)
        if norm_on:
            out[f"compile_prx[{fp8}, fp8_norm: true]"] = compile_path(fp8, fp8_norm=True)
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
        "--parts",
        nargs="+",
        default=["bf16", "fp8"],
        choices=["bf16", "fp8", "whole", "profile", "timeline", "pipeline"],
    )
    ap.add_argument("--shapes", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--ablations", action="store_true", help="also the rows of 0.15's levers (see below)")
    ap.add_argument("--model", choices=["prx", "pixel"], default="prx")
    ap.add_argument(
        "--fp8-masters", nargs="*", default=[], choices=["host"], help="fp8: also the preset with these"
    )
    from common import WEIGHTS  # benchmarks/, beside this script

    ap.add_argument(
        "--weights",
        choices=list(WEIGHTS),
        default="constructed",
        help="the 7B's weights (common.WEIGHTS); the 1.17 B's are always make_prx's (constructed)",
    )
    ap.add_argument(
        "--fp8-norm-on",
        action="store_true",
        help="fp8: also the preset with fp8_norm: true (the modulated norms made in the quantisation)",
    )
    ap.add_argument(
        "--reference-fp32",
        action="store_true",
        help="also each output's error against an fp32 copy of the model (extra.rel_err_fp32)",
    )
    args = ap.parse_args()
    pixel = args.model == "pixel"
    if args.weights != "constructed" and not pixel:
        ap.error("--weights scaled is for --model pixel: the 1.17 B is always make_prx's (constructed)")
    model = pixel_model(args.weights) if pixel else make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    shapes = (PIXEL_SHAPES if pixel else SHAPES)[: args.shapes]
    res = run_bench(
        shapes,
        paths(args.parts, args.ablations, pixel, tuple(args.fp8_masters), args.fp8_norm_on),
        model=model,
        out_json=args.out,
        reference_fp32=args.reference_fp32,
    )
    res["model"] = args.model
    res["model_weights"] = args.weights
    res["parts"] = args.parts
    print(table(res), flush=True)
    if "profile" in args.parts:
        res["profiles"] = profiles(model, args.parts, args.ablations, shapes[0], pixel)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if "timeline" in args.parts:
        res["timelines"] = timelines(model, args.parts, shapes[0], pixel)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if "pipeline" in args.parts and pixel:
        res["pipeline"] = pixel_pipeline(model)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


def pixel_pipeline(model, steps: int = 28, size: int = 1024, text: int = 256) -> dict:
    """A ``PRXPixelPipeline`` run per transformer form: seconds per image, the image's error."""
    import time
    import types

    import diffusers.pipelines.prx.pipeline_prx as prx_pipeline
    import diffusers.pipelines.prx.pipeline_prx_pixel as pixel_pipeline_module

    from prx_compile import compile_prx
    from prx_compile.tools.bench import rel_err
    from prx_compile.tools.testing import tiny_pixel_pipeline

    for module in (prx_pipeline, pixel_pipeline_module):  # diffusers' prompt clean-up needs ftfy, absent
        if not hasattr(module, "ftfy"):  # on the device: the prompt as it is
            module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    pipe = tiny_pixel_pipeline(model, text_len=text)
    pipe.text_encoder.to("cuda", torch.bfloat16)
    forms = {
        "eager": lambda: model,
        "torch.compile regional": lambda: regional(model),
        "compile_prx[prx-pixel-1024-bf16]": lambda: compile_prx(model, config="prx-pixel-1024-bf16"),
        "compile_prx[prx-pixel-1024-fp8]": lambda: compile_prx(
            copy.deepcopy(model), config="prx-pixel-1024-fp8"
        ),
    }
    out, ref = {"steps": steps, "size": size, "text_tokens": text, "guidance_scale": 4.0}, None
    for label, make in forms.items():
        try:
            pipe.transformer = make()
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                image = pipe(
                    prompt="a photo of a cat",
                    height=size,
                    width=size,
                    num_inference_steps=steps,
                    guidance_scale=4.0,
                    output_type="pt",
                    use_resolution_binning=False,
                    generator=torch.Generator("cuda").manual_seed(0),
                ).images
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            image = image.float().cpu()
            ref = image if ref is None else ref
            row = {"s_per_image": round(times[1], 3), "s_first_run": round(times[0], 3)}
            row["image_rel_err_vs_eager"] = rel_err(image, ref)
            row["nan"] = bool(image.isnan().any())
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {e}"[:500]}
        out[label] = row
        print("pipeline", label, row, flush=True)
        torch.cuda.empty_cache()
    return out


def presets(parts: list[str], pixel: bool) -> list[str]:
    """The compile_prx presets of ``parts`` (both when neither ``bf16`` nor ``fp8`` is asked)."""
    bf16, fp8 = ("prx-pixel-1024-bf16", "prx-pixel-1024-fp8") if pixel else ("prx-1024-bf16", "prx-1024-fp8")
    both = not {"bf16", "fp8"} & set(parts)
    return [p for p, part in ((bf16, "bf16"), (fp8, "fp8")) if part in parts or both]


def timelines(model, parts: list[str], case: Case, pixel: bool) -> dict:
    """Each preset of ``parts`` as it runs at ``case``, CUDA graphs on (``common.step_timeline``)."""
    from common import step_timeline  # benchmarks/, beside this script

    from prx_compile import compile_prx

    kw = case.inputs(model, torch.bfloat16, "cuda")
    out = {}
    for preset in presets(parts, pixel):
        m = copy.deepcopy(model) if "fp8" in preset else model
        label = f"compile_prx[{preset}]"
        try:
            ct = compile_prx(m, config=preset)
            ct(**kw, return_dict=False)
            out[label] = step_timeline(ct, kw)
            print(label, {k: v for k, v in out[label].items() if k != "gaps"}, flush=True)
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {e}"[:500]}
        del m
        torch.cuda.empty_cache()
    return out


def profiles(model, parts: list[str], ablations: bool, case: Case, pixel: bool) -> dict:
    """Kernels of one step at ``case`` by category, for eager and the compile_prx variants of
    ``parts`` (CUDA graphs off)."""
    from common import kernel_profile  # benchmarks/, beside this script

    from prx_compile import compile_prx

    kw = case.inputs(model, torch.bfloat16, "cuda")
    out = {"eager": kernel_profile(model, kw)}
    static = dict(static=True, specialize=[[1024, 1024, case.batch]])
    variants = {}
    for preset in presets(parts, pixel):  # ``--parts profile`` alone: both presets, no peer rows
        variants[f"compile_prx[{preset}]"] = dict(config=preset, **static)
        if ablations and "bf16" in preset:
            variants[f"compile_prx[{preset}, attention_kernel: cudnn]"] = dict(
                config=preset, attention_kernel="cudnn", **static
            )
        if ablations and "fp8" in preset:
            for on in (True, False):
                variants[f"compile_prx[{preset}, fp8_attention: {str(on).lower()}]"] = dict(
                    config=preset, fp8_attention=on, **static
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
