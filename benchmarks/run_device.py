"""What the issues ask to measure on the GPU, in phases; every phase appends to JSON files in --out.

    python benchmarks/run_device.py --out $OUT --phases perf lora artifact

Phases (full-size PRX, 1.17 B, bf16, non-degenerate weights; pipeline text mask):
  perf        eager, torch.compile and compile_prx (default config and the static preset) at
              1024² b2, 1024² b1, 832x1216 b2; the bins preset at 512² b2; for each --weights mode.
              -> perf_<mode>.json
  peers       torch.compile(mode="max-autotune") at 1024² b2 with eager, compile_prx (default) and
              compile_prx fp8 (static) -> peers.json
  modes       the static preset with weights "inputs" and "engine" at 1024² b2, with eager
              -> modes_1024_b2.json
  lora        rank-64 LoRA over the 96 attention and MLP linears: load, switch, unload seconds, step
              time before and after, output against eager with the same LoRA -> lora_artifact.json
  artifact    save (size with a rank-64 LoRA and without one, seconds), load in a new process
              (seconds to a finished first step),
              bit-identical outputs; GPU memory with one engine set and with three -> lora_artifact.json
  artifact_static  the same for the static preset (one engine set; from --cache when the fp8 phase
              built it) -> artifact_static.json
  fp8         precision fp8 at 1024² b2 against eager, torch.compile, torch.compile + torchao float8
              and bf16 compile_prx (static) -> fp8_1024_b2.json (needs torchao importable)
  fp8_more    fp8 at 1024² b1 and 512² b2 with eager and torch.compile -> fp8_more.json
  fp8_pipeline  a 28-step PRXPipeline's final latents (fp8 compile_prx against bf16 eager); a
              rank-64 LoRA switch with fp8 -> fp8_pipeline.json
  fp8_inductor  the inductor backend with fp8 at 1024² b2, with eager -> fp8_inductor.json
  range_profile  832x1216 b2 (no specialised set): eager, torch.compile, the default call's range set,
              the fp8 preset's range set, a static set for the shape; kernels of the bf16 range
              and static sets by category -> range_profile.json
  fp8_profile  fp8 at 1024² b2 with and without the fp8_mlp rule, with eager; then the kernels of
              one fp8 step by category (torch.profiler, CUDA graphs off) -> fp8_profile.json
Each speedup in a file is a ratio of numbers from the same process and run.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from prx_compile import compile_prx, load_lora, save_compiled, set_lora, unload_lora
from prx_compile.lora import make_random_lora
from prx_compile.tools.bench import (
    PATHS,
    Case,
    compile_path,
    environment,
    rel_err,
    run_bench,
    table,
    time_cuda,
)
from prx_compile.tools.testing import FULL_PRX, make_prx

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.0f} s] {msg}", flush=True)


def full_model():
    return make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")


def perf(out: Path, modes: list[str], peers: bool) -> None:
    model = full_model()
    shapes = [Case((1024, 1024), 2), Case((1024, 1024), 1), Case((832, 1216), 2)]
    for mode in modes:
        cache = tempfile.mkdtemp()  # the static preset's set is the default's 1024² b2 set: built once
        paths = {} if not peers else {"eager": lambda m: m, "torch.compile": lambda m: torch.compile(m)}
        paths[f"compile_prx[default,{mode}]"] = compile_path(None, weights=mode, engine_cache_dir=cache)
        path_json = out / f"perf_{mode}.json"
        res = run_bench(shapes, paths, model=model, out_json=path_json)
        static = run_bench(
            shapes[:1],
            {
                f"compile_prx[static,{mode}]": compile_path(
                    "prx-1024-bf16-static", weights=mode, engine_cache_dir=cache
                )
            },
            model=model,
        )
        res["records"] += static["records"]
        path_json.write_text(json.dumps(res, indent=1, default=str))  # kept if a later part times out
        small = [Case((512, 512), 2)]
        small_paths = {} if not peers else {"eager": lambda m: m, "torch.compile": lambda m: torch.compile(m)}
        small_paths[f"compile_prx[prx-bins-bf16,{mode}]"] = compile_path("prx-bins-bf16", weights=mode)
        bins = run_bench(small, small_paths, model=model)
        res["records"] += bins["records"]
        path_json.write_text(json.dumps(res, indent=1, default=str))
        print(table(res), flush=True)
        peers = False  # eager and torch.compile once per run


def modes(out: Path) -> None:
    """Both weights modes at 1024² b2 with the static preset, against eager, in one process."""
    res = run_bench(
        [Case((1024, 1024), 2)],
        {
            "eager": lambda m: m,
            "compile_prx[static,inputs]": compile_path("prx-1024-bf16-static", weights="inputs"),
            "compile_prx[static,engine]": compile_path("prx-1024-bf16-static", weights="engine"),
        },
        model=full_model(),
        out_json=out / "modes_1024_b2.json",
    )
    print(table(res), flush=True)


FP8_STATIC = dict(static=True, specialize=[[1024, 1024, 2]])


def max_autotune(out: Path) -> None:
    model = full_model()
    res = run_bench(
        [Case((1024, 1024), 2)],
        {
            "eager": lambda m: m,
            "compile_prx[default,inputs]": compile_path(None),
            "compile_prx[static,fp8]": compile_path("prx-1024-fp8", **FP8_STATIC),
            "torch.compile-max-autotune": lambda m: torch.compile(m, mode="max-autotune"),
        },
        model=model,
        out_json=out / "peers.json",
    )
    print(table(res), flush=True)


def fp8(out: Path, cache: str) -> None:
    """fp8 and its peers at 1024² b2, one process, one run."""
    res = run_bench(
        [Case((1024, 1024), 2)],
        {
            "eager": lambda m: m,
            "torch.compile": lambda m: torch.compile(m),
            "compile_prx[static,bf16]": compile_path("prx-1024-bf16-static", engine_cache_dir=cache),
            "compile_prx[static,fp8]": compile_path("prx-1024-fp8", **FP8_STATIC, engine_cache_dir=cache),
            "torch.compile+torchao": PATHS["torch.compile+torchao"],
        },
        model=full_model(),
        out_json=out / "fp8_1024_b2.json",
    )
    print(table(res), flush=True)


def fp8_inductor(out: Path) -> None:
    """The named alternative backend: inductor with fp8, against eager, at 1024² b2."""
    res = run_bench(
        [Case((1024, 1024), 2)],
        {
            "eager": lambda m: m,
            "compile_prx[inductor,fp8]": compile_path("prx-1024-fp8", backend="inductor", **FP8_STATIC),
        },
        model=full_model(),
        out_json=out / "fp8_inductor.json",
    )
    print(table(res), flush=True)


def kernel_categories(names_ms: dict[str, tuple[int, float]]) -> dict[str, float]:
    """Kernel name -> (calls, ms) summed into coarse categories (ms per step)."""
    exact = {"_kernel": "triton q/k norm + rope", "_merge_kernel": "triton attention merge"}
    rules = [
        ("cuBLAS GEMM (torch._scaled_mm)", ("nvjet", "f8f8bf16", "scaled_mm")),
        ("triton fp8 quantisation", ("_row_quant", "_gelu_mul_quant")),
        ("attention (FlashAttention-4)", ("flash_attncute",)),
        ("attention (cuDNN)", ("sdpa", "flash", "fmha")),
        ("cuDNN GEMM + epilogue (the MLP gate)", ("cudnn_generated_fort_native_sm90_matmul",)),
        ("tensorrt (myelin fusions, its GEMMs)", ("__myl", "matmul", "xmma", "gemm")),
    ]
    out: dict[str, float] = {}
    for name, (_, ms) in names_ms.items():
        low = name.lower()
        cat = exact.get(name) or next((c for c, keys in rules if any(k in low for k in keys)), "other")
        out[cat] = out.get(cat, 0.0) + ms
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def kernel_profile(ct, kw: dict[str, torch.Tensor]) -> dict:
    """The kernels of one step of ``ct`` (built with CUDA graphs off): ms per step by name and by
    category (torch.profiler over 3 steps, divided by 3), and the step time without graphs."""
    from torch.profiler import ProfilerActivity, profile

    step = lambda: ct(**kw, return_dict=False)  # noqa: E731
    no_graph_ms = time_cuda(step)["ms"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
            ms = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3 / 3
            if ms > 0:
                kernels[e.key] = (e.count // 3, ms)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]
    return {
        "ms_per_step_without_graphs": no_graph_ms,
        "kernel_ms_total": round(sum(ms for _, ms in kernels.values()), 3),
        "by_category": kernel_categories(kernels),
        "top_kernels": [{"name": k[:160], "calls": c, "ms": round(ms, 4)} for k, (c, ms) in top],
        "report": ct.report(),
    }


def fp8_profile(out: Path, cache: str, ablation: bool) -> None:
    """fp8 (static, 1024² b2) with the fp8_mlp rule and, with ``ablation``, without it, against
    eager; then the kernels of one step of the first, by name and by category."""
    model = full_model()
    paths = {
        "eager": lambda m: m,
        "compile_prx[static,fp8]": compile_path("prx-1024-fp8", **FP8_STATIC, engine_cache_dir=cache),
    }
    if ablation:
        paths["compile_prx[static,fp8,no fp8_mlp]"] = compile_path(
            "prx-1024-fp8", **FP8_STATIC, fp8_mlp=False
        )
    res = run_bench([Case((1024, 1024), 2)], paths, model=model, out_json=out / "fp8_profile.json")
    print(table(res), flush=True)
    fp8_model = copy.deepcopy(model)
    ct = compile_prx(
        fp8_model, config="prx-1024-fp8", **FP8_STATIC, engine_cache_dir=cache, cuda_graphs=False
    )
    what = "compile_prx[static,fp8] at 1024² b2, CUDA graphs off, kernel times per step (3 steps / 3)"
    res["profile"] = kernel_profile(ct, Case((1024, 1024), 2).inputs(model.config, torch.bfloat16, "cuda"))
    res["profile"]["what"] = what
    (out / "fp8_profile.json").write_text(json.dumps(res, indent=1, default=str))
    log(f"profile: {json.dumps(res['profile']['by_category'])}")


def range_profile(out: Path) -> None:
    """832x1216 b2, a shape no preset specialises: eager, torch.compile, the default call (its range
    set), the fp8 preset (its range set) and a static set for that shape, in one process; then the
    kernels of one step of the bf16 range set and of the static set."""
    model = full_model()
    case, shape = Case((832, 1216), 2), [[832, 1216, 2]]
    cache = tempfile.mkdtemp()  # the profiles below reuse the timed paths' engines
    res = run_bench(
        [case],
        {
            "eager": lambda m: m,
            "torch.compile": lambda m: torch.compile(m),
            "compile_prx[default,range]": compile_path(None, engine_cache_dir=cache),
            "compile_prx[static 832x1216]": compile_path(
                None, static=True, specialize=shape, engine_cache_dir=cache
            ),
            "compile_prx[prx-1024-fp8,range]": compile_path("prx-1024-fp8"),
        },
        model=model,
        out_json=out / "range_profile.json",
    )
    print(table(res), flush=True)
    kw = case.inputs(model.config, torch.bfloat16, "cuda")
    res["profiles"] = {}
    for label, kwargs in (("range", {}), ("static 832x1216", dict(static=True, specialize=shape))):
        ct = compile_prx(model, engine_cache_dir=cache, cuda_graphs=False, **kwargs)
        res["profiles"][label] = kernel_profile(ct, kw)
        log(f"profile {label}: {json.dumps(res['profiles'][label]['by_category'])}")
        (out / "range_profile.json").write_text(json.dumps(res, indent=1, default=str))
        del ct
        torch.cuda.empty_cache()


def fp8_more(out: Path, cache: str) -> None:
    """fp8 at 1024² b1 and 512² b2, with eager and torch.compile."""
    model = full_model()
    shapes = [[1024, 1024, 1], [512, 512, 2]]
    res = run_bench(
        [Case((1024, 1024), 1), Case((512, 512), 2)],
        {
            "eager": lambda m: m,
            "torch.compile": lambda m: torch.compile(m),
            "compile_prx[static,fp8]": compile_path(
                "prx-1024-fp8", static=True, specialize=shapes, engine_cache_dir=cache
            ),
        },
        model=model,
        out_json=out / "fp8_more.json",
    )
    print(table(res), flush=True)


def fp8_pipeline(out: Path, cache: str) -> None:
    """A 28-step PRXPipeline's final latents (fp8 compile_prx against bf16 eager; the preset as it
    resolves, then with ``fp8_attention: true``) and a rank-64 LoRA switch with fp8."""
    import copy
    import types

    import diffusers.pipelines.prx.pipeline_prx as pipeline_prx
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPipeline

    from prx_compile.tools.testing import tiny_text_encoder, tiny_tokenizer

    if not hasattr(pipeline_prx, "ftfy"):  # the pipeline's text cleaning calls ftfy when it is absent
        pipeline_prx.ftfy = types.SimpleNamespace(fix_text=lambda text: text)  # our prompt is plain ASCII
    model = full_model()
    res: dict = {"env": environment(), "records": []}
    fp8_model = copy.deepcopy(model)
    ct = compile_prx(fp8_model, config="prx-1024-fp8", **FP8_STATIC, engine_cache_dir=cache)
    tok = tiny_tokenizer(256)
    enc = tiny_text_encoder(len(tok), model.config.context_in_dim).to("cuda", torch.bfloat16)
    pipe = PRXPipeline(
        transformer=model,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=enc,
        tokenizer=tok,
        vae=None,
    )
    pipe.set_progress_bar_config(disable=True)
    args = dict(
        prompt="a red car on the moon at night",
        height=1024,
        width=1024,
        guidance_scale=4.0,
        output_type="latent",
        use_resolution_binning=False,
        num_inference_steps=28,
    )

    def latents(transformer):
        pipe.transformer = transformer
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lat = pipe(**args, generator=torch.Generator("cuda").manual_seed(0)).images
        torch.cuda.synchronize()
        return lat, time.perf_counter() - t0

    ref, eager_s = latents(model)
    for fp8_attention in ("auto", True):  # auto: bf16 attention on FlashAttention-4 where installed
        compiled = ct
        if fp8_attention is True:
            compiled = compile_prx(
                copy.deepcopy(model),
                config="prx-1024-fp8",
                **FP8_STATIC,
                fp8_attention=True,
                engine_cache_dir=cache,
            )
        latents(compiled)  # builds or loads the engines
        got, fp8_s = latents(compiled)
        rec: dict = {
            "path": "pipeline",
            "dtype": "fp8",
            "steps": 28,
            "fp8_attention": fp8_attention,
            "attention": compiled.compile_config.padded_attention(),
            "fp8_attention_on": compiled.compile_config.fp8_attention_on(),
            "eager_bf16_s": eager_s,
            "compile_prx_fp8_s": fp8_s,
            "final_latents_rel_err": rel_err(got, ref),
            "nan": bool(torch.isnan(got).any()),
        }
        log(f"pipeline: {rec}")
        res["records"].append(rec)
        del compiled
    kw = Case((1024, 1024), 2).inputs(model.config, torch.bfloat16, "cuda")
    base = ct(**kw, return_dict=False)[0].clone()
    a = make_random_lora(fp8_model, 64, seed=1, std=0.02)
    b = make_random_lora(fp8_model, 64, seed=2, std=0.02)
    timings = {}
    for label, fn in (
        ("load_s", lambda: load_lora(ct, a, "a")),
        ("load_b_s", lambda: load_lora(ct, b, "b", scale=0.0)),
        ("switch_s", lambda: set_lora(ct, "b")),
        ("switch_back_s", lambda: set_lora(ct, "a")),
    ):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        timings[label] = time.perf_counter() - t0
    out_a = ct(**kw, return_dict=False)[0].clone()
    ref_model = full_model()  # the same LoRA merged in bf16, then quantised: what fp8 should give
    load_lora(ref_model, a, "a")
    from prx_compile.quant import fp8 as fp8_mod

    fp8_mod.install(ref_model)
    with torch.no_grad():
        ref_a = ref_model(**kw, return_dict=False)[0]
    del ref_model
    set_lora(ct, "b")
    set_lora(ct, "a")
    a_again = torch.equal(ct(**kw, return_dict=False)[0], out_a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    unload_lora(ct)
    torch.cuda.synchronize()
    timings["unload_s"] = time.perf_counter() - t0
    lora_rec = {
        "path": "lora",
        "dtype": "fp8",
        "rank": 64,
        **timings,
        "rel_err_vs_fp8_eager_with_lora": rel_err(out_a, ref_a),
        "lora_effect_rel": rel_err(out_a, base),
        "a_b_a_bitexact": a_again,
        "unload_bitexact": torch.equal(ct(**kw, return_dict=False)[0], base),
    }
    log(f"lora fp8: {lora_rec}")
    res["records"].append(lora_rec)
    (out / "fp8_pipeline.json").write_text(json.dumps(res, indent=1, default=str))


def lora_and_artifact(
    out: Path,
    phases: list[str],
    config: str | None = None,
    cache: str | None = None,
    name: str = "lora_artifact",
) -> None:
    model = full_model()
    case = Case((1024, 1024), 2)
    kw = case.inputs(model.config, torch.bfloat16, "cuda")
    result: dict = {"env": environment(), "config": config or "default", "records": []}
    path_file = out / f"{name}.json"

    def save():
        path_file.write_text(json.dumps(result, indent=1, default=str))

    ct = compile_prx(model, config=config, engine_cache_dir=cache)  # weights as inputs
    t0 = time.perf_counter()
    base = ct(**kw, return_dict=False)[0].clone()
    build_s = time.perf_counter() - t0
    step = lambda: ct(**kw, return_dict=False)  # noqa: E731
    if "lora" in phases:
        before = time_cuda(step)["ms"]
        a = make_random_lora(model, 64, seed=1, std=0.02)
        b = make_random_lora(model, 64, seed=2, std=0.02)
        timings = {}
        for label, fn in (
            ("load_s", lambda: load_lora(ct, a, "a")),
            ("load_b_s", lambda: load_lora(ct, b, "b", scale=0.0)),
            ("switch_s", lambda: set_lora(ct, "b")),
            ("switch_back_s", lambda: set_lora(ct, "a")),
        ):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rep = fn()
            torch.cuda.synchronize()
            timings[label] = time.perf_counter() - t0
            timings[label + "_layers"] = rep.get("changed")
        out_a = ct(**kw, return_dict=False)[0].clone()
        with torch.no_grad():
            ref_a = model(**kw, return_dict=False)[0]
        after = time_cuda(step)["ms"]
        set_lora(ct, "b")
        set_lora(ct, "a")
        a_again = torch.equal(ct(**kw, return_dict=False)[0], out_a)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        unload_lora(ct)
        torch.cuda.synchronize()
        timings["unload_s"] = time.perf_counter() - t0
        result["records"].append(
            {
                "path": "lora",
                "weights": "inputs",
                "rank": 64,
                "linears": len([k for k in a if k.endswith("lora_A.weight")]),
                **timings,
                "ms_per_step_before": before,
                "ms_per_step_after": after,
                "rel_err_vs_eager_with_lora": rel_err(out_a, ref_a),
                "lora_effect_rel": rel_err(out_a, base),
                "a_b_a_bitexact": a_again,
                "unload_bitexact": torch.equal(ct(**kw, return_dict=False)[0], base),
                "builds": ct.builds,
            }
        )
        save()
        log(f"lora: {result['records'][-1]}")
    if "artifact" in phases:
        mem_one = torch.cuda.mem_get_info()
        load_lora(ct, make_random_lora(model, 64, seed=3, std=0.02), "c", 0.7)
        expected = ct(**kw, return_dict=False)[0].clone()
        tmp = Path(tempfile.mkdtemp())
        t0 = time.perf_counter()
        save_compiled(ct, tmp / "art")  # builds the other two engine sets first
        save_s = time.perf_counter() - t0
        build_all_s = sum(b.build_s or 0 for b in ct.backends)
        mem_all = torch.cuda.mem_get_info()
        size = sum(p.stat().st_size for p in (tmp / "art").rglob("*") if p.is_file())
        unload_lora(ct)  # the same artifact without an adapter: the weights and the engines
        save_compiled(ct, tmp / "plain")
        plain = sum(p.stat().st_size for p in (tmp / "plain").rglob("*") if p.is_file())
        engine_files = [p for p in (tmp / "plain").rglob("*.engine") if p.is_file()]
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        torch.save({k: v.cpu() for k, v in kw.items()}, tmp / "kw.pt")
        torch.save(expected.cpu(), tmp / "expected.pt")
        code = f"""
import json, time, torch
t_import = time.perf_counter()
import prx_compile
import torch_tensorrt  # once per process, as a server or a notebook that runs PRXPipeline does: timed
from diffusers import PRXPipeline, PRXTransformer2DModel  # apart from the load
from prx_compile import load_compiled
t_import = time.perf_counter() - t_import
t0 = time.perf_counter()
ct = load_compiled({str(tmp / "art")!r})
load_s = time.perf_counter() - t0
kw = {{k: v.cuda() for k, v in torch.load({str(tmp / "kw.pt")!r}).items()}}
out = ct(**kw, return_dict=False)[0]
torch.cuda.synchronize()
first = time.perf_counter() - t0
want = torch.load({str(tmp / "expected.pt")!r}).cuda()
print(json.dumps({{"import_s": t_import, "load_s": load_s, "load_to_first_step_s": first,
                  "bitexact": bool(torch.equal(out, want)), "builds": ct.builds}}))
"""
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        probe = Path(__file__).parent / "probes" / "profile_load.py"
        prof = subprocess.run(
            [sys.executable, str(probe), str(tmp / "art")], capture_output=True, text=True, timeout=600
        )
        (out / f"{name}_profile.txt").write_text(prof.stdout + prof.stderr[-2000:])
        loaded = (
            json.loads(p.stdout.strip().splitlines()[-1])
            if p.returncode == 0
            else {"error": p.stderr[-3000:]}
        )
        result["records"].append(
            {
                "path": "artifact",
                "weights": "inputs",
                "size_gb": size / 1e9,
                "size_gb_without_lora": plain / 1e9,
                "engine_files": len(engine_files),
                "engine_mb": sum(p.stat().st_size for p in engine_files) / 2**20,
                "weights_gb": weights / 1e9,
                "save_s": save_s,
                "engine_sets": len(ct.backends),
                "build_s_all_sets": build_all_s,
                "first_set_build_s": build_s,
                "gpu_mem_used_gb_one_set": (mem_one[1] - mem_one[0]) / 2**30,
                "gpu_mem_used_gb_all_sets": (mem_all[1] - mem_all[0]) / 2**30,
                **{
                    k: loaded.get(k)
                    for k in ("import_s", "load_s", "load_to_first_step_s", "bitexact", "builds", "error")
                },
                "first_step_s": (loaded["load_to_first_step_s"] - loaded["load_s"])
                if "load_s" in loaded
                else None,
            }
        )
        save()
        log(f"artifact: {result['records'][-1]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phases", nargs="+", default=["perf"])
    ap.add_argument("--weights", nargs="+", default=["inputs", "engine"])
    ap.add_argument("--cache", help="engine cache of the fp8 phases (default: a new temporary folder)")
    ap.add_argument("--no-peers", action="store_true", help="perf without eager and torch.compile")
    ap.add_argument("--ablation", action="store_true", help="fp8_profile: also build without fp8_mlp")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fp8_cache = args.cache or tempfile.mkdtemp()  # the fp8 phases share their 1024² b2 engines
    jobs = {
        "perf": lambda: perf(args.out, args.weights, not args.no_peers),
        "peers": lambda: max_autotune(args.out),
        "modes": lambda: modes(args.out),
        "lora": lambda: lora_and_artifact(args.out, args.phases),
        "fp8": lambda: fp8(args.out, fp8_cache),
        "fp8_more": lambda: fp8_more(args.out, fp8_cache),
        "fp8_inductor": lambda: fp8_inductor(args.out),
        "range_profile": lambda: range_profile(args.out),
        "fp8_profile": lambda: fp8_profile(args.out, fp8_cache, args.ablation),
        "fp8_pipeline": lambda: fp8_pipeline(args.out, fp8_cache),
        "artifact_static": lambda: lora_and_artifact(
            args.out, ["artifact"], "prx-1024-bf16-static", fp8_cache, "artifact_static"
        ),
    }
    if "artifact" in args.phases and "lora" not in args.phases:
        jobs["artifact"] = lambda: lora_and_artifact(args.out, args.phases)
    for phase in args.phases:
        if phase not in jobs:
            continue
        log(f"phase {phase}")
        try:
            jobs[phase]()
        except Exception:
            traceback.print_exc()
            (args.out / f"error_{phase}.txt").write_text(traceback.format_exc())
        torch.cuda.empty_cache()
    log("done")


if __name__ == "__main__":
    main()
